"""Token log-probs and policy entropy from hidden states, without a whole [B, T, V] logits tensor.

The trainer needs log π_θ(y_t) for every response token and, for AEPO's entropy-aware advantage
(spec §2.3), the full-vocabulary entropy H_t of softmax(z_t / temperature). With V ≈ 152k a dense
[B, T, V] float32 tensor is tens of GB; here T is cut into chunks and only one chunk's logits exist at a time.
Given the unembedding matrix, one custom VJP covers all chunks (`_head_logprobs`): its backward recomputes each
chunk's logits (or, within `max_saved_logits`, reuses the forward's) and forms both gradients from row-major
operands. Given a function h -> logits, each chunk is a `jax.checkpoint`-ed `lax.map` body differentiated by JAX.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np


def entropy_from_logits(logits, lse=None):
  """H = logsumexp(z) − Σ softmax(z)·z over the last axis, in float32 (verl `entropy_from_logits`; the engine's
  exact per-token entropy, spec §1.2 step 2.2). lse: logsumexp(z) when the caller has it (saves a vocabulary pass)."""
  z = jnp.asarray(logits, jnp.float32)
  if lse is None:
    lse = jax.nn.logsumexp(z, axis=-1)
  return lse - jnp.sum(jnp.exp(z - lse[..., None]) * z, axis=-1)


def _check_matrix(unembed, d: int, layout: str):
  """The unembedding matrix as an array (checked against `layout`), or None when `unembed` is a function."""
  if callable(unembed):
    return None
  if layout not in ("vd", "dv"):
    raise ValueError(f"layout={layout!r} must be 'vd' ([V, D], a tied embedding) or 'dv' ([D, V], an lm_head kernel)")
  w = jnp.asarray(unembed)
  if w.ndim != 2 or w.shape[layout.index("d")] != d:
    want = f"[V, D={d}]" if layout == "vd" else f"[D={d}, V]"
    raise ValueError(
      f"unembed matrix must be {want} (layout={layout!r}); got {w.shape}. Pass "
      "layout='dv' for a [D, V] lm_head kernel, or a function h -> logits."
    )
  return w


def token_logprobs_and_entropy(
  hidden_btd,
  unembed: Union[Callable, jax.Array],
  targets_bt,
  temperature: float = 1.0,
  chunk_size: int = 128,
  *,
  where_bt=None,
  capacity: int = 0,
  layout: str = "vd",
  max_saved_logits: int = 0,
  sharding: Optional[HeadSharding] = None,
):
  """(log π(targets) [B, T], entropy [B, T]) from final hidden states, T processed in chunks.

  hidden_btd: final-norm hidden states whose logits at t predict targets_bt[:, t] (already shifted).
  unembed: the unembedding matrix, [V, D] (a tied embedding, layout='vd') or [D, V] (an lm_head kernel,
    layout='dv'), or any function h[B, C, D] -> logits[B, C, V]. A matrix takes a custom-VJP path whose backward
    recomputes each chunk's logits (or reuses the forward's, see max_saved_logits) and forms both gradients from
    row-major operands (`_head_logprobs`); a function is differentiated by JAX through a `jax.checkpoint`-ed chunk.
    Same values either way.
  temperature: logits are divided by it before log-softmax and entropy (the rollout temperature, §1.5).
  chunk_size: tokens of T per chunk; peak logits memory is B·chunk_size·V floats (forward and backward).
  where_bt, capacity: compute only the positions where `where_bt` is true (e.g. the loss mask: prompt and padding
    positions need no logits), gathered into one row of `capacity` (static) positions; the others get 0. The LM
    head is a quarter of a small model's update-step FLOPs and most of its memory traffic, and the loss positions
    are often a quarter of the batch. A batch with more than `capacity` such positions takes the dense path
    (`lax.cond`, both compiled), so the result never depends on the capacity; only the time does.
  max_saved_logits: with a matrix `unembed`, the forward keeps the float32 logits for the backward when the computed
    positions x V are at most this many (0: never), instead of recomputing them there: one LM-head matmul fewer per
    step for B·T·V·4 bytes of memory.
  """
  hidden_btd = jnp.asarray(hidden_btd)
  targets_bt = jnp.asarray(targets_bt)
  if hidden_btd.ndim != 3 or targets_bt.shape != hidden_btd.shape[:2]:
    raise ValueError(
      f"hidden_btd must be [B, T, D] and targets_bt [B, T]; got {hidden_btd.shape} and {targets_bt.shape}"
    )
  if chunk_size < 1:
    raise ValueError(f"chunk_size={chunk_size} must be >= 1")
  if not temperature > 0:
    raise ValueError(f"temperature={temperature} must be > 0")
  if capacity < 0:
    raise ValueError(f"capacity={capacity} must be >= 0 (0: every position)")
  b, t, d = hidden_btd.shape
  w = _check_matrix(unembed, d, layout)

  def run(h_btd, tgt_bt, sh=None):
    if w is None:
      return _chunked(h_btd, tgt_bt, unembed, temperature, chunk_size)
    rows, v = h_btd.shape[0], w.shape[layout.index("v")]
    if sh is not None and (rows % sh.size(sh.batch_axes) or v % sh.size((sh.vocab_axis,) if sh.vocab_axis else ())):
      sh = None  # rows or vocabulary that do not divide over the mesh: the partitioner's path
    per_chip = (rows // sh.size(sh.batch_axes)) * (v // sh.size((sh.vocab_axis,) if sh.vocab_axis else ())) if sh else 0
    save = (per_chip if sh else rows * v) * h_btd.shape[1] <= max_saved_logits
    # Saved logits are all in memory anyway: then one chunk (no loop, no stacked outputs to initialise).
    c = h_btd.shape[1] if save else min(chunk_size, h_btd.shape[1])
    if sh is not None:
      return _sharded_head_logprobs(h_btd, w, tgt_bt, 1.0 / temperature, c, layout, save, sh)
    return _head_logprobs(h_btd, w, tgt_bt, 1.0 / temperature, c, layout, save)

  def dense(_=None):
    return run(hidden_btd, targets_bt, sharding)

  if where_bt is None or not capacity or capacity >= b * t:
    return dense()
  where_bt = jnp.asarray(where_bt)
  if where_bt.shape != (b, t):
    raise ValueError(f"where_bt must be [B, T] = {(b, t)}; got {where_bt.shape}")

  def selected(_):
    idx = jnp.nonzero(where_bt.reshape(-1), size=capacity, fill_value=b * t)[0]  # fill: out of range
    h_1cd = jnp.take(hidden_btd.reshape(b * t, d), idx, axis=0, mode="fill", fill_value=0)[None]
    tgt_1c = jnp.take(targets_bt.reshape(-1), idx, mode="fill", fill_value=0)[None]
    logp_1c, ent_1c = run(h_1cd, tgt_1c)
    put = lambda x_1c: jnp.zeros((b * t,), x_1c.dtype).at[idx].set(x_1c[0], mode="drop").reshape(b, t)  # noqa: E731
    return put(logp_1c), put(ent_1c)

  return jax.lax.cond(jnp.sum(where_bt) <= capacity, selected, dense, None)


def _split(x_bt, c):
  """[B, T, ...] -> [n, B, c, ...] chunks over T (T padded with zeros to n·c)."""
  b, t = x_bt.shape[:2]
  n = -(-t // c)
  pad = [(0, 0), (0, n * c - t)] + [(0, 0)] * (x_bt.ndim - 2)
  return jnp.pad(x_bt, pad).reshape(b, n, c, *x_bt.shape[2:]).swapaxes(0, 1)


def _join(x_nbc, t):
  """Inverse of `_split`: [n, B, c, ...] -> [B, T, ...]."""
  n, b, c = x_nbc.shape[:3]
  return x_nbc.swapaxes(0, 1).reshape(b, n * c, *x_nbc.shape[3:])[:, :t]


def _chunked(hidden_btd, targets_bt, fn, temperature, chunk_size):
  t = hidden_btd.shape[1]
  c = min(chunk_size, t)
  h_nbcd, tgt_nbc = _split(hidden_btd, c), _split(targets_bt, c)

  @jax.checkpoint  # keep only the chunk's inputs for backward; recompute its [B, C, V] logits
  def chunk(args):
    h_bcd, tgt_bc = args
    z_bcv = fn(h_bcd).astype(jnp.float32) / temperature
    lse_bc = jax.nn.logsumexp(z_bcv, axis=-1)
    z_tgt_bc = jnp.take_along_axis(z_bcv, tgt_bc[..., None].astype(jnp.int32), axis=-1)[..., 0]
    probs_bcv = jnp.exp(z_bcv - lse_bc[..., None])
    return z_tgt_bc - lse_bc, lse_bc - jnp.sum(probs_bcv * z_bcv, axis=-1)

  logp_nbc, ent_nbc = jax.lax.map(chunk, (h_nbcd, tgt_nbc))
  return _join(logp_nbc, t), _join(ent_nbc, t)


# ----------------------------------------------------------------------------------------------------
# The matrix path: one custom VJP over all chunks
# ----------------------------------------------------------------------------------------------------
def _t(x):
  """x.T, written out on CPU (the optimization barrier keeps XLA from folding it back into a dot): XLA:CPU runs
  `a @ b` at full speed but `a @ b.T` at about half of it and `a.T @ b` on Eigen (docs/performance.md)."""
  if jax.default_backend() != "cpu":
    return x.T
  return jax.lax.optimization_barrier(x.T)


def _barrier(x):
  return jax.lax.optimization_barrier(x) if jax.default_backend() == "cpu" else x


def _chunk_logits(h_bcd, w_dv, inv_temp):
  """[B, C, D] x [D, V] -> float32 logits / temperature [B, C, V], one row-major dot."""
  b, c, d = h_bcd.shape
  z = jnp.dot(h_bcd.reshape(b * c, d), w_dv.astype(h_bcd.dtype), preferred_element_type=jnp.float32)
  z = z.reshape(b, c, -1)
  return z if inv_temp == 1.0 else z * inv_temp


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _head_logprobs(h_btd, w, tgt_bt, inv_temp: float, c: int, layout: str, save_logits: bool):
  """(log softmax(h·Wᵀ / τ)[target], entropy) [B, T], chunk by chunk over T with C = c positions.

  Forward: per chunk one dot h @ W_dv (W_dv = Wᵀ written out once), then two passes over the logits (row max;
  Σ e and Σ e·z with e = exp(z − max)) for the log-sum-exp, the target's log-prob and H = lse − Σ p·z. Saved: h,
  W, W_dv, the targets, lse and H per position, and the logits themselves only with `save_logits` (B·T·V floats).
  Backward (same chunks): z (recomputed, dot 1, unless saved), dz = g_logp·(onehot − p) − g_H·p·(z − E_p[z]) in
  one element-wise pass (∂H/∂z = −p·(z − E_p[z]), E_p[z] = lse − H), dh = dz @ W (dot 2) and dW_dv += hᵀ @ dz
  (dot 3, hᵀ the small transposed operand); Wᵀ's gradient is transposed back once at the end.
  Against JAX's autodiff of a `jax.checkpoint`-ed chunk (the function path): no recomputed matmul when the logits
  are saved, one fused pass instead of autodiff's several over [B, C, V], and every dot row-major on both
  operands (XLA:CPU runs `a.T @ b` forms on Eigen, off its fast path). docs/performance.md."""
  return _head_fwd(h_btd, w, tgt_bt, inv_temp, c, layout, save_logits)[0]


def _both_layouts(w, layout):
  """(W [V, D], W [D, V]): the matrix as given and its transpose written out once."""
  return (w, _t(w)) if layout == "vd" else (_t(w), w)


def _head_fwd(h_btd, w, tgt_bt, inv_temp, c, layout, save_logits):
  t = h_btd.shape[1]
  w_vd, w_dv = _both_layouts(w, layout)

  def one(args):
    h_bcd, tgt_bc = args
    z_bcv = _chunk_logits(h_bcd, w_dv, inv_temp)
    # Two passes over the logits: the row max, then Σ e and Σ e·z with e = exp(z − max) (one multi-output reduce).
    m_bc = jnp.max(z_bcv, axis=-1)
    e_bcv = jnp.exp(z_bcv - m_bc[..., None])
    sum_e_bc, sum_ez_bc = jnp.sum(e_bcv, axis=-1), jnp.sum(e_bcv * z_bcv, axis=-1)
    lse_bc = m_bc + jnp.log(sum_e_bc)
    z_tgt_bc = jnp.take_along_axis(z_bcv, tgt_bc[..., None].astype(jnp.int32), axis=-1)[..., 0]
    ent_bc = lse_bc - sum_ez_bc / sum_e_bc
    return z_tgt_bc - lse_bc, ent_bc, lse_bc, (z_bcv if save_logits else None)

  logp_nbc, ent_nbc, lse_nbc, z_nbcv = jax.lax.map(one, (_split(h_btd, c), _split(tgt_bt, c)))
  out = (_join(logp_nbc, t), _join(ent_nbc, t))
  return out, (h_btd, w_vd, w_dv, tgt_bt, lse_nbc, ent_nbc, z_nbcv)


def _chunk_backward(dw_dv, args, w_vd, w_dv, inv_temp, v0):
  """One chunk of the head's backward over the vocabulary slice w_vd [V_loc, D] (ids v0 .. v0 + V_loc; the whole
  vocabulary off a mesh): z (recomputed unless saved), dz = g_logp·(onehot − p) − g_H·p·(z − E_p[z]), dh = dz @ W
  (float32, the slice's share) and dW_dv += hᵀ @ dz. Returns (dW_dv, dh)."""
  h_bcd, tgt_bc, lse_bc, ent_bc, glp_bc, gent_bc, z_bcv = args
  v, d, dt = w_vd.shape[0], h_bcd.shape[-1], h_bcd.dtype
  if z_bcv is None:
    z_bcv = _chunk_logits(h_bcd, w_dv, inv_temp)
  p_bcv = jnp.exp(z_bcv - lse_bc[..., None])
  onehot = jnp.arange(v, dtype=jnp.int32)[None, None, :] == (tgt_bc.astype(jnp.int32) - v0)[..., None]
  dz_bcv = jnp.where(onehot, glp_bc[..., None], 0.0) - p_bcv * (
    glp_bc[..., None] + gent_bc[..., None] * (z_bcv - (lse_bc - ent_bc)[..., None])
  )
  if inv_temp != 1.0:
    dz_bcv = dz_bcv * inv_temp
  dz_nv = dz_bcv.reshape(-1, v).astype(dt)
  dh_bcd = jnp.dot(dz_nv, w_vd.astype(dt), preferred_element_type=jnp.float32).reshape(h_bcd.shape)
  dw_dv = dw_dv + jnp.dot(_t(h_bcd.reshape(-1, d)), dz_nv, preferred_element_type=jnp.float32)
  return dw_dv, dh_bcd


def _head_bwd(inv_temp, c, layout, save_logits, res, cts):
  h_btd, w_vd, w_dv, tgt_bt, lse_nbc, ent_nbc, z_nbcv = res
  g_logp_bt, g_ent_bt = cts
  b, t, d = h_btd.shape
  v = w_vd.shape[0]
  dt = h_btd.dtype

  def one(dw_dv, args):
    dw_dv, dh_bcd = _chunk_backward(dw_dv, args, w_vd, w_dv, inv_temp, 0)
    return dw_dv, dh_bcd.astype(dt)

  xs = (
    _split(h_btd, c),
    _split(tgt_bt, c),
    lse_nbc,
    ent_nbc,
    _split(g_logp_bt.astype(jnp.float32), c),
    _split(g_ent_bt.astype(jnp.float32), c),
    z_nbcv,
  )
  dw_dv, dh_nbcd = jax.lax.scan(one, jnp.zeros((d, v), jnp.float32), xs)
  # The barrier keeps XLA from folding this transpose into the dW dot (as a dot contracting dz's first axis, which
  # XLA:CPU runs on Eigen: seen when the loop has one chunk).
  dw = _t(_barrier(dw_dv)) if layout == "vd" else dw_dv
  return _join(dh_nbcd, t), dw.astype(w_vd.dtype), None


_head_logprobs.defvjp(_head_fwd, _head_bwd)


# ----------------------------------------------------------------------------------------------------
# The matrix path on a mesh: the head gathered once per call, the vocabulary sharded, one gradient reduction
# ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HeadSharding:
  """How the LM head's log-probs run on a multi-device mesh (`token_logprobs_and_entropy(..., sharding=)`).

  mesh: the training mesh. batch_axes: the mesh axes the rows of h are split over (e.g. ('data', 'fsdp')).
  vocab_axis: the mesh axis the vocabulary is split over (e.g. 'tensor'; None: every chip holds all of it).
  embed_axis: the axis the head's D dim is stored over (e.g. 'fsdp'), where the gradient is reduce-scattered.

  Inside `jax.shard_map` each chip computes its rows' logits for its slice of the vocabulary, chunk by chunk, with
  a log-softmax over the vocabulary axis (per chunk a max and two sums of [rows, C] scalars cross chips, never the
  head); the head enters the map gathered over the batch axes once per call (forward, and once for the backward),
  and its gradient leaves it reduced once (a reduce-scatter onto embed_axis). Without this, XLA's partitioner
  all-gathers the head and all-reduces its gradient inside every chunk of the loop.
  """

  mesh: object
  batch_axes: tuple
  vocab_axis: Optional[str] = None
  embed_axis: Optional[str] = None

  def size(self, axes) -> int:
    return int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1


def _vocab_offset(vocab_axis, v_loc):
  return jax.lax.axis_index(vocab_axis) * v_loc if vocab_axis else 0


def _local_fwd(h_btd, w, tgt_bt, *, inv_temp, c, layout, save, vocab_axis):
  """One chip's share: its rows, its vocabulary slice [V_loc] of the head. Returns per chunk the log-prob,
  entropy, lse and (with `save`) the local logits."""
  t = h_btd.shape[1]
  w_vd, w_dv = _both_layouts(w, layout)
  v_loc = w_vd.shape[0]
  v0 = _vocab_offset(vocab_axis, v_loc)

  def one(args):
    h_bcd, tgt_bc = args
    z_bcv = _chunk_logits(h_bcd, w_dv, inv_temp)
    m_bc = jnp.max(z_bcv, axis=-1)
    if vocab_axis:
      m_bc = jax.lax.pmax(m_bc, vocab_axis)
    e_bcv = jnp.exp(z_bcv - m_bc[..., None])
    local_bc = tgt_bc.astype(jnp.int32) - v0
    inside_bc = (local_bc >= 0) & (local_bc < v_loc)
    z_tgt_bc = jnp.take_along_axis(z_bcv, jnp.clip(local_bc, 0, v_loc - 1)[..., None], axis=-1)[..., 0]
    sums = (jnp.sum(e_bcv, axis=-1), jnp.sum(e_bcv * z_bcv, axis=-1), jnp.where(inside_bc, z_tgt_bc, 0.0))
    if vocab_axis:
      sums = jax.lax.psum(sums, vocab_axis)
    sum_e_bc, sum_ez_bc, z_tgt_bc = sums
    lse_bc = m_bc + jnp.log(sum_e_bc)
    return z_tgt_bc - lse_bc, lse_bc - sum_ez_bc / sum_e_bc, lse_bc, (z_bcv if save else None)

  logp_nbc, ent_nbc, lse_nbc, z_nbcv = jax.lax.map(one, (_split(h_btd, c), _split(tgt_bt, c)))
  return _join(logp_nbc, t), _join(ent_nbc, t), lse_nbc, ent_nbc, z_nbcv


def _local_bwd(h_btd, w, tgt_bt, lse_nbc, ent_nbc, z_nbcv, g_logp_bt, g_ent_bt, *, inv_temp, c, layout, sh):
  """One chip's gradients: dh of its rows (summed over the vocabulary axis once, after the loop) and the head's
  gradient of its vocabulary slice (summed over the batch axes once: a reduce-scatter onto embed_axis)."""
  b, t, d = h_btd.shape
  dt = h_btd.dtype
  w_vd, w_dv = _both_layouts(w, layout)
  v_loc = w_vd.shape[0]
  v0 = _vocab_offset(sh.vocab_axis, v_loc)

  def one(dw_dv, args):
    return _chunk_backward(dw_dv, args, w_vd, w_dv, inv_temp, v0)

  xs = (
    _split(h_btd, c),
    _split(tgt_bt, c),
    lse_nbc,
    ent_nbc,
    _split(g_logp_bt.astype(jnp.float32), c),
    _split(g_ent_bt.astype(jnp.float32), c),
    z_nbcv,
  )
  dw_dv, dh_nbcd = jax.lax.scan(one, jnp.zeros((d, v_loc), jnp.float32), xs)
  dh_btd = _join(dh_nbcd, t)
  if sh.vocab_axis:
    dh_btd = jax.lax.psum(dh_btd, sh.vocab_axis)
  dw = _t(_barrier(dw_dv)) if layout == "vd" else dw_dv  # the head's own layout
  d_dim = 1 if layout == "vd" else 0
  others = tuple(a for a in sh.batch_axes if a != sh.embed_axis)
  if others:
    dw = jax.lax.psum(dw, others)
  if sh.embed_axis in sh.batch_axes:
    dw = jax.lax.psum_scatter(dw, sh.embed_axis, scatter_dimension=d_dim, tiled=True)
  return dh_btd.astype(dt), dw.astype(w_vd.dtype)


def _specs(sh: HeadSharding, layout: str):
  P = jax.sharding.PartitionSpec
  rows = sh.batch_axes or None
  w_in = P(sh.vocab_axis, None) if layout == "vd" else P(None, sh.vocab_axis)
  scatter = sh.embed_axis if sh.embed_axis in sh.batch_axes else None
  w_grad = P(sh.vocab_axis, scatter) if layout == "vd" else P(scatter, sh.vocab_axis)
  return P(rows, None, None), w_in, P(rows, None), P(None, rows, None), P(None, rows, None, sh.vocab_axis), w_grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _sharded_head_logprobs(h_btd, w, tgt_bt, inv_temp, c, layout, save_logits, sh):
  """`_head_logprobs` on `sh.mesh` with the vocabulary split over `sh.vocab_axis` (see HeadSharding)."""
  return _sharded_fwd(h_btd, w, tgt_bt, inv_temp, c, layout, save_logits, sh)[0]


def _sharded_fwd(h_btd, w, tgt_bt, inv_temp, c, layout, save_logits, sh):
  h_spec, w_spec, bt_spec, nbc_spec, nbcv_spec, _ = _specs(sh, layout)
  fn = functools.partial(_local_fwd, inv_temp=inv_temp, c=c, layout=layout, save=save_logits, vocab_axis=sh.vocab_axis)
  out_specs = (bt_spec, bt_spec, nbc_spec, nbc_spec, nbcv_spec if save_logits else None)
  logp, ent, lse_nbc, ent_nbc, z_nbcv = jax.shard_map(
    fn, mesh=sh.mesh, in_specs=(h_spec, w_spec, bt_spec), out_specs=out_specs, check_vma=False
  )(h_btd, w, tgt_bt)
  return (logp, ent), (h_btd, w, tgt_bt, lse_nbc, ent_nbc, z_nbcv)


def _sharded_bwd(inv_temp, c, layout, save_logits, sh, res, cts):
  h_btd, w, tgt_bt, lse_nbc, ent_nbc, z_nbcv = res
  g_logp_bt, g_ent_bt = cts
  h_spec, w_spec, bt_spec, nbc_spec, nbcv_spec, w_grad_spec = _specs(sh, layout)
  fn = functools.partial(_local_bwd, inv_temp=inv_temp, c=c, layout=layout, sh=sh)
  in_specs = (h_spec, w_spec, bt_spec, nbc_spec, nbc_spec, nbcv_spec if save_logits else None, bt_spec, bt_spec)
  dh, dw = jax.shard_map(fn, mesh=sh.mesh, in_specs=in_specs, out_specs=(h_spec, w_grad_spec), check_vma=False)(
    h_btd, w, tgt_bt, lse_nbc, ent_nbc, z_nbcv, g_logp_bt, g_ent_bt
  )
  return dh, dw, None


_sharded_head_logprobs.defvjp(_sharded_fwd, _sharded_bwd)
