"""Decode attention over the engine's paged KV cache on TPU through JAX's Pallas paged-attention kernel.

`jax.experimental.pallas.ops.tpu.paged_attention.paged_attention` attends one query token per sequence to the keys
of that sequence's pages: for each (sequence, KV head) it DMAs `pages_per_compute_block` pages at a time from the
pool in HBM into VMEM (double buffered) and folds them into an online softmax, stopping after the block that holds
the sequence's last token, so the work and the HBM traffic follow each sequence's length, not the table's width.

What the kernel does and requires (jax 0.10.2's source), and what `paged_decode_attention` does about it:
- q [S, H, D], pools [K, NP, ps, D], lengths int32 [S], page indices int32 [S, P]; H a multiple of K, query head h
  reads KV head h // (H / K) (the decoder's layout); the same D for q and the pools; P a multiple of
  `pages_per_compute_block` (chosen here when not given: the largest divisor of P whose block holds at most
  `_BLOCK_TOKENS` tokens).
- It does not scale the logits: q is multiplied by 1/sqrt(D) here, in float32.
- It computes in float32 but rounds every K and V block to bfloat16 after loading it (its dequantize step runs on
  plain pools too), so float32 pools give bfloat16-rounded K/V numerics; q and the softmax stay float32.
- Its output block doubles as the accumulator of the online softmax, in the dtype q is passed in: q is passed as
  float32 (a bfloat16 accumulator would be rounded once per block), and the result is cast to q's dtype.
- It reads the page ids of every block up to the one holding token length-1, so each entry of those blocks must be a
  page of the pool ([0, NP)) even past the sequence's last page; a length above P * ps would read the next row's
  ids (or past the table), so lengths are clamped to [0, P * ps]. A sequence of length 0 gives zeros.
- Mosaic cannot compile its float32 x bfloat16 q·k matmul at jax_default_matmul_precision='highest' (the tests'
  setting), so the kernel is traced at 'default' whatever the caller's setting.
- D must be a multiple of 128 on TPU: its softmax statistics [S, H, 1, 1] use q's block shape (.., D), and the
  Pallas TPU lowering rejects D = 64 (interpret mode runs it). Compiled for v5e and v6e here: bfloat16 pools with
  pages of 8, 16 or 64 tokens, float32 pools with 4 or 32, int8-typed pools, D 128 and 256.
- megacore_mode ('kv_head' or 'batch') splits the grid over the two TensorCores of a v4 / v5p chip; the kernel may
  hang where a chip has one core (v5e, v6e), so it stays None unless the caller asks.

Mosaic kernels do not partition: with a `mesh` the kernel runs in `jax.shard_map`, the KV heads of the pools and
the query heads of q split over 'tensor' when both K and H divide by its size (contiguous query heads, so the query
heads of a KV head stay on its device), everything else (and, when they do not divide, the heads too) replicated.
With `interpret=True` the kernel runs in Pallas's TPU interpret mode (any platform; slow, for tests on CPU).
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

_BLOCK_TOKENS = 512  # tokens per compute block when pages_per_compute_block is not given


def pages_per_block(pages_per_sequence: int, page_size: int, block_tokens: int = _BLOCK_TOKENS) -> int:
  """The largest divisor of `pages_per_sequence` whose block of pages holds at most `block_tokens` tokens (1 if a
  page alone is larger)."""
  limit = max(1, block_tokens // page_size)
  return max(d for d in range(1, min(limit, pages_per_sequence) + 1) if pages_per_sequence % d == 0)


def _local(q_shd, k_pool, v_pool, lengths_s, page_table_sp, *, pages_per_compute_block, interpret, megacore_mode):
  from jax.experimental.pallas import tpu as pltpu  # Pallas: imported when first used
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

  q = q_shd.astype(jnp.float32) * (1.0 / math.sqrt(q_shd.shape[-1]))  # the kernel does not scale the logits
  mode = pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()) if interpret else contextlib.nullcontext()
  # The kernel's q·k einsum (float32 q, bfloat16 K) is traced with the default matmul precision in force: Mosaic
  # refuses it at 'highest' (fp32 contract precision, "Bad rhs type"), so the kernel is traced at 'default'.
  with mode, jax.default_matmul_precision("default"):
    out = paged_attention(
      q,
      k_pool,
      v_pool,
      lengths_s,
      page_table_sp,
      pages_per_compute_block=pages_per_compute_block,
      megacore_mode=megacore_mode,
    )
  return out.astype(q_shd.dtype)


def paged_decode_attention(
  q_shd,
  k_pool,
  v_pool,
  lengths_s,
  page_table_sp,
  *,
  mesh=None,
  interpret: bool = False,
  pages_per_compute_block: Optional[int] = None,
  megacore_mode: Optional[str] = None,
):
  """q_shd [S, H, D] (one query token per sequence, already rotary-embedded, NOT pre-scaled),
  k_pool / v_pool [K, NP, ps, D] (one layer of the page pool; K = KV heads, NP pages, ps page size),
  lengths_s [S] int32 = number of valid tokens of each sequence (the query attends to entries 0..length-1),
  page_table_sp [S, P] int32 page ids (entries past a sequence's pages may be anything in [0, NP)).
  Returns [S, H, D] in q's dtype: softmax(q k^T / sqrt(D)) v with grouped-query heads (H = G*K, query head h uses KV
  head h // G). K and V are rounded to bfloat16 inside the kernel; lengths are clamped to [0, P * ps]; a length of 0
  gives zeros. `mesh`: a ('data', 'fsdp', 'tensor') Mesh to run the kernel under shard_map (heads over 'tensor');
  `interpret`: Pallas TPU interpret mode (CPU tests); `pages_per_compute_block`: a divisor of P (default
  `pages_per_block(P, ps)`); `megacore_mode`: the kernel's (None, 'kv_head' or 'batch'; only on 2-core chips)."""
  s, h, d = q_shd.shape
  kh, _, ps, dk = k_pool.shape
  p = page_table_sp.shape[1]
  if k_pool.shape != v_pool.shape or d != dk or h % kh or lengths_s.shape != (s,) or page_table_sp.shape[0] != s:
    raise ValueError(
      f"paged_decode_attention: q {q_shd.shape}, k_pool {k_pool.shape}, v_pool {v_pool.shape}, lengths "
      f"{lengths_s.shape}, page table {page_table_sp.shape}: want q [S, H, D], pools [K, NP, ps, D] with K dividing "
      "H, lengths [S], page table [S, P]."
    )
  block = pages_per_compute_block or pages_per_block(p, ps)
  if p % block:
    raise ValueError(f"pages_per_compute_block={block} does not divide the page table's {p} pages per sequence.")
  lengths = jnp.clip(lengths_s.astype(jnp.int32), 0, p * ps)
  table = page_table_sp.astype(jnp.int32)

  def fn(q, k, v, n, t):
    return _local(q, k, v, n, t, pages_per_compute_block=block, interpret=interpret, megacore_mode=megacore_mode)

  if mesh is None:
    return fn(q_shd, k_pool, v_pool, lengths, table)
  tensor = dict(mesh.shape).get("tensor", 1)
  heads = "tensor" if tensor > 1 and kh % tensor == 0 and h % tensor == 0 else None
  return jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=(
      PartitionSpec(None, heads, None),
      PartitionSpec(heads, None, None, None),
      PartitionSpec(heads, None, None, None),
      PartitionSpec(None),
      PartitionSpec(None, None),
    ),
    out_specs=PartitionSpec(None, heads, None),
    check_vma=False,
  )(q_shd, k_pool, v_pool, lengths, table)


