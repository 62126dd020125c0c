"""The Qwen3-MoE expert block through the Pallas TPU grouped matmul (`moe_impl='gmm'`, aepo_jax/model/_experts.py): in
Pallas's interpret mode on CPU against the 'ragged' and 'dense' computations (values and gradients), on a CPU mesh
through shard_map, in a whole tiny model, and compiled by XLA:TPU for a v5e slice on this host (needs libtpu).

Tolerance (float32): the three computations sum the same products in different orders (the kernel accumulates its
contracted tiles in float32, 'dense' adds E - k zero-weighted experts), so they agree to float32 rounding relative
to the largest value compared: REL (measured <= 4.6e-6, the top-8 case's down_proj gradient; outputs <= 2.4e-6).
In bfloat16 the kernel's output is bfloat16: against 'ragged' in bfloat16, a few bfloat16 roundings (REL_BF16)."""

import functools
import importlib.util
import os
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from aepo_jax import model, parallel, testing
from aepo_jax.model import _experts, _moe

import test_moe

REL = 1e-5  # max |Δ| / max |reference|, float32, gmm against ragged and dense (values and every gradient)
# bfloat16 x, weights and outputs: 2^-8 per rounding, a few of them; measured 0 (the same sums, the same roundings)
REL_BF16 = 1e-2
SMALL_TILES = (16, 128, 128)  # several row tiles per matmul, groups starting and ending inside tiles


def _expert_params(d, e, f, seed=0):
  shape = types.SimpleNamespace(hidden_size=d, num_experts=e, moe_intermediate_size=f)
  return test_moe._expert_params(shape, seed)


def _block_shardings(config, mesh):
  """One sparse layer's parameter shardings (the model's, less the stacked layer axis)."""
  stacked = model.param_shardings(config, mesh)["layers"]["mlp"]
  return jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(*s.spec[1:])), stacked)


def _rel(got, want):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.isfinite(got).all()
  return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _routing(n, k, experts, seed):
  """experts [n, k] drawn without repeats per token from `experts`, gates [n, k] positive (not normalised)."""
  rng = np.random.default_rng(seed)
  chosen = np.stack([rng.choice(experts, k, replace=False) for _ in range(n)]).astype(np.int32)
  return jnp.asarray(rng.uniform(0.1, 1.0, (n, k)), jnp.float32), jnp.asarray(chosen)


def test_tiling_is_clamped_to_the_shape():
  assert _experts.gmm_tiling(26, 32, 16) == (32, 128, 128)  # rows to 16, k and n to the 128 lanes
  assert _experts.gmm_tiling(4096 * 8, 2048, 192) == (512, 1024, 256)  # Qwen3-30B-A3B's gate_proj, F over tensor=4
  assert _experts.gmm_tiling(40, 160, 136, SMALL_TILES) == (16, 128, 128)
  with pytest.raises(ValueError, match="multiple of 16"):
    _experts.gmm_tiling(40, 160, 136, (8, 128, 128))


@pytest.mark.parametrize(
  "n, d, e, f, k, used, tiling",
  [
    (13, 32, 4, 16, 1, range(4), _experts.GMM_TILING),  # top 1; 13 rows padded to one tile of 16
    (21, 32, 8, 16, 2, [1, 4, 5], SMALL_TILES),  # top 2; experts 0, 2, 3, 6, 7 get no token (7: the padding's)
    (7, 160, 8, 136, 8, range(8), SMALL_TILES),  # top 8 of 8; D and F past one 128 tile (the kernel's k remainder)
    (19, 128, 4, 72, 2, range(4), SMALL_TILES),  # D lane-aligned, F not: gate/up through the transposed operand
  ],
  ids=["top1", "top2_empty_experts", "top8_k_remainder", "transposed_rhs"],
)
def test_gmm_equals_ragged_and_dense_with_gradients(n, d, e, f, k, used, tiling):
  """Outputs and the gradients of a scalar loss w.r.t. x, the gates and the three expert weights; row counts that
  are not a multiple of the row tile (13, 42 and 56 rows, padded to 16, 48 and 64)."""
  p = _expert_params(d, e, f)
  x = jax.random.normal(jax.random.PRNGKey(1), (n, d), jnp.float32)
  gates, experts = _routing(n, k, np.asarray(used), seed=n)
  impls = {
    "gmm": lambda *a: _experts.experts_gmm(*a, max_tiling=tiling),
    "ragged": _experts.experts_ragged,
    "dense": _experts.experts_dense,
  }

  @jax.jit
  def value_and_grads(p, x, gates):
    out = {}
    for name, fn in impls.items():
      loss = lambda p, x, g, fn=fn: jnp.sum(jnp.sin(3.0 * fn(p, x, g, experts, e)))  # noqa: E731
      out[name] = (fn(p, x, gates, experts, e), jax.grad(loss, argnums=(0, 1, 2))(p, x, gates))
    return out

  got = value_and_grads(p, x, gates)
  y, grads = got["gmm"]
  assert y.shape == x.shape
  for ref in ("ragged", "dense"):
    assert _rel(y, got[ref][0]) <= REL, ref
    for (path, g), want in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(got[ref][1])):
      assert _rel(g, want) <= REL, (ref, jax.tree_util.keystr(path))
  unused = np.setdiff1d(np.arange(e), used)
  assert not np.asarray(grads[0]["experts"]["down_proj"]["kernel"])[unused].any()  # padding rows add nothing
  jaxpr = jax.make_jaxpr(lambda p, x: impls["gmm"](p, x, gates, experts, e))(p, x)
  assert "pallas_call" in str(jaxpr)  # the kernel, in interpret mode on CPU


