"""Paged decode attention through JAX's Pallas TPU kernel (aepo_jax/model/_paged_tpu.py): in Pallas's TPU interpret
mode on CPU against the plain-jnp reference (itself checked against numpy), under a CPU mesh through shard_map, and
compiled by XLA:TPU for a v6e slice on this host (needs libtpu).

The kernel rounds K and V to bfloat16 after loading them (q and the softmax stay float32), so its results are
compared with the reference on bfloat16-rounded pools: with float32 q and pools they then agree to float32
rounding (REL; measured <= 1.7e-7), while against the unrounded float32 reference they differ by ~2e-3 of the
largest output (measured 1.9e-3 to 2.8e-3). With bfloat16 q and pools the output is bfloat16: one rounding (REL_BF16)."""

import importlib.util
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from aepo_jax import parallel
from aepo_jax.model import _paged_tpu

REL = 1e-5  # max |Δ| / max |reference|, float32 q and pools vs the reference on bf16-rounded K/V; measured <= 1.7e-7
REL_BF16 = 4e-3  # bfloat16 q, pools and output: one bfloat16 rounding (2^-8 relative); measured <= 5.1e-4


def _inputs(s=4, h=8, kh=2, d=128, ps=16, pages=8, pool=40, dtype=jnp.float32, seed=0):
  """q [s, h, d], pools [kh, pool, ps, d], lengths (1, 0, a full table, ragged ones) and a page table of distinct
  shuffled page ids (no row's pages contiguous or in order)."""
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.normal(size=shape).astype(np.float32), dtype)  # noqa: E731
  q, k, v = f(s, h, d), f(kh, pool, ps, d), f(kh, pool, ps, d)
  table = jnp.asarray(rng.permutation(pool)[: s * pages].reshape(s, pages), jnp.int32)
  lengths = np.array([1, 0, pages * ps] + list(rng.integers(2, pages * ps, max(s - 3, 0))))[:s]
  return q, k, v, jnp.asarray(lengths, jnp.int32), table


def _bf16(x):
  return x.astype(jnp.bfloat16).astype(jnp.float32)


def _rel(got, want):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.isfinite(got).all()
  return float(np.abs(got - want).max() / np.abs(want).max())


