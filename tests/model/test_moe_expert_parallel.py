"""Expert parallelism for the Qwen3-MoE block (aepo_jax/model/_expert_parallel.py `experts_parallel`): the rules table
maps the logical axis 'expert' to a mesh axis (`expert_parallel_rules`), each device holds E / n whole experts, and
the (token, expert) pairs go to their expert's device by an all-to-all and back. On 8 fake CPU devices against the
unsharded block: values and gradients, the worst case for the buffers (every pair to one device), replayed routes, a
whole model, one update step; compiled by XLA:TPU for a v5p slice on this host (needs libtpu).

XLA:CPU has no ragged-all-to-all ("HLO opcode `ragged-all-to-all` is not supported by XLA:CPU"), so the TPU
exchange's offsets and sizes run here through a stand-in built from `jax.lax.all_to_all` with the semantics
`jax.lax.ragged_all_to_all` documents (`_ragged_all_to_all_on_cpu`); on TPU the real collective is compiled.

Tolerance (float32): every pair's SwiGLU is the same products as unsharded; what changes is the order of sums (a
weight gradient adds its expert's rows as they arrive from the devices, F's partial down projections are summed
over tensor), so the results agree to float32 rounding relative to the largest value compared: REL, as the other
expert computations (test_moe_gmm.py: measured <= 4.6e-6). Measured for the block, every case and exchange, the
worst case included: <= 3.5e-7 (values), <= 6.0e-7 (gradients); not bit-exact even there, since XLA:CPU blocks a
ragged dot of 256 rows and 2 experts differently from one of 32 rows and 16. The update step's new parameters: REL
of the step taken, plus the parameters' own float32 spacing (lr 1 rounds params - grads)."""

import functools
import importlib.util
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from aepo_jax import model, parallel, testing
from aepo_jax.model import _expert_parallel, _moe
from aepo_jax.parallel._mesh import expert_parallel_rules

import test_moe

REL = 1e-5  # max |Δ| / max |reference|, float32, values and every gradient


def _config(e, k, **kw):
  kw = {"moe_intermediate_size": 16, "moe_impl": "ragged", **kw}
  return testing.tiny_model_config("qwen3_moe", num_experts=e, num_experts_per_tok=k, **kw)


def _rel(got, want):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.isfinite(got).all()
  return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _block_shardings(config, mesh, rules):
  """One sparse layer's parameter shardings (the model's, less the stacked layer axis)."""
  stacked = model.param_shardings(config, mesh, rules)["layers"]["mlp"]
  return jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(*s.spec[1:])), stacked)


def _value_and_grads(config, p, x, routes=None, impl=""):
  def loss(p, x):
    return jnp.sum(jnp.sin(3.0 * _moe.moe(config, p, x, impl, routes=routes)))

  y, used = _moe.moe(config, p, x, impl, routes=routes, return_routes=True)
  return y, used, jax.grad(loss, argnums=(0, 1))(p, x)


def _on_mesh(config, p, x, mesh, rules, routes=None, impl=""):
  """`_value_and_grads` jitted on `mesh` under `rules`, and whether its program exchanged pairs (an all-to-all)."""

  def step(p, x, routes):
    with parallel.sharding_context(mesh, rules):
      return _value_and_grads(config, p, x, routes, impl)

  sharded = jax.device_put(p, _block_shardings(config, mesh, rules))
  jaxpr = str(jax.make_jaxpr(step)(sharded, x, routes))
  return jax.jit(step)(sharded, x, routes), "all_to_all" in jaxpr


def _assert_close(got, want, rel=REL):
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    assert _rel(g, w) <= rel, (jax.tree_util.keystr(path), _rel(g, w))


def _ragged_all_to_all_on_cpu(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
  """`jax.lax.ragged_all_to_all`'s documented semantics from a dense all-to-all: slice i of the operand
  (input_offsets[i], send_sizes[i] rows) goes to device i, which writes it at the output_offsets[i] this device
  gave; rows of `output` nothing is written to are kept. Differentiable like any gather and scatter."""
  m = operand.shape[0]
  r = jnp.arange(m)
  slices = operand[jnp.minimum(input_offsets[:, None] + r, m - 1)]  # [n, m, D]: slice i padded to m rows
  slices = jnp.where((r < send_sizes[:, None])[..., None], slices, 0)
  got = jax.lax.all_to_all(slices, axis_name, 0, 0, tiled=True)  # [n, m, D]: got[s] came from device s
  at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where device s's slice goes here
  rows = jnp.where(r < recv_sizes[:, None], at[:, None] + r, output.shape[0])  # past the end: dropped
  return output.at[rows.reshape(-1)].set(got.reshape(-1, *operand.shape[1:]), mode="drop")


@pytest.fixture
def ragged_on_cpu(monkeypatch):
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_all_to_all_on_cpu)


