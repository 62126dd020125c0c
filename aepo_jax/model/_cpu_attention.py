"""Full-sequence (training) attention on CPU through a C++ XLA FFI kernel (`csrc/train_attention.cc`).

XLA:CPU computes masked attention as batched dots over every head's whole [T, S] score matrix (the causal upper
half computed, then masked) and writes scores, probabilities and their transposes between the dots. The kernel
works per (batch row, KV head) in blocks of 16 queries, only over the key range the mask allows for the block
(causal: about half the work; left padding: the pad columns skipped, and the pad queries, which see no key, kept
out of the key ranges: their output is the mean of v), with the softmax and its backward fused between
register-tiled GEMMs. The backward recomputes the probabilities from the saved log-sum-exp.
`python bench/attention.py` times it against the XLA path and torch's SDPA.

`attention(q, k, v, mask)` has the same values as `_decoder._attend` (float32 rounding) and a custom VJP whose
gradients match `_decoder._attend_recompute`'s, including query rows with no valid key (uniform probabilities
over all keys, zero score gradient). Its backward is itself a kernel call, so it has no derivative of its own:
grad-of-grad (Hessian-vector products) needs `attention_impl='xla'`. Used by the decoder when
`ModelConfig.attention_impl == 'cpu_kernel'`, which the training steps select on a single CPU device (`resolve`,
which also picks splash attention on TPU).
Build and fallback rules: `aepo_jax.parallel._native`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from aepo_jax.model import _splash
from aepo_jax.parallel import _native

_SRC = Path(__file__).parent / "csrc" / "train_attention.cc"
_FWD, _BWD = "aepo_train_attention_fwd", "aepo_train_attention_bwd"
_LIB = _native.Library(
  _SRC,
  {_FWD: "AepoTrainAttentionFwd", _BWD: "AepoTrainAttentionBwd"},
  "CPU training-attention kernel",
  "using XLA's attention",
)
available = _LIB.available  # True when the kernel is built, loaded and registered (builds it on the first call)
reason = _LIB.reason  # why the kernel is unavailable ('' when it is available)


def unavailable_reason(config, mesh=None) -> Optional[str]:
  """Why the training attention of `config` cannot run through the kernel on `mesh` (None: it can)."""
  if jnp.dtype(config.dtype) != jnp.float32:
    return f"model dtype is {config.dtype} (the kernel computes in float32)"
  if config.head_dim % 16:
    return f"head_dim={config.head_dim} is not a multiple of 16"
  if config.num_heads // config.num_kv_heads > 64:
    return "more than 64 query heads per KV head"
  devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
  if len(devices) != 1 or devices[0].platform != "cpu":
    return "not a single CPU device (the kernel is not partitioned over a mesh)"
  if not available():
    return reason()
  return None


def resolve(config, mesh=None):
  """`config` with `attention_impl='auto'` resolved for `mesh` (default: the first device): 'cpu_kernel' where this
  kernel applies (one CPU device), 'splash' where the mesh's devices are TPUs (`_splash`), else 'xla'. An explicit
  choice is never overridden: only 'auto' is resolved."""
  if config.attention_impl != "auto":
    return config
  if unavailable_reason(config, mesh) is None:
    return config.replace(attention_impl="cpu_kernel")
  devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
  if all(d.platform == "tpu" for d in devices) and _splash.unavailable_reason(config) is None:
    return config.replace(attention_impl="splash")
  return config.replace(attention_impl="xla")


def _check(q, k, v, mask):
  if not available():
    raise RuntimeError(
      f"aepo_jax CPU training-attention kernel unavailable: {reason()} (use ModelConfig.attention_impl='xla' or 'auto')"
    )
  if (
    q.ndim != 4
    or k.ndim != 4
    or v.shape != k.shape
    or q.shape[0] != k.shape[0]
    or q.shape[3] != k.shape[3]
    or q.shape[2] % k.shape[2]
    or mask.shape != (q.shape[0], q.shape[1], k.shape[1])
  ):
    raise ValueError(
      f"attention: q [B,T,H,D], k = v [B,S,KH,D] with H % KH == 0, mask [B,T,S]; got q {q.shape}, "
      f"k {k.shape}, v {v.shape}, mask {mask.shape}"
    )
  if q.shape[3] % 16 or q.shape[2] // k.shape[2] > 64:
    raise ValueError(f"attention: head_dim % 16 == 0 and at most 64 query heads per KV head (q {q.shape}, k {k.shape})")
  if not all(x.dtype == jnp.float32 for x in (q, k, v)):
    raise TypeError(
      f"attention: float32 only (q {q.dtype}, k {k.dtype}, v {v.dtype}); use "
      "ModelConfig.attention_impl='xla' for other dtypes"
    )


def _fwd_call(q, k, v, mask):
  _check(q, k, v, mask)
  b, t, h, d = q.shape
  call = jax.ffi.ffi_call(
    _FWD,
    (
      jax.ShapeDtypeStruct(q.shape, jnp.float32),
      jax.ShapeDtypeStruct((b, k.shape[2], t, h // k.shape[2]), jnp.float32),
    ),
    vmap_method="sequential",
  )
  return call(q, k, v, mask, parts=np.int64(0))


@jax.custom_vjp
def attention(q_bthd, k_bskd, v_bskd, mask_bts):
  """softmax(q·k / sqrt(D), masked) · v: q [B, T, H, D] (head h = kv * G + g), k, v [B, S, KH, D], mask
  [B, T, S] bool -> [B, T, H, D], float32."""
  return _fwd_call(q_bthd, k_bskd, v_bskd, mask_bts.astype(bool))[0]


def _attention_fwd(q, k, v, mask):
  mask = mask.astype(bool)
  out, lse = _fwd_call(q, k, v, mask)
  return out, (q, k, v, mask, out, lse)


def _attention_bwd(res, dout):
  q, k, v, mask, out, lse = res
  call = jax.ffi.ffi_call(
    _BWD,
    (
      jax.ShapeDtypeStruct(q.shape, jnp.float32),
      jax.ShapeDtypeStruct(k.shape, jnp.float32),
      jax.ShapeDtypeStruct(v.shape, jnp.float32),
    ),
    vmap_method="sequential",
  )
  dq, dk, dv = call(q, k, v, mask, out, lse, dout.astype(jnp.float32), parts=np.int64(0))
  return dq, dk, dv, None


attention.defvjp(_attention_fwd, _attention_bwd)
