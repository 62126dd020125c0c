"""The CPU small-M decode kernel (aepo_jax/model/_cpu_decode.py): against numpy, inside the decode forward
against XLA's dots, the engine's choice of path, and the cache of prepared decode weights."""

import dataclasses
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aepo_jax.model import ModelConfig, init_params
from aepo_jax.parallel import _native
from aepo_jax.model import _cpu_decode
from aepo_jax.model import decode_forward, decode_weights
from aepo_jax.rollout import Engine
from aepo_jax.rollout._engine import prepared_weights
from aepo_jax.testing import tiny_model_config

if not {"avx2", "fma"} <= _native.cpu_flags():
  pytest.skip("the CPU decode kernel needs AVX2 and FMA", allow_module_level=True)


def test_kernel_builds_and_loads():
  assert _cpu_decode.available(), _cpu_decode.reason()


@pytest.mark.parametrize("n,k", [(1, 5), (2, 8), (7, 37), (50, 32), (97, 64), (120, 576)])
def test_kernel_matches_numpy(n, k):
  """All row tails (M = 1..13 against the 4-row tiles), column tails (N against the 3-column tiles) and K not a
  multiple of the 8-wide vectors; every layer of a stack is addressed through the index."""
  rng = np.random.default_rng(n * 1000 + k)
  w = rng.standard_normal((3, n, k)).astype(np.float32)
  f = jax.jit(_cpu_decode.matmul_t)
  for m in (1, 3, 4, 5, 8, 13):
    x = rng.standard_normal((m, k)).astype(np.float32)
    for layer in (0, 2):
      got = np.asarray(f(jnp.asarray(x), jnp.asarray(w), jnp.int32(layer)))
      want = x.astype(np.float64) @ w[layer].T.astype(np.float64)
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k), err_msg=f"M={m} layer={layer}")
  # One part (the caller's thread only) gives the same numbers as the pool-split call.
  x = jnp.asarray(rng.standard_normal((8, k)).astype(np.float32))
  np.testing.assert_array_equal(
    _cpu_decode.matmul_t(x, jnp.asarray(w), 1, parts=1), _cpu_decode.matmul_t(x, jnp.asarray(w), 1, parts=4)
  )


def test_kernel_rejects_bad_input():
  x = jnp.ones((2, 8), jnp.float32)
  with pytest.raises(Exception, match="last axis of w must equal"):
    jax.block_until_ready(_cpu_decode.matmul_t(x, jnp.ones((3, 4, 7), jnp.float32), 0))
  with pytest.raises(Exception, match="layer index out of range"):
    jax.block_until_ready(_cpu_decode.matmul_t(x, jnp.ones((3, 4, 8), jnp.float32), 3))
  with pytest.raises(TypeError, match="float32 only"):
    _cpu_decode.matmul_t(x.astype(jnp.bfloat16), jnp.ones((3, 4, 8), jnp.float32), 0)


@pytest.mark.parametrize(
  "shape", [(3, 5, 16, 2, 3, 8), (2, 4, 40, 3, 3, 64), (2, 3, 9, 1, 7, 16), (1, 2, 33, 4, 1, 24), (1, 3, 21, 2, 5, 128)]
)
def test_attention_kernel_matches_numpy(shape):
  """Decode attention read in place from the stacked cache: each slot attends to its entries [0, pos] only (the
  rest of the cache holds garbage it must not read); GQA group sizes 1, 3, 5, 7; head dims 8..128 (tails of the
  32-float value blocks); softmax lengths with and without an 8-wide tail, including a single entry."""
  L, S, T, KH, G, D = shape
  rng = np.random.default_rng(sum(shape))
  k = rng.standard_normal((L, S, T, KH, D)).astype(np.float32)
  v = rng.standard_normal((L, S, T, KH, D)).astype(np.float32)
  q = (2 * rng.standard_normal((S, KH * G * D))).astype(np.float32)
  pos = rng.integers(0, T, S).astype(np.int32)
  pos[0], pos[-1] = T - 1, 0
  garbage = np.arange(T)[None, :, None, None] > pos[:, None, None, None]  # [S, T, 1, 1]
  k_dirty, v_dirty = (np.where(garbage[None], np.float32(1e4), c) for c in (k, v))
  f = jax.jit(_cpu_decode.attention)
  for layer in range(L):
    got = np.asarray(f(jnp.asarray(q), jnp.asarray(k_dirty), jnp.asarray(v_dirty), jnp.int32(layer), jnp.asarray(pos)))
    want, zmax = np.zeros(got.shape), 1.0
    for s in range(S):
      n = pos[s] + 1
      for h in range(KH * G):
        logits = k[layer, s, :n, h // G].astype(np.float64) @ q[s, h * D : (h + 1) * D] / np.sqrt(D)
        zmax = max(zmax, float(np.abs(logits).max()))
        p = np.exp(logits - logits.max())
        want[s, h * D : (h + 1) * D] = (p / p.sum()) @ v[layer, s, :n, h // G]
    # Float32 logits (D-term dots) err by ~sqrt(D) ulps of max|logit|, which moves the softmax average of v by at
    # most that times max|v|: the bound, ~1e-5 here (measured errors: <= 5% of it).
    tol = float(np.finfo(np.float32).eps) * np.sqrt(D) * zmax * float(np.abs(v[layer]).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=f"layer {layer}")
  np.testing.assert_array_equal(  # the caller's thread alone gives the same numbers as the pool-split call
    _cpu_decode.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 0, jnp.asarray(pos), parts=1),
    _cpu_decode.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 0, jnp.asarray(pos), parts=4),
  )