# ----------------------------------------------------------------------------------------------------
# The rules
# ----------------------------------------------------------------------------------------------------
def test_rules_put_whole_experts_on_each_device():
  """expert -> fsdp: a device of fsdp=4 holds 16 / 4 experts with all of D, F still over tensor; the default rules
  keep every expert on every device (D over fsdp, as before)."""
  config = _config(16, 2)
  mesh = parallel.make_mesh({"fsdp": 4, "tensor": 2}, jax.devices()[:8])
  ep = model.param_shardings(config, mesh, expert_parallel_rules("fsdp"))["layers"]["mlp"]
  default = model.param_shardings(config, mesh)["layers"]["mlp"]
  assert tuple(ep["experts"]["up_proj"]["kernel"].spec) == (None, "fsdp", None, "tensor")
  assert tuple(ep["experts"]["down_proj"]["kernel"].spec) == (None, "fsdp", "tensor", None)
  assert ep["experts"]["up_proj"]["kernel"].shard_shape((2, 16, 32, 16)) == (2, 4, 32, 8)
  assert tuple(default["experts"]["up_proj"]["kernel"].spec) == (None, None, "fsdp", "tensor")
  assert tuple(default["experts"]["down_proj"]["kernel"].spec) == (None, None, "tensor", "fsdp")
  assert expert_parallel_rules("fsdp", ()) == () and dict(parallel.DEFAULT_RULES)["expert"] is None


def test_falls_back_where_the_rows_are_not_split_over_the_expert_axis():
  """No context, one device, expert -> tensor (the rows are not split over it), 3 rows on fsdp=4: no exchange."""
  config = _config(8, 2)
  mesh = parallel.make_mesh({"fsdp": 4, "tensor": 2}, jax.devices()[:8])
  assert _expert_parallel.expert_parallel_axes(config, 32) == ()
  with parallel.sharding_context(mesh, expert_parallel_rules("fsdp")):
    assert _expert_parallel.expert_parallel_axes(config, 32) == ("fsdp",)
    assert _expert_parallel.expert_parallel_axes(config, 3) == ()
  with parallel.sharding_context(mesh, expert_parallel_rules("tensor")):
    assert _expert_parallel.expert_parallel_axes(config, 32) == ()
  with parallel.sharding_context(parallel.make_mesh((1, 1, 1), jax.devices()[:1]), expert_parallel_rules("fsdp")):
    assert _expert_parallel.expert_parallel_axes(config, 32) == ()


# ----------------------------------------------------------------------------------------------------
# The block
# ----------------------------------------------------------------------------------------------------
CASES = [  # (E, k, mesh, expert axes)
  (8, 1, {"fsdp": 8}, "fsdp"),
  (16, 2, {"fsdp": 4, "tensor": 2}, "fsdp"),
  (8, 2, {"data": 2, "fsdp": 2, "tensor": 2}, "fsdp"),
  (16, 2, {"data": 2, "fsdp": 4}, ("data", "fsdp")),
]


def _case_id(case):
  e, k, mesh, axes = case
  return f"E{e}-top{k}-" + "x".join(f"{a}{s}" for a, s in mesh.items()) + "-over-" + "+".join(np.atleast_1d(axes))


@pytest.mark.parametrize("exchange", ["dense", "ragged"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_block_equals_unsharded(case, exchange, monkeypatch):
  e, k, shape, axes = case
  if exchange == "ragged":
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_all_to_all_on_cpu)
  config = _config(e, k)
  p = test_moe._expert_params(config, seed=e + k)
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 8, config.hidden_size), jnp.float32)
  want = jax.jit(functools.partial(_value_and_grads, config))(p, x)
  mesh = parallel.make_mesh(shape, jax.devices()[:8])
  platform = "tpu" if exchange == "ragged" else "cpu"
  monkeypatch.setattr(parallel, "current_platform", lambda: platform)  # picks the exchange
  got, exchanged = _on_mesh(config, p, x, mesh, expert_parallel_rules(axes))
  assert exchanged
  np.testing.assert_array_equal(got[1], want[1])  # the same routes
  _assert_close(got, want)


