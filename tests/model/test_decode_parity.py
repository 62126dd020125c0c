"""The engine's decode step (`decode_forward`) stepped token by token against the full-sequence `forward`, on tiny
random transformers checkpoints of each family: Llama (with Llama-3 rope scaling), Qwen2 (q/k/v biases), Qwen3
(q/k norms), Qwen3-MoE (expert layers and a dense one) and a SmolLM2-shaped Llama (tied embeddings), through every
decode path reachable on CPU: XLA dots and the CPU kernels (`decode_weights`), each over the dense and the paged KV
cache. Both run one layer definition (`_layers.layer`); decoding from an empty cache and after a prefill by
`fill_cache_rows` (the Flax block) must give `forward`'s logits at every position.

Tolerance (float32): max |Δ| <= REL * max |logits| of the row's position. Measured: <= 1.1e-6 on every path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aepo_jax import model
from aepo_jax.model import _cpu_decode
from aepo_jax.parallel import _native

REL = 1e-5  # float32 summation order only (XLA dots vs kernel, one token vs the whole row)

CASES = {  # tiny_checkpoint(family, tie)
  "llama_rope": ("llama_rope", False),
  "qwen2": ("qwen2", False),
  "qwen3": ("qwen3", False),
  "smollm2_shaped": ("llama", True),
  "qwen3_moe": ("qwen3_moe", False),  # sparse layers around a dense one (mlp_only_layers); CPU: dense experts
}
PATHS = ("xla_dense", "xla_paged", "kernel_dense", "kernel_paged")
B, T, PREFILL, PAGE = 3, 12, 4, 4
MAX_LEN = 16


def _kernels_available():
  return {"avx2", "fma"} <= _native.cpu_flags() and _cpu_decode.available()


def _paged_setup(config):
  """Per-layer pools [K, pages, PAGE, D] and a page table of distinct shuffled pages (page 0 is the null page)."""
  per_row = MAX_LEN // PAGE
  pages = 1 + B * per_row
  table = jnp.asarray(1 + np.random.default_rng(0).permutation(B * per_row).reshape(B, per_row), jnp.int32)
  shape = (config.num_kv_heads, pages, PAGE, config.head_dim)
  cache = {n: tuple(jnp.zeros(shape, jnp.float32) for _ in range(config.num_layers)) for n in ("k", "v")}
  return cache, table


def decode_errors(config, params, path: str) -> np.ndarray:
  """max |Δ| / max |logits| of decode against `forward` at each position [2, T]: decoding from an empty cache (row
  0) and after a prefill of PREFILL tokens (row 1; the prefilled positions are nan)."""
  errors = np.full((2, T), np.nan)
  tokens = jnp.asarray(np.random.default_rng(1).integers(3, config.vocab_size, (B, T)), jnp.int32)
  want = np.asarray(model.forward(config, params, tokens))  # [B, T, V]
  paged = path.endswith("paged")
  weights_t = model.decode_weights(config, params) if path.startswith("kernel") else None
  step = jax.jit(
    lambda p, w, tok, pos, cache, table, attend: model.decode_forward(
      config,
      p,
      tok,
      pos,
      cache,
      attend,
      weights_t=w,
      **(dict(page_table=table, write_page_s=table[jnp.arange(B), pos // PAGE]) if paged else {}),
    ),
    static_argnums=(6,),
  )

  def fresh_cache():
    if paged:
      return _paged_setup(config)
    return model.init_cache(config, B, MAX_LEN, "float32"), None

  def decode(cache, table, start, row):
    for t in range(start, T):
      attend = 8 if t < 8 else MAX_LEN  # the engine's attend_len buckets: >= every row's length
      pos = jnp.full((B,), t, jnp.int32)
      got, cache = step(params, weights_t, tokens[:, t], pos, cache, table, attend)
      errors[row, t] = np.abs(np.asarray(got) - want[:, t]).max() / np.abs(want[:, t]).max()

  cache, table = fresh_cache()
  decode(cache, table, 0, 0)  # from an empty cache, every position
  cache, table = fresh_cache()  # after a prefill of PREFILL tokens by the Flax block
  positions = jnp.broadcast_to(jnp.arange(PREFILL), (B, PREFILL))
  cache = model.fill_cache_rows(
    config,
    params,
    tokens[:, :PREFILL],
    positions,
    cache,
    jnp.arange(B),
    jnp.zeros((B,), jnp.int32),
    PREFILL,
    **(dict(page_table=table) if paged else {}),
  )
  decode(cache, table, PREFILL, 1)
  return errors


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_steps_equal_the_full_forward(tiny_checkpoint, case, path):
  if path.startswith("kernel") and not _kernels_available():
    pytest.skip("the CPU decode kernel is unavailable (needs AVX2 and FMA and a C++ compiler)")
  errors = decode_errors(*model.load_hf(tiny_checkpoint(*CASES[case])), path)
  worst = np.nanmax(errors)
  assert worst <= REL, f"{case} {path}: max |Δ| / max |logits| {worst:.3g} > {REL} (per position: {errors})"


def test_decode_with_ragged_dot_experts(tiny_checkpoint):
  """Qwen3-MoE with the `jax.lax.ragged_dot` expert computation (CPU's default is the dense one) through the decode
  step, on one cache path: the expert block does not depend on the cache."""
  config, params = model.load_hf(tiny_checkpoint(*CASES["qwen3_moe"]))
  worst = np.nanmax(decode_errors(config.replace(moe_impl="ragged"), params, "xla_dense"))
  assert worst <= REL, f"max |Δ| / max |logits| {worst:.3g} > {REL}"