def paged_decode_reference(q_shd, k_pool, v_pool, lengths_s, page_table_sp):
  """`paged_decode_attention` in plain jnp, in float32 with K and V as given (round them to bfloat16 to compare with
  the kernel): gather each sequence's pages, mask the tokens at or past its length, softmax, weight V."""
  s, h, d = q_shd.shape
  kh, _, ps, _ = k_pool.shape
  p = page_table_sp.shape[1]
  k = k_pool[:, page_table_sp].astype(jnp.float32).reshape(kh, s, p * ps, d)  # [K, S, T, D]
  v = v_pool[:, page_table_sp].astype(jnp.float32).reshape(kh, s, p * ps, d)
  q = q_shd.astype(jnp.float32).reshape(s, kh, h // kh, d)
  logits = jnp.einsum("skgd,kstd->skgt", q, k) / math.sqrt(d)
  lengths = jnp.clip(lengths_s, 0, p * ps)
  valid = jnp.arange(p * ps)[None, :] < lengths[:, None]  # [S, T]
  logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
  weights = jnp.where(valid[:, None, None, :], jax.nn.softmax(logits, axis=-1), 0.0)  # length 0: zeros, not NaN
  out = jnp.einsum("skgt,kstd->skgd", weights, v).reshape(s, h, d)
  return out.astype(q_shd.dtype)