def test_reference_equals_numpy_per_sequence():
  q, k, v, lengths, table = _inputs(s=5, h=6, kh=3, d=16, ps=4, pages=5, pool=30)
  got = np.asarray(_paged_tpu.paged_decode_reference(q, k, v, lengths, table))
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  table = np.asarray(table)
  for s, n in enumerate(np.asarray(lengths)):
    keys = k[:, table[s]].reshape(3, -1, 16)[:, :n]  # [K, n, D]
    vals = v[:, table[s]].reshape(3, -1, 16)[:, :n]
    for head in range(6):
      logits = keys[head // 2] @ q[s, head] / 4.0
      w = np.exp(logits - logits.max()) if n else logits
      want = (w / w.sum()) @ vals[head // 2] if n else np.zeros(16)
      np.testing.assert_allclose(got[s, head], want, rtol=1e-5, atol=1e-5)


def test_pages_per_block_divides_the_table():
  assert _paged_tpu.pages_per_block(320, 64) == 8  # 512 tokens
  assert _paged_tpu.pages_per_block(8, 16) == 8
  assert _paged_tpu.pages_per_block(100, 16) == 25
  assert _paged_tpu.pages_per_block(7, 16) == 7
  assert _paged_tpu.pages_per_block(37, 16) == 1  # a prime above the limit
  assert _paged_tpu.pages_per_block(6, 1024) == 1  # a page larger than the block
  with pytest.raises(ValueError, match="does not divide"):
    _paged_tpu.paged_decode_attention(*_inputs(), interpret=True, pages_per_compute_block=3)


@pytest.mark.parametrize(
  "heads, block",
  [(8, None), (8, 2), (16, 1)],  # groups of 4 (the kernel's f32 [.., 1, D] q layout) and 8; one or several blocks
)
def test_interpret_mode_equals_the_reference_on_bf16_rounded_pools(heads, block):
  q, k, v, lengths, table = _inputs(h=heads)
  fn = jax.jit(lambda *a: _paged_tpu.paged_decode_attention(*a, interpret=True, pages_per_compute_block=block))
  got = fn(q, k, v, lengths, table)
  assert got.shape == q.shape and got.dtype == jnp.float32
  assert _rel(got, _paged_tpu.paged_decode_reference(q, _bf16(k), _bf16(v), lengths, table)) <= REL
  assert _rel(got, _paged_tpu.paged_decode_reference(q, k, v, lengths, table)) > 1e-4  # the kernel rounds K/V
  assert not np.asarray(got[1]).any()  # length 0: zeros
  jaxpr = str(jax.make_jaxpr(lambda *a: _paged_tpu.paged_decode_attention(*a, interpret=True))(q, k, v, lengths, table))
  assert "pallas_call" in jaxpr and "shard_map" not in jaxpr


def test_bfloat16_inputs_and_lengths_past_the_table():
  q, k, v, lengths, table = _inputs(dtype=jnp.bfloat16, seed=1)
  lengths = lengths.at[3].set(10_000)  # clamped to the table's 128 tokens
  got = _paged_tpu.paged_decode_attention(q, k, v, lengths, table, interpret=True)
  want = _paged_tpu.paged_decode_reference(q.astype(jnp.float32), k, v, jnp.minimum(lengths, 128), table)
  assert got.dtype == jnp.bfloat16
  assert _rel(got, want) <= REL_BF16


@pytest.mark.parametrize(
  "shape, heads_sharded",
  [((1, 1, 1), False), ((1, 1, 2), True), ((2, 1, 2), True), ((1, 1, 4), False)],  # 2 KV heads over tensor=4
)
def test_under_a_mesh_the_kernel_runs_in_shard_map(shape, heads_sharded):
  n = int(np.prod(shape))
  if len(jax.devices()) < n:
    pytest.skip(f"needs {n} devices")
  mesh = parallel.make_mesh(shape, jax.devices()[:n])
  q, k, v, lengths, table = _inputs()

  def fn(*a):
    return _paged_tpu.paged_decode_attention(*a, mesh=mesh, interpret=True)

  got = jax.jit(fn)(q, k, v, lengths, table)
  assert got.sharding.spec == (PartitionSpec(None, "tensor") if heads_sharded else PartitionSpec())
  assert _rel(got, _paged_tpu.paged_decode_reference(q, _bf16(k), _bf16(v), lengths, table)) <= REL
  jaxpr = str(jax.make_jaxpr(fn)(q, k, v, lengths, table))
  assert "shard_map" in jaxpr and "pallas_call" in jaxpr


def test_compiles_for_a_v6e_slice_with_heads_over_tensor():
  """Qwen3-14B's attention shapes per layer (40 query heads, 8 KV heads, D 128) over a v6e 2x2 host with tensor=4:
  10 query heads and 2 KV heads per chip, one Mosaic kernel (measured: lower 0.2 s, compile 0.4 s)."""
  if importlib.util.find_spec("libtpu") is None:
    if os.environ.get("AEPO_JAX_REQUIRE_LIBTPU") == "1":
      raise RuntimeError("libtpu is not installed but AEPO_JAX_REQUIRE_LIBTPU=1: pip install -e \".[tpu]\"")
    pytest.skip("libtpu is not installed (pip install -e \".[tpu]\")")
  from aepo_jax.train._compile import mosaic_kernels, topology_devices

  mesh = parallel.make_mesh((1, 1, 4), topology_devices("v6e:2x2"))
  s, h, kh, d, ps, pool, pages = 48, 40, 8, 128, 64, 4096, 320

  def sds(shape, dtype, *spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))

  args = (
    sds((s, h, d), jnp.bfloat16, None, "tensor"),
    sds((kh, pool, ps, d), jnp.bfloat16, "tensor"),
    sds((kh, pool, ps, d), jnp.bfloat16, "tensor"),
    sds((s,), jnp.int32),
    sds((s, pages), jnp.int32),
  )
  t0 = time.perf_counter()
  lowered = jax.jit(lambda *a: _paged_tpu.paged_decode_attention(*a, mesh=mesh)).lower(*args)
  compiled = lowered.compile()
  seconds = time.perf_counter() - t0
  hlo = compiled.as_text()
  assert mosaic_kernels(lowered) == ("paged_flash_attention_kernel_inline_seq_dim",)
  assert hlo.count('custom_call_target="tpu_custom_call"') == 1
  assert f"f32[{s},{h // 4},1,{d}]" in hlo  # the kernel's output on one chip: 10 of the 40 query heads
  assert compiled.output_shardings.spec == PartitionSpec(None, "tensor")
  assert seconds < 60, seconds


def test_compiled_decode_writes_the_paged_pool_in_place():
  """The engine's compiled TPU decode (XLA:TPU on this host) updates each layer's KV pool in its own layout. Scattering
  the new entries as `pool.at[:, page_s, off_s]` (KV heads leading, not indexed) made XLA:TPU relayout the whole pool
  (minor-to-major {3,0,2,1}) to scatter, then copy it back: two pool copies per layer and step (~200 MB each per chip
  for Qwen3-14B on v5p:4x4x2, with 2 KV heads per chip). Indexing every dim but head_dim scatters head_dim rows into
  the pool as laid out. Shapes: 2 KV heads per chip (8 over tensor=4), a 67 MB pool per chip and layer; 10 query
  heads per chip (40 over tensor=4), as Qwen3-14B."""
  if importlib.util.find_spec("libtpu") is None:
    if os.environ.get("AEPO_JAX_REQUIRE_LIBTPU") == "1":
      raise RuntimeError("libtpu is not installed but AEPO_JAX_REQUIRE_LIBTPU=1: pip install -e \".[tpu]\"")
    pytest.skip("libtpu is not installed (pip install -e \".[tpu]\")")
  import re

  from aepo_jax import model as model_lib
  from aepo_jax.model import ModelConfig
  from aepo_jax.rollout import Engine
  from aepo_jax.train._compile import _abstract, topology_devices

  cfg = ModelConfig(
    family="qwen3",
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=40,
    num_kv_heads=8,
    head_dim=128,
    qk_norm=True,
    dtype="bfloat16",
    param_dtype="bfloat16",
  )
  mesh = parallel.local_mesh({"data": 1, "fsdp": 1, "tensor": 4}, topology_devices("v6e:2x2"))
  engine = Engine(
    cfg,
    max_slots=16,
    max_len=512,
    eos_ids=(0,),
    mesh=mesh,
    cpu_kernels=False,
    kv_layout="paged",
    page_size=64,
    num_pages=2049,
  )
  weights = _abstract(model_lib.param_shapes(cfg), model_lib.param_shardings(cfg, mesh))
  hlo = engine.lower_decode(weights, 4).compile().as_text()
  pool = jax.tree.leaves(engine.abstract_decode_state().cache)[0]
  per_chip = pool.sharding.shard_shape(pool.shape)
  assert per_chip == (2, 2049, 64, 128), per_chip
  shape = re.escape("bf16[" + ",".join(map(str, per_chip)) + "]")
  layouts = re.findall(rf"{shape}\{{([\d,]+):", hlo)  # minor-to-major of every pool-shaped buffer
  assert layouts and set(layouts) == {"3,2,1,0"}, sorted(set(layouts))
  scatters = re.findall(rf"= {shape}\{{([\d,]+):\S* scatter\(", hlo)
  assert len(scatters) == 4 and set(scatters) == {"3,2,1,0"}  # k and v of 2 layers, written in place
  # The stacked q_proj (Qwen3-14B's 10 query heads per chip: no multiple of the tile, so XLA:TPU lays it out
  # heads-major) is read where it lies: the decode's dots never copy it to another layout (flattening heads into one
  # dim did, every call: 0.52 GB per chip and step at 40 layers). k_proj and v_proj (2 heads per chip, small tiles)
  # are still copied to the dot's layout: 0.1 GB each per step at 40 layers (the layout API would remove that).
  q_proj = re.escape("bf16[2,256,10,128]")
  assert not re.findall(rf"= {q_proj}\{{[^}}]*\}} copy\(", hlo), "decode relayouts the stacked q_proj"


def test_compiled_decode_keeps_a_small_pool_out_of_vmem(monkeypatch):
  """A small KV pool (here 8 MB per chip and layer) fits in VMEM, and XLA:TPU's memory-space assignment would
  prefetch the whole pool there and write it back around the new entries' scatter, every layer and step
  (Qwen3-30B-A3B with rollout.kv_tokens=98304 on v6e: 25 MB per layer for K and for V; at 2 layers decode's HBM
  traffic is 2.9 GB per step with those copies, 2.1 without). The engine's TPU decode is compiled with
  `_compiled.TPU_DECODE_OPTIONS`, which refuses such copies; the same step without them (the control) has them."""
  if importlib.util.find_spec("libtpu") is None:
    if os.environ.get("AEPO_JAX_REQUIRE_LIBTPU") == "1":
      raise RuntimeError("libtpu is not installed but AEPO_JAX_REQUIRE_LIBTPU=1: pip install -e \".[tpu]\"")
    pytest.skip("libtpu is not installed (pip install -e \".[tpu]\")")
  import re

  from aepo_jax import model as model_lib
  from aepo_jax.model import ModelConfig
  from aepo_jax.rollout import Engine, _compiled
  from aepo_jax.train._compile import _abstract, topology_devices

  cfg = ModelConfig(
    family="qwen3", vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8,
    num_kv_heads=4, head_dim=128, qk_norm=True, dtype="bfloat16", param_dtype="bfloat16",
  )  # fmt: skip
  mesh = parallel.local_mesh({"data": 1, "fsdp": 1, "tensor": 4}, topology_devices("v6e:2x2"))
  engine = Engine(
    cfg, max_slots=16, max_len=512, eos_ids=(0,), mesh=mesh, cpu_kernels=False, kv_layout="paged", page_size=64,
    num_pages=513,
  )  # fmt: skip
  assert engine._decode_fn is _compiled._decode_tpu
  weights = _abstract(model_lib.param_shapes(cfg), model_lib.param_shardings(cfg, mesh))
  pool = jax.tree.leaves(engine.abstract_decode_state().cache)[0]
  assert pool.sharding.shard_shape(pool.shape) == (1, 513, 64, 128)

  def pool_copies():
    hlo = engine.lower_decode(weights, 1).compile().as_text()
    return [line for line in hlo.splitlines() if " copy-start(" in line and re.search(r"\[(1,)?513,64,128\]", line)]

  assert not pool_copies()
  monkeypatch.setattr(Engine, "_decode_fn", property(lambda self: _compiled._decode))
  plain = pool_copies()
  assert plain and all("S(1)" in line for line in plain), plain[:2]  # into VMEM (memory space 1) and back