def test_bfloat16_and_dtypes_the_kernel_does_not_take():
  p = _expert_params(32, 4, 16)
  x = jax.random.normal(jax.random.PRNGKey(1), (10, 32), jnp.float32)
  gates, experts = _routing(10, 2, np.arange(4), seed=0)
  bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (p, x))

  @functools.partial(jax.jit, static_argnums=2)
  def value_and_grads(p, x, fn):
    loss = lambda p, x: jnp.sum(jnp.sin(3.0 * fn(p, x, gates, experts, 4).astype(jnp.float32)))  # noqa: E731
    return fn(p, x, gates, experts, 4), jax.grad(loss, argnums=(0, 1))(p, x)

  got = value_and_grads(*bf16, _experts.experts_gmm)
  want = value_and_grads(*bf16, _experts.experts_ragged)
  assert got[0].dtype == jnp.bfloat16 and got[1][1].dtype == jnp.bfloat16
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    assert _rel(g, w) <= REL_BF16, jax.tree_util.keystr(path)
  with pytest.raises(ValueError, match="gmm"):
    _experts.experts_gmm(p, x.astype(jnp.float16), gates, experts, 4)
  with pytest.raises(ValueError, match="moe_impl='gmm'"):
    testing.tiny_model_config(
      "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_impl="gmm", dtype="float16"
    )


def test_sharded_gmm_equals_unsharded_dense():
  """On a (fsdp 2, tensor 4) mesh of fake CPU devices the kernel runs in shard_map (tokens over fsdp, F over
  tensor, the partial down projections summed): the value and the gradients equal the unsharded 'dense' block's."""
  config = testing.tiny_model_config("qwen3_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16)
  p = _expert_params(config.hidden_size, 6, 16)
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 6, config.hidden_size), jnp.float32)

  def value_and_grads(p, x, impl):
    loss = lambda p, x: jnp.sum(jnp.sin(3.0 * _moe.moe(config, p, x, impl)))  # noqa: E731
    return _moe.moe(config, p, x, impl), jax.grad(loss, argnums=(0, 1))(p, x)

  want = jax.jit(value_and_grads, static_argnums=2)(p, x, "dense")
  mesh = parallel.make_mesh({"fsdp": 2, "tensor": 4}, jax.devices()[:8])
  sharded = jax.device_put(p, _block_shardings(config, mesh))
  assert tuple(sharded["experts"]["down_proj"]["kernel"].sharding.spec) == (None, "tensor", "fsdp")

  def step(p, x):
    with parallel.sharding_context(mesh):
      return value_and_grads(p, x, "gmm")

  got = jax.jit(step)(sharded, x)
  assert "shard_map" in str(jax.make_jaxpr(step)(sharded, x))
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    assert _rel(g, w) <= REL, jax.tree_util.keystr(path)


def test_tiny_model_forward_equals_dense():
  """The whole tiny Qwen3-MoE (one sparse and one dense layer) with moe_impl 'gmm' and 'dense'."""
  config = testing.tiny_model_config(
    "qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(1,)
  )
  params = model.init_params(config, jax.random.PRNGKey(0))
  tokens = np.random.RandomState(0).randint(0, config.vocab_size, (2, 11)).astype(np.int32)
  want = model.forward(config.replace(moe_impl="dense"), params, tokens)
  got = model.forward(config.replace(moe_impl="gmm"), params, tokens)
  assert _rel(got, want) <= REL


def test_compiles_for_a_v5e_slice_with_hidden_units_over_tensor():
  """The block's forward and backward in bfloat16 for a v5e 2x2 host with tensor=4: 'auto' resolves to 'gmm' for
  the TPU mesh, the kernel runs in shard_map, and the program calls 9 Mosaic kernels (gmm for gate, up and down;
  in the backward gmm for the input gradients and tgmm for the weight gradients)."""
  if importlib.util.find_spec("libtpu") is None:
    if os.environ.get("AEPO_JAX_REQUIRE_LIBTPU") == "1":
      raise RuntimeError('libtpu is not installed but AEPO_JAX_REQUIRE_LIBTPU=1: pip install -e ".[tpu]"')
    pytest.skip('libtpu is not installed (pip install -e ".[tpu]")')
  from aepo_jax.train._compile import mosaic_kernels, topology_devices

  config = testing.tiny_model_config(
    "qwen3_moe", hidden_size=256, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, dtype="bfloat16"
  )
  mesh = parallel.make_mesh((1, 1, 4), topology_devices("v5e:2x2"))
  shapes = model.param_shapes(config)["layers"]["mlp"]
  p = jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape[1:], jnp.bfloat16, sharding=sh), shapes, _block_shardings(config, mesh)
  )
  x = jax.ShapeDtypeStruct((4, 64, 256), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))

  def step(p, x):
    with parallel.sharding_context(mesh):
      assert _moe.resolve_impl(config) == "gmm"
      assert _moe.resolve_impl(config.replace(dtype="float16")) == "ragged"
      loss = lambda p, x: jnp.sum(jnp.square(_moe.moe(config, p, x).astype(jnp.float32)))  # noqa: E731
      return jax.value_and_grad(loss, argnums=(0, 1))(p, x)

  t0 = time.perf_counter()
  lowered = jax.jit(step).lower(p, x)
  compiled = lowered.compile()
  seconds = time.perf_counter() - t0
  hlo = compiled.as_text()
  assert mosaic_kernels(lowered) == ("kernel",)  # the name megablox gives its gmm and tgmm kernels
  assert hlo.count('custom_call_target="tpu_custom_call"') == 9
  assert "bf16[8,256,128]" in hlo  # a chip's gate_proj: 128 of the 512 hidden units
  assert seconds < 60, seconds