def test_attention_kernel_rejects_bad_input():
  cache = jnp.ones((2, 3, 8, 2, 8), jnp.float32)
  pos = jnp.zeros((3,), jnp.int32)
  with pytest.raises(Exception, match="H a multiple of KH, D % 8 == 0"):
    jax.block_until_ready(_cpu_decode.attention(jnp.ones((3, 20), jnp.float32), cache, cache, 0, pos))
  with pytest.raises(Exception, match="layer index out of range"):
    jax.block_until_ready(_cpu_decode.attention(jnp.ones((3, 32), jnp.float32), cache, cache, 2, pos))
  with pytest.raises(TypeError, match="float32 only"):
    _cpu_decode.attention(jnp.ones((3, 32), jnp.float32), cache.astype(jnp.bfloat16), cache, 0, pos)


def test_off_switch_and_missing_compiler_are_explained(monkeypatch, tmp_path):
  monkeypatch.setenv("AEPO_JAX_CPU_KERNELS", "0")
  assert _cpu_decode._LIB.load() == {"ok": False, "reason": "turned off by AEPO_JAX_CPU_KERNELS=0"}
  monkeypatch.delenv("AEPO_JAX_CPU_KERNELS")
  monkeypatch.setenv("AEPO_JAX_KERNEL_CACHE", str(tmp_path))  # nothing cached: must compile
  monkeypatch.setenv("CXX", "no-such-compiler-aepo")
  status = _cpu_decode._LIB.load()
  assert not status["ok"] and "no C++ compiler 'no-such-compiler-aepo'" in status["reason"]
  assert not list(tmp_path.iterdir())  # no half-written library left behind


def test_extra_compiler_flags_build_a_separate_library(monkeypatch, tmp_path):
  """$AEPO_JAX_KERNEL_CXXFLAGS goes on the compiler's command line after the defaults and into the cache key, so a
  sanitizer build never replaces the normal one; `-DAEPO_UNUSED=1` changes nothing in the code."""
  monkeypatch.setenv("AEPO_JAX_KERNEL_CACHE", str(tmp_path))
  monkeypatch.delenv("AEPO_JAX_KERNEL_CXXFLAGS", raising=False)
  plain = _native.build(_cpu_decode._SRC)
  monkeypatch.setenv("AEPO_JAX_KERNEL_CXXFLAGS", " -DAEPO_UNUSED=1  -O2 ")
  assert _native.flags() == _native.FLAGS + ("-DAEPO_UNUSED=1", "-O2")
  extra = _native.build(_cpu_decode._SRC)
  assert extra != plain and plain.exists() and extra.exists()
  monkeypatch.setenv("AEPO_JAX_KERNEL_CXXFLAGS", "--no-such-flag-aepo")
  with pytest.raises(RuntimeError, match="no-such-flag-aepo"):
    _native.build(_cpu_decode._SRC)


def _ulp_spread(f, params, seeds=3):
  """The largest change of each output of `f(params)` when every parameter is moved by one ulp (relative eps,
  random sign), over a few draws, never below one ulp of the output's largest entry."""
  eps = np.float32(np.finfo(np.float32).eps)
  ref = jax.device_get(f(params))
  spread = jax.tree.map(lambda r: float(eps) * float(np.abs(r).max()), ref)
  for seed in range(seeds):
    rng = np.random.default_rng(1000 + seed)
    moved = jax.tree.map(lambda x: (x * (1 + eps * rng.choice([-1, 1], x.shape))).astype(x.dtype), params)
    diff = jax.tree.map(lambda a, r: float(np.abs(np.asarray(a) - r).max()), jax.device_get(f(moved)), ref)
    spread = jax.tree.map(max, spread, diff)
  return spread


FAMILIES = {  # together: tied and untied head, q/k/v biases, q/k norms
  "qwen2_bias_untied": dict(family="qwen2", attention_bias=True, tie_word_embeddings=False),
  "qwen3_qknorm_tied": dict(family="qwen3", qk_norm=True, tie_word_embeddings=True),
}