@pytest.mark.parametrize("exchange", ["dense", "ragged"])
@pytest.mark.parametrize("k", [1, 2])
def test_every_pair_to_one_device_drops_nothing(k, exchange, monkeypatch):
  """Replayed routes send every token to experts 0 (and 1) of device 0: each device's whole buffer block for device
  0 is full, device 0 receives 8 x its own pairs, the other devices nothing. Every token still gets its experts."""
  if exchange == "ragged":
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_all_to_all_on_cpu)
  monkeypatch.setattr(parallel, "current_platform", lambda: "tpu" if exchange == "ragged" else "cpu")
  config = _config(16, k)
  p = test_moe._expert_params(config, seed=3)
  x = jax.random.normal(jax.random.PRNGKey(2), (4, 8, config.hidden_size), jnp.float32)
  routes = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (4, 8, k))
  want = jax.jit(functools.partial(_value_and_grads, config))(p, x, routes)
  mesh = parallel.make_mesh({"fsdp": 8}, jax.devices()[:8])
  got, exchanged = _on_mesh(config, p, x, mesh, expert_parallel_rules("fsdp"), routes)
  assert exchanged
  np.testing.assert_array_equal(got[1], routes)
  _assert_close(got, want)
  assert float(jnp.abs(got[0]).min()) > 0  # no token dropped (a dropped one would come back 0)


def test_replayed_routes_give_the_same_block(ragged_on_cpu):
  """Routes recorded by one forward and replayed on the expert-parallel mesh: the same experts, values and
  gradients as the unsharded block replaying them, and as the expert-parallel block choosing them itself; a row of
  -1 (no recorded route) takes the router's own choice."""
  config = _config(16, 2)
  p = test_moe._expert_params(config, seed=5)
  x = jax.random.normal(jax.random.PRNGKey(3), (4, 8, config.hidden_size), jnp.float32)
  mesh = parallel.make_mesh({"fsdp": 4, "tensor": 2}, jax.devices()[:8])
  rules = expert_parallel_rules("fsdp")
  chosen, _ = _on_mesh(config, p, x, mesh, rules)
  routes = chosen[1].at[0, :3].set(-1)
  replayed, _ = _on_mesh(config, p, x, mesh, rules, routes)
  want = jax.jit(functools.partial(_value_and_grads, config))(p, x, routes)
  np.testing.assert_array_equal(replayed[1], chosen[1])
  _assert_close(replayed, want)
  _assert_close(replayed, chosen)
  # other routes than the router's: still the unsharded block's
  other = (chosen[1] + 5) % 16
  got, _ = _on_mesh(config, p, x, mesh, rules, other)
  _assert_close(got, jax.jit(functools.partial(_value_and_grads, config))(p, x, other))


def test_gmm_in_interpret_mode_equals_unsharded():
  """The local experts through the Pallas grouped matmul (interpret mode on CPU), its rows past the received
  pairs outside every group: values and gradients as the unsharded 'ragged' block."""
  config = _config(8, 2)
  p = test_moe._expert_params(config, seed=7)
  x = jax.random.normal(jax.random.PRNGKey(4), (2, 8, config.hidden_size), jnp.float32)
  want = jax.jit(functools.partial(_value_and_grads, config))(p, x)
  mesh = parallel.make_mesh({"fsdp": 4, "tensor": 2}, jax.devices()[:8])
  got, exchanged = _on_mesh(config, p, x, mesh, expert_parallel_rules("fsdp"), impl="gmm")
  assert exchanged
  _assert_close(got, want)


# ----------------------------------------------------------------------------------------------------
# A whole model and an update step
# ----------------------------------------------------------------------------------------------------
def test_model_forward_equals_one_device():
  """The tiny Qwen3-MoE (a sparse and a dense layer) on (data 2, fsdp 4) with the experts over fsdp: the logits
  and the recorded routes of one device."""
  config = _config(8, 2, mlp_only_layers=(1,))
  params = model.init_params(config, jax.random.PRNGKey(0))
  tokens = np.random.RandomState(0).randint(0, config.vocab_size, (8, 12)).astype(np.int32)
  want = model.forward(config, params, tokens, return_routes=True)
  mesh = parallel.make_mesh({"data": 2, "fsdp": 4}, jax.devices()[:8])
  rules = expert_parallel_rules("fsdp")
  sharded = jax.device_put(params, model.param_shardings(config, mesh, rules))

  def fwd(p, tokens):
    with parallel.sharding_context(mesh, rules):
      return model.forward(config, p, tokens, return_routes=True)

  assert "all_to_all" in str(jax.make_jaxpr(fwd)(sharded, tokens))
  got = jax.jit(fwd)(sharded, tokens)
  np.testing.assert_array_equal(got[1], want[1])
  assert _rel(got[0], want[0]) <= REL


