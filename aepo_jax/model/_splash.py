"""Full-sequence (training and scoring) attention on TPU through JAX's Pallas splash-attention kernel.

`jax.experimental.pallas.ops.tpu.splash_attention` computes softmax(q·k) · v block by block with an online
softmax and skips the blocks its mask rules out (the upper causal triangle), so no [B, H, T, S] score buffer
exists in the forward or the backward (the XLA path keeps float32 scores of that shape per layer). Its mask here
is causal within segments: every token carries a segment id (`segment_ids`), 0 for padding and 1, 2, ... for the
sequences of a packed row, and a query attends to the keys at or before it with its own id. That gives every valid
query the same keys as the XLA path's [B, T, S] mask (left or right padding, holes, packed rows). Padding queries
(id 0) attend to the padding keys at or before them, where the XLA path gives them the valid keys before them (or,
with none, a uniform row): their outputs differ, and nothing reads them (a valid token never attends to a padding
key, and the losses mask padding), so the two paths agree on every valid token's value and on every gradient of a
loss over valid tokens.

Grouped query heads: query head h reads KV head h // (H / KH), the decoder's layout. Mosaic kernels do not
partition, so under a multi-device `parallel.sharding_context` the kernel runs inside `jax.shard_map`: rows over
the rules' batch axes, heads over 'tensor' when both H and KH divide it (else replicated), the sequence whole.
On a platform other than TPU the kernel runs in Pallas's interpret mode (slow; for numerics tests on CPU).
Block sizes are `ModelConfig.splash_block_q` / `splash_block_kv`; a row whose length they do not divide is
padded with id 0 up to a multiple of them.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from aepo_jax import parallel

_LANES = 128  # the kernel's blocks are multiples of the TPU lane width


def segment_ids(attention_mask_bt, segment_ids_bt=None):
  """[B, T] int32 ids for the kernel: 0 where `attention_mask_bt` is 0, else the packed row's segment id (1 for an
  unpacked row)."""
  ids = jnp.ones_like(attention_mask_bt, jnp.int32) if segment_ids_bt is None else segment_ids_bt.astype(jnp.int32)
  return jnp.where(attention_mask_bt > 0, ids, 0)


def unavailable_reason(config) -> Optional[str]:
  """Why `config`'s training attention cannot use splash attention on TPU (None: it can)."""
  if jnp.dtype(config.dtype) == jnp.float64:
    return "model dtype is float64 (TPU kernels compute in float32 at most)"
  return None


def _blocks(config, length: int) -> tuple[int, int, int]:
  """(block_q, block_kv, padded length): the configured blocks, capped at the row rounded up to 128 tokens."""
  cap = -(-length // _LANES) * _LANES
  bq, bkv = min(config.splash_block_q, cap), min(config.splash_block_kv, cap)
  step = math.lcm(bq, bkv)
  return bq, bkv, -(-length // step) * step


def _kernel(heads: int, length: int, bq: int, bkv: int, interpret: bool):
  """The kernel for `heads` query heads over rows of `length` tokens (the library caches the block tables it derives
  from the mask, seconds of numpy at 20k tokens, per mask and block shape)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa  # Pallas: imported when first used

  blocks = sa.BlockSizes(
    block_q=bq,
    block_kv=bkv,
    block_kv_compute=bkv,
    block_q_dkv=bq,
    block_kv_dkv=bkv,
    block_kv_dkv_compute=bkv,
    block_q_dq=bq,
    block_kv_dq=bkv,
  )
  mask = sa.MultiHeadMask([sa.CausalMask((length, length))] * heads)
  return sa.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret)


def _segments(q_ids, kv_ids):
  from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

  return SegmentIds(q_ids, kv_ids)


def _local(q_bthd, k_bskd, v_bskd, seg_bt, *, config, interpret: bool):
  """The kernel on one device's rows and heads: [b, T, h, D] x [b, S, kh, D] -> [b, T, h, D]."""
  t = q_bthd.shape[1]
  bq, bkv, padded = _blocks(config, t)
  scale = 1.0 / math.sqrt(q_bthd.shape[-1])
  q = (q_bthd.astype(jnp.float32) * scale).astype(q_bthd.dtype)  # the kernel does not scale the logits
  pad = [(0, 0), (0, padded - t), (0, 0), (0, 0)]
  q_bhtd, k_bhsd, v_bhsd = (jnp.pad(x, pad).transpose(0, 2, 1, 3) for x in (q, k_bskd, v_bskd))
  seg = jnp.pad(seg_bt, [(0, 0), (0, padded - t)])  # id 0: padding, seen by no valid token
  kernel = _kernel(q_bhtd.shape[1], padded, bq, bkv, interpret)
  out_bhtd = jax.vmap(kernel)(q_bhtd, k_bhsd, v_bhsd, _segments(seg, seg))
  return out_bhtd.transpose(0, 2, 1, 3)[:, :t]


def attention(q_bthd, k_bskd, v_bskd, segment_ids_bt, config):
  """softmax(q·k / sqrt(D), causal within segments) · v: q [B, T, H, D] (head h = kv * G + g), k, v [B, S, KH, D]
  with S = T, segment ids [B, T] from `segment_ids` -> [B, T, H, D] in q's dtype. Differentiable (the kernel's own
  backward kernels)."""
  fn = functools.partial(_local, config=config, interpret=parallel.current_platform() != "tpu")
  q_spec = parallel.activation_spec(q_bthd.shape, ("activation_batch", None, "activation_heads", None))
  if q_spec is None:  # one device, or outside a step
    return fn(q_bthd, k_bskd, v_bskd, segment_ids_bt)
  k_spec = parallel.activation_spec(k_bskd.shape, ("activation_batch", None, "activation_kv_heads", None))
  heads = q_spec[2] if q_spec[2] == k_spec[2] else None  # a KV head's query heads must stay on its device
  qkv_spec = PartitionSpec(q_spec[0], None, heads, None)
  return jax.shard_map(
    fn,
    mesh=parallel.current_mesh(),
    in_specs=(qkv_spec, qkv_spec, qkv_spec, PartitionSpec(q_spec[0], None)),
    out_specs=qkv_spec,
    check_vma=False,
  )(q_bthd, k_bskd, v_bskd, segment_ids_bt)