def _wider(family):
  """A config wider than the tiny one (6 heads, 3 layers), where the kernel's per-head and per-layer indexing show."""
  return ModelConfig(
    vocab_size=101,
    hidden_size=48,
    intermediate_size=80,
    num_layers=3,
    num_heads=6,
    num_kv_heads=2,
    head_dim=8,
    **FAMILIES[family],
  )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_forward_kernel_equals_xla_dots(family):
  cfg = _wider(family)
  params = jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, init_params(cfg, jax.random.PRNGKey(1)))
  s, max_len = 5, 16
  cache = {
    n: jnp.asarray(np.random.default_rng(0).standard_normal((3, s, max_len, 2, 8)), jnp.float32) for n in ("k", "v")
  }
  tokens, pos = jnp.asarray([3, 17, 99, 0, 42]), jnp.asarray([0, 4, 9, 15, 2])
  f = jax.jit(decode_forward, static_argnums=(0, 5))
  ref_logits, ref_cache = f(cfg, params, tokens, pos, cache, max_len)
  logits, new_cache = f(cfg, params, tokens, pos, cache, max_len, weights_t=decode_weights(cfg, params))
  # The kernel and XLA's dots differ in summation order only: the bound is 4x how far float32 rounding alone moves
  # the XLA path's outputs (every parameter moved by one ulp), as in test_step_fixtures.float32_spread. Measured:
  # differences <= 0.8x that spread.
  spread_logits, spread_cache = _ulp_spread(lambda p: f(cfg, p, tokens, pos, cache, max_len), params)
  np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=4 * spread_logits)
  for n in ("k", "v"):
    np.testing.assert_allclose(new_cache[n], ref_cache[n], rtol=0, atol=4 * spread_cache[n], err_msg=n)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_forward_equals_the_decoders_cached_forward(family):
  """The model's decode step (XLA path) against the Flax decoder's own cached forward with T = 1: the same logits
  and the same new KV entries (the decode step is the decoder's math arranged for memory traffic)."""
  from aepo_jax.model import forward_cached

  cfg = _wider(family)
  params = init_params(cfg, jax.random.PRNGKey(2))
  s, max_len = 5, 16
  rng = np.random.default_rng(1)
  cache = {n: jnp.asarray(rng.standard_normal((3, s, max_len, 2, 8)), jnp.float32) for n in ("k", "v")}
  tokens, pos = jnp.asarray([3, 17, 99, 0, 42]), jnp.asarray([0, 4, 9, 15, 2])
  logits, new_cache = jax.jit(decode_forward, static_argnums=(0, 5))(cfg, params, tokens, pos, cache, max_len)
  ref_logits, ref_cache = forward_cached(cfg, params, tokens[:, None], pos[:, None], cache, pos)
  np.testing.assert_allclose(logits, ref_logits[:, 0], atol=2e-5 * float(jnp.abs(ref_logits).max()))
  for n in ("k", "v"):
    np.testing.assert_allclose(new_cache[n], ref_cache[n], atol=1e-5)


def test_engine_uses_the_kernel_where_it_applies_and_says_why_not():
  cfg = tiny_model_config(vocab_size=64)
  params = init_params(cfg, jax.random.PRNGKey(0))
  assert Engine(cfg, max_slots=4, max_len=16).uses_cpu_kernels(params)
  assert not Engine(cfg, max_slots=4, max_len=16, cpu_kernels=False).uses_cpu_kernels(params)
  assert not Engine(cfg, max_slots=65, max_len=16).uses_cpu_kernels(params)  # large batch: XLA's GEMM
  from aepo_jax.parallel import make_mesh

  mesh = make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
  with pytest.raises(ValueError, match="cpu_kernels=True.*multi-device mesh"):
    Engine(cfg, max_slots=4, max_len=16, mesh=mesh, cpu_kernels=True).uses_cpu_kernels(params)
  bf16 = dataclasses.replace(cfg, dtype="bfloat16")
  with pytest.raises(ValueError, match="model dtype is bfloat16"):
    Engine(bf16, max_slots=4, max_len=16, cpu_kernels=True).uses_cpu_kernels(params)


def test_prepared_weights_are_made_once_per_parameter_version_and_freed_with_it():
  cfg = tiny_model_config(vocab_size=64)
  params = init_params(cfg, jax.random.PRNGKey(0))
  first = prepared_weights.get(cfg, params)
  assert prepared_weights.get(cfg, params) is first  # reused across calls (and engines)
  np.testing.assert_array_equal(first["down"], np.swapaxes(params["layers"]["mlp"]["down_proj"]["kernel"], 1, 2))
  new = jax.tree.map(lambda x: x + 0, params)  # an updated parameter version
  second = prepared_weights.get(cfg, new)
  assert second is not first
  assert prepared_weights._entry is not None
  del new, second, params
  gc.collect()
  assert prepared_weights._entry is None  # dropped with the parameters it was made from