def _update(config, mesh, rules, batch_np, params):
  from aepo_jax.train._batch import shard_batch
  from aepo_jax.train._step import init_train_state, make_update_step

  sgd = optax.sgd(1.0)  # new params = params - grads: parameter differences are gradient differences
  step = make_update_step(config, loss_fn="ppo", optimizer=sgd, micro_batches=2, mesh=mesh, rules=rules)
  p, s = init_train_state(config, params, sgd, mesh, rules)
  batch = shard_batch(batch_np, mesh, rules)
  exchanged = "all-to-all" in step.lower(p, s, batch).compile().as_text()
  p, _, metrics = step(p, s, batch)
  return jax.device_get(p), jax.device_get(metrics), exchanged


@pytest.mark.slow
@pytest.mark.parametrize("replay", [False, True], ids=["routed", "replayed"])
def test_update_step_equals_one_device(replay):
  """One jitted RL update (2 micro-batches, sgd lr 1) with the experts over fsdp on (data 2, fsdp 4): the new
  parameters and the loss of the one-device step, with the router's routes or replayed ones."""
  from aepo_jax.train._batch import micro_batches

  config = _config(8, 2, vocab_size=128)
  params = jax.tree.map(np.asarray, model.init_params(config, jax.random.PRNGKey(0)))
  rng = np.random.default_rng(0)
  n, t = 16, 16
  arrays = {
    "tokens": rng.integers(3, config.vocab_size, (n, t)).astype(np.int32),
    "attention_mask": np.ones((n, t), np.int32),
    "loss_mask": (np.arange(t) >= 4).astype(np.int32)[None].repeat(n, 0),
    "advantages": rng.normal(size=(n, 1)).repeat(t, 1).astype(np.float32),
    "old_log_prob": np.full((n, t), -np.log(config.vocab_size), np.float32),
  }
  if replay:
    arrays["routes"] = rng.integers(0, 8, (n, t, 2, 2)).astype(np.int32)  # two sparse layers, top 2
    arrays["routes"][..., 1] = (arrays["routes"][..., 0] + 1 + rng.integers(0, 7, (n, t, 2))) % 8  # distinct
  batch = micro_batches(arrays, micro_batch_size=8, pad_id=0, seq_len=t)
  want_p, want_m, _ = _update(
    config, parallel.make_mesh((1, 1, 1), jax.devices()[:1]), parallel.DEFAULT_RULES, batch, params
  )
  mesh = parallel.make_mesh({"data": 2, "fsdp": 4}, jax.devices()[:8])
  got_p, got_m, exchanged = _update(config, mesh, expert_parallel_rules("fsdp"), batch, params)
  assert exchanged
  assert abs(got_m["train/loss"] - want_m["train/loss"]) <= 1e-5
  moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), want_p, params)  # the gradient step itself
  for (path, g), w, m in zip(
    jax.tree_util.tree_flatten_with_path(got_p)[0], jax.tree.leaves(want_p), jax.tree.leaves(moved)
  ):
    ulps = 2 * np.spacing(np.abs(w).max())  # lr 1: params - grads rounds to the parameters' float32 spacing
    assert np.abs(np.asarray(g) - w).max() <= REL * m + ulps, jax.tree_util.keystr(path)


# ----------------------------------------------------------------------------------------------------
# XLA:TPU
# ----------------------------------------------------------------------------------------------------
def _needs_libtpu():
  if importlib.util.find_spec("libtpu") is None:
    if os.environ.get("AEPO_JAX_REQUIRE_LIBTPU") == "1":
      raise RuntimeError('libtpu is not installed but AEPO_JAX_REQUIRE_LIBTPU=1: pip install -e ".[tpu]"')
    pytest.skip('libtpu is not installed (pip install -e ".[tpu]")')


