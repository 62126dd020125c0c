"""Token log-probs and policy entropy from hidden states, without a whole [B, T, V] logits tensor.

The trainer needs log π_θ(y_t) for every response token and, for AEPO's entropy-aware advantage
(spec §2.3), the full-vocabulary entropy H_t of softmax(z_t / temperature). With V ≈ 152k a dense
[B, T, V] float32 tensor is tens of GB; here T is cut into chunks, each chunk's logits exist only inside
a `jax.checkpoint`-ed `lax.map` body, and the backward pass recomputes them chunk by chunk.
"""
from __future__ import annotations

from typing import Callable, Union

import jax
import jax.numpy as jnp


def entropy_from_logits(logits):
  """H = logsumexp(z) − Σ softmax(z)·z over the last axis, in float32 (verl `entropy_from_logits`)."""
  z = jnp.asarray(logits, jnp.float32)
  lse = jax.nn.logsumexp(z, axis=-1)
  return lse - jnp.sum(jnp.exp(z - lse[..., None]) * z, axis=-1)


def _unembed_fn(unembed, d: int) -> Callable:
  if callable(unembed):
    return unembed
  emb_vd = jnp.asarray(unembed)
  if emb_vd.ndim != 2 or emb_vd.shape[1] != d:
    raise ValueError(f"unembed matrix must be [V, D={d}] (tied embedding layout); got "
                     f"{emb_vd.shape}. For a [D, V] lm_head kernel pass `lambda h: h @ kernel`.")
  return lambda h_bcd: jnp.einsum("bcd,vd->bcv", h_bcd, emb_vd,
                                  preferred_element_type=jnp.float32)


def token_logprobs_and_entropy(hidden_btd, unembed: Union[Callable, jax.Array], targets_bt,
                               temperature: float = 1.0, chunk_size: int = 128, *, where_bt=None,
                               capacity: int = 0):
  """(log π(targets) [B, T], entropy [B, T]) from final hidden states, T processed in chunks.

  hidden_btd: final-norm hidden states whose logits at t predict targets_bt[:, t] (already shifted).
  unembed: a function h[B, C, D] -> logits[B, C, V], or the tied embedding matrix [V, D].
  temperature: logits are divided by it before log-softmax and entropy (the rollout temperature, §1.5).
  chunk_size: tokens of T per chunk; peak logits memory is B·chunk_size·V floats (forward and backward).
  where_bt, capacity: compute only the positions where `where_bt` is true (e.g. the loss mask: prompt and padding
    positions need no logits), gathered into one row of `capacity` (static) positions; the others get 0. The LM
    head is a quarter of a small model's update-step FLOPs and most of its memory traffic, and the loss positions
    are often a quarter of the batch. A batch with more than `capacity` such positions takes the dense path
    (`lax.cond`, both compiled), so the result never depends on the capacity; only the time does.
  """
  hidden_btd = jnp.asarray(hidden_btd)
  targets_bt = jnp.asarray(targets_bt)
  if hidden_btd.ndim != 3 or targets_bt.shape != hidden_btd.shape[:2]:
    raise ValueError(f"hidden_btd must be [B, T, D] and targets_bt [B, T]; got {hidden_btd.shape} "
                     f"and {targets_bt.shape}")
  if chunk_size < 1:
    raise ValueError(f"chunk_size={chunk_size} must be >= 1")
  if not temperature > 0:
    raise ValueError(f"temperature={temperature} must be > 0")
  if capacity < 0:
    raise ValueError(f"capacity={capacity} must be >= 0 (0: every position)")
  b, t, d = hidden_btd.shape
  fn = _unembed_fn(unembed, d)

  def dense(_=None):
    return _chunked(hidden_btd, targets_bt, fn, temperature, chunk_size)

  if where_bt is None or not capacity or capacity >= b * t:
    return dense()
  where_bt = jnp.asarray(where_bt)
  if where_bt.shape != (b, t):
    raise ValueError(f"where_bt must be [B, T] = {(b, t)}; got {where_bt.shape}")

  def selected(_):
    idx = jnp.nonzero(where_bt.reshape(-1), size=capacity, fill_value=b * t)[0]  # fill: out of range
    h_1cd = jnp.take(hidden_btd.reshape(b * t, d), idx, axis=0, mode="fill", fill_value=0)[None]
    tgt_1c = jnp.take(targets_bt.reshape(-1), idx, mode="fill", fill_value=0)[None]
    logp_1c, ent_1c = _chunked(h_1cd, tgt_1c, fn, temperature, chunk_size)
    put = lambda x_1c: jnp.zeros((b * t,), x_1c.dtype).at[idx].set(x_1c[0], mode="drop").reshape(b, t)  # noqa: E731
    return put(logp_1c), put(ent_1c)

  return jax.lax.cond(jnp.sum(where_bt) <= capacity, selected, dense, None)


def _chunked(hidden_btd, targets_bt, fn, temperature, chunk_size):
  b, t, d = hidden_btd.shape
  c = min(chunk_size, t)
  n = -(-t // c)
  pad = n * c - t
  h_nbcd = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, n, c, d).swapaxes(0, 1)
  tgt_nbc = jnp.pad(targets_bt, ((0, 0), (0, pad))).reshape(b, n, c).swapaxes(0, 1)

  @jax.checkpoint  # keep only the chunk's inputs for backward; recompute its [B, C, V] logits
  def chunk(args):
    h_bcd, tgt_bc = args
    z_bcv = fn(h_bcd).astype(jnp.float32) / temperature
    lse_bc = jax.nn.logsumexp(z_bcv, axis=-1)
    z_tgt_bc = jnp.take_along_axis(z_bcv, tgt_bc[..., None].astype(jnp.int32), axis=-1)[..., 0]
    probs_bcv = jnp.exp(z_bcv - lse_bc[..., None])
    return z_tgt_bc - lse_bc, lse_bc - jnp.sum(probs_bcv * z_bcv, axis=-1)

  logp_nbc, ent_nbc = jax.lax.map(chunk, (h_nbcd, tgt_nbc))
  unchunk = lambda x_nbc: x_nbc.swapaxes(0, 1).reshape(b, n * c)[:, :t]  # noqa: E731
  return unchunk(logp_nbc), unchunk(ent_nbc)
