"""A small-M float32 matmul kernel for decode on CPU, called through the XLA FFI.

At small batch a decode step reads every weight once; XLA:CPU's GEMM reaches only ~5-7 GB/s of weight reads at
M = 8 on the development machine (a quarter of its memory bandwidth), and slicing a layer's weights out of the
scanned, stacked parameters adds a copy per layer per step (docs/performance.md). `csrc/small_m_matmul.cc`
streams weights stored as [L, N, K] (one contiguous row per output column) with prefetching and register
blocking, and takes the whole stack plus a layer index, so nothing is sliced.

The kernel is compiled on first use with the system C++ compiler (`$CXX`, default g++; ~5 s) into
`~/.cache/aepo_jax/kernels` (`$AEPO_JAX_KERNEL_CACHE`) and registered as an XLA FFI target
(`aepo_jax.parallel._native`). It needs x86-64 with AVX2 and FMA. `AEPO_JAX_CPU_KERNELS=0` turns it off. When
it cannot be built or loaded, `available()` is False, `reason()` says why, and the engine decodes with XLA's dots
instead (same results to float32 rounding).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from aepo_jax.parallel import _native

_SRC = Path(__file__).parent / "csrc" / "small_m_matmul.cc"
_TARGET = "aepo_small_m_matmul"
_ATTN_TARGET = "aepo_decode_attention"
MAX_ROWS = 64  # beyond this batch size the step is compute-bound and XLA's GEMM is as good
_LIB = _native.Library(
  _SRC,
  {_TARGET: "AepoSmallMMatmul", _ATTN_TARGET: "AepoDecodeAttention"},
  "CPU decode kernel",
  "decoding with XLA dots",
)
available = _LIB.available  # True when the kernel is built, loaded and registered (builds it on the first call)
reason = _LIB.reason  # why the kernel is unavailable ('' when it is available)


def matmul_t(x, w_stacked, layer, *, parts: int = 0):
  """x [M, K] @ w_stacked[layer]^T with w_stacked [L, N, K] (or [N, K] with layer 0) -> [M, N], float32.

  `layer` is an int32 scalar (traced inside a layer scan). `parts`: column blocks run in parallel on XLA's
  intra-op thread pool (0: one per pool thread).
  """
  if not available():
    raise RuntimeError(f"aepo_jax CPU decode kernel unavailable: {reason()}")
  if x.dtype != jnp.float32 or w_stacked.dtype != jnp.float32:
    raise TypeError(f"matmul_t: float32 only (x {x.dtype}, w {w_stacked.dtype}).")
  n = w_stacked.shape[-2]
  call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
  return call(x, w_stacked, jnp.asarray(layer, jnp.int32), parts=np.int64(parts))


def attention_applies(config, cache_dtype) -> bool:
  """Whether `attention` handles this model's decode attention (float32 cache, head_dim % 8 == 0, <= 64 heads)."""
  return (
    jnp.dtype(cache_dtype) == jnp.float32
    and config.head_dim % 8 == 0
    and config.num_heads <= 64
    and config.num_heads % config.num_kv_heads == 0
  )


def attention(q, k_cache, v_cache, layer, pos, *, parts: int = 0):
  """Decode attention read in place from the stacked KV cache: q [S, H * D] (after RoPE; heads h = kv * G + g),
  k_cache / v_cache [L, S, T, KH, D] float32, layer an int32 scalar, pos [S] int32: slot s attends to its entries
  [0, pos[s]] (softmax over them, scaled by 1/sqrt(D)) -> [S, H * D] float32. Nothing beyond pos[s] is read, and
  no layer slice of the cache is copied (XLA's dots on `cache[layer, :, :attend_len]` copy it first)."""
  if not available():
    raise RuntimeError(f"aepo_jax CPU decode kernel unavailable: {reason()}")
  if q.dtype != jnp.float32 or k_cache.dtype != jnp.float32 or v_cache.dtype != jnp.float32:
    raise TypeError(f"attention: float32 only (q {q.dtype}, cache {k_cache.dtype}).")
  call = jax.ffi.ffi_call(_ATTN_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
  return call(q, k_cache, v_cache, jnp.asarray(layer, jnp.int32), jnp.asarray(pos, jnp.int32), parts=np.int64(parts))


def unavailable_reason_for(config, max_slots: int, mesh, params) -> Optional[str]:
  """Why the engine cannot decode with the kernel for these settings (None: it can)."""
  if jnp.dtype(config.dtype) != jnp.float32:
    return f"model dtype is {config.dtype} (the kernel computes in float32)"
  if max_slots > MAX_ROWS:
    return f"max_slots={max_slots} > {MAX_ROWS} (large batches are compute-bound; XLA's GEMM is used)"
  if mesh is not None and mesh.devices.size > 1:
    return "the engine runs on a multi-device mesh"
  leaf = jax.tree.leaves(params)[0]
  devices = leaf.devices() if hasattr(leaf, "devices") else set()
  if len(devices) != 1 or next(iter(devices)).platform != "cpu":
    return "the parameters are not on a single CPU device"
  if not available():
    return reason()
  return None