def _compiled_block(config, mesh, rules, tokens):
  """The block's forward and backward (bfloat16) compiled for `mesh`, its gradients laid out as the parameters (as
  the update step keeps them); and the seconds it took."""
  shapes = model.param_shapes(config)["layers"]["mlp"]
  p = jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape[1:], jnp.bfloat16, sharding=sh),
    shapes,
    _block_shardings(config, mesh, rules),
  )
  rows = NamedSharding(mesh, parallel.logical_to_mesh(PartitionSpec("activation_batch"), rules))
  x = jax.ShapeDtypeStruct((8, tokens // 8, config.hidden_size), jnp.bfloat16, sharding=rows)

  def step(p, x):
    with parallel.sharding_context(mesh, rules):
      loss = lambda p, x: jnp.sum(jnp.square(_moe.moe(config, p, x).astype(jnp.float32)))  # noqa: E731
      return jax.value_and_grad(loss, argnums=(0, 1))(p, x)

  out_shardings = (NamedSharding(mesh, PartitionSpec()), (jax.tree.map(lambda a: a.sharding, p), rows))
  t0 = time.perf_counter()
  compiled = jax.jit(step, out_shardings=out_shardings).lower(p, x).compile()
  return compiled, time.perf_counter() - t0


def _peak_bytes(compiled):
  m = compiled.memory_analysis()
  return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def test_ragged_impl_compiles_for_a_v5p_slice():
  """moe_impl='ragged' with the experts over fsdp on v5p:2x2x2: the real ragged-all-to-all (the CPU tests run a
  stand-in), forward and backward, through shard_map's varying-axes check."""
  _needs_libtpu()
  config = _config(16, 2, hidden_size=256, moe_intermediate_size=256, dtype="bfloat16")
  mesh = parallel.make_mesh({"fsdp": 4, "tensor": 2}, parallel.topology_devices("v5p:2x2x2"))
  # XLA:TPU's ragged dot is a Mosaic kernel too: at this suite's 'highest' precision it refuses bfloat16 ("Bad lhs
  # type"), with or without expert parallelism; bfloat16 products are exact at 'default'.
  with jax.default_matmul_precision("default"):
    compiled, _ = _compiled_block(config, mesh, expert_parallel_rules("fsdp"), tokens=256)
  hlo = compiled.as_text()
  assert hlo.count("ragged-all-to-all(") >= 4 and "ragged-dot" in hlo  # forward there and back, and transposed


@pytest.mark.slow
def test_compiles_for_a_v5p_slice_with_the_experts_split():
  """The block for v5p:2x2x2 (8 chips, fsdp 4 x tensor 2), 'auto' = 'gmm', 64 experts of D 1024 x F 512, 512
  tokens: with the experts over fsdp a chip holds 16 of them, exchanges pairs by ragged-all-to-all and needs less
  memory than the replicated layout, which gathers all 64 experts' D on every chip. (With many tokens per chip and
  small experts the worst-case receive buffers, fsdp x a chip's pairs, cost more than the gathered weights save:
  docs/performance.md.)"""
  _needs_libtpu()
  config = testing.tiny_model_config(
    "qwen3_moe", hidden_size=1024, num_experts=64, num_experts_per_tok=4, moe_intermediate_size=512, dtype="bfloat16"
  )
  mesh = parallel.make_mesh({"fsdp": 4, "tensor": 2}, parallel.topology_devices("v5p:2x2x2"))
  with parallel.sharding_context(mesh):
    assert _moe.resolve_impl(config) == "gmm"
  ep, ep_s = _compiled_block(config, mesh, expert_parallel_rules("fsdp"), tokens=512)
  rep, rep_s = _compiled_block(config, mesh, parallel.DEFAULT_RULES, tokens=512)
  hlo = ep.as_text()
  assert "ragged-all-to-all(" in hlo and "bf16[16,1024,256]" in hlo  # a chip's gate_proj: 16 experts, F / 2
  assert "bf16[64,1024,256]" not in hlo and "bf16[64,1024,256]" in rep.as_text()
  print(
    f"\nv5p:2x2x2 fsdp 4 x tensor 2, peak per chip: experts over fsdp {_peak_bytes(ep) / 2**20:.1f} MiB "
    f"({ep_s:.0f} s to compile), default rules {_peak_bytes(rep) / 2**20:.1f} MiB ({rep_s:.0f} s)"
  )
  assert _peak_bytes(ep) < 0.5 * _peak_bytes(rep)  # measured 62.5 vs 148.8 MiB
