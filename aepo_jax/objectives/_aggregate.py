"""Masked statistics and the loss aggregation modes shared by every policy loss.

`aggregate(loss_bt, mask_bt, mode, normalizer)` follows verl's `agg_loss` (spec §1.5, §3.1):
  token-mean               Σ_bt ℓ·m / (Σ_bt m + 1e-8)
  seq-mean-token-sum       (1/S) Σ_b Σ_t ℓ·m
  seq-mean-token-mean      (1/S) Σ_b (Σ_t ℓ·m / Σ_t m)
  seq-mean-token-sum-norm  Σ_bt ℓ·m / T        (Dr.GRPO; T = mask_bt.shape[-1]; verl does not divide by S)
S counts the sequences with at least one valid token, so all-padding rows added to fill a fixed shape
change nothing (verl's torch.mean counts every row, and gives NaN for an empty row in seq-mean-token-mean).

Gradient accumulation (spec §5.10). The denominator of a mode is `loss_normalizer(mask_bt, mode)`.
Passing `normalizer=` replaces it, so with
    n = loss_normalizer(mask_of_the_whole_minibatch, mode)
    loss = Σ_k aggregate(ℓ_k, m_k, mode, normalizer=n)          (sum, not mean, over micro-batches k)
the accumulated loss and gradient equal those of the whole mini-batch in one piece: a *global* token-mean.
verl instead takes each micro-batch's own token-mean and weights it by its share of sequences,
`Σ_k aggregate(ℓ_k, m_k, mode) · dynamic_bsz_scale(m_k, S)`; `dynamic_bsz_scale` reproduces that. Where verl's
micro-batches are not ours (its token-balanced `use_dynamic_bsz` partitions), a per-row normalizer [B] gives each
row the weight its verl micro-batch would (`train/_verl_batching.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_TOKEN_MEAN_EPS = 1e-8  # verl masked_mean in agg_loss (spec §1.5)


def as_mask(mask_bt):
  """0/1 float32 mask from a bool or numeric mask."""
  return (jnp.asarray(mask_bt) != 0).astype(jnp.float32)


def masked_sum(x, mask, axis=None):
  # where, not multiply: a NaN/inf at a masked position must not leak into the sum.
  return jnp.sum(jnp.where(mask > 0, x, 0.0), axis=axis)


def masked_mean(x, mask, axis=None):
  """Σ x·m / max(Σ m, 1): 0 for an empty mask instead of NaN."""
  return masked_sum(x, mask, axis) / jnp.maximum(jnp.sum(mask, axis=axis), 1.0)


def masked_max(x, mask):
  """Max over valid entries; 0 when none is valid (a metric, never ±inf)."""
  valid = mask > 0
  return jnp.where(jnp.any(valid), jnp.max(jnp.where(valid, x, -jnp.inf), initial=-jnp.inf), 0.0)


def masked_min(x, mask):
  valid = mask > 0
  return jnp.where(jnp.any(valid), jnp.min(jnp.where(valid, x, jnp.inf), initial=jnp.inf), 0.0)


def masked_var(x, mask, unbiased: bool = True):
  """Masked variance; unbiased uses n/(n-1) (verl masked_var). With n < 2 the correction is skipped."""
  mean = masked_mean(x, mask)
  var = masked_mean(jnp.square(x - mean), mask)
  if unbiased:
    n = jnp.sum(mask)
    var = var * jnp.where(n > 1, n / jnp.maximum(n - 1.0, 1.0), 1.0)
  return var


def masked_whiten(x, mask, shift_mean: bool = True):
  """(x − mean)·rsqrt(var + 1e-8) over the valid entries (verl masked_whiten, unbiased var)."""
  mean = masked_mean(x, mask)
  out = (x - mean) * jax.lax.rsqrt(masked_var(x, mask) + 1e-8)
  return out if shift_mean else out + mean


def num_sequences(mask_bt):
  """Number of rows with at least one valid token."""
  return jnp.sum(jnp.any(as_mask(mask_bt) > 0, axis=-1).astype(jnp.float32))


def loss_normalizer(mask_bt, mode: str = "token-mean"):
  """The denominator `aggregate` divides by for this mask; compute it on the whole mini-batch."""
  m = as_mask(mask_bt)
  if mode == "token-mean":
    return jnp.sum(m) + _TOKEN_MEAN_EPS
  if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
    return jnp.maximum(num_sequences(m), 1.0)
  if mode == "seq-mean-token-sum-norm":
    return jnp.float32(m.shape[-1])
  raise ValueError(f"unknown aggregation mode agg={mode!r}; use one of {AGG_MODES}")


def aggregate(loss_bt, mask_bt, mode: str = "token-mean", normalizer=None):
  """Reduce per-token losses to a scalar; `normalizer` overrides the denominator (see module doc). A normalizer of
  shape [B] divides each row's sum (seq-mean-token-mean: each row's mean) by its own entry; rows with 0 count 0."""
  if mode not in AGG_MODES:
    raise ValueError(f"unknown aggregation mode agg={mode!r}; use one of {AGG_MODES}")
  m = as_mask(mask_bt)
  if loss_bt.shape != m.shape:
    raise ValueError(f"loss_bt {loss_bt.shape} and mask_bt {m.shape} must have the same [B, T] shape")
  per_seq = mode == "seq-mean-token-mean"
  if normalizer is not None and jnp.ndim(normalizer) == 1:  # one denominator per row (verl's dynamic micro-batches)
    row_b = _seq_means(loss_bt, m) if per_seq else masked_sum(loss_bt, m, axis=-1)
    return jnp.sum(jnp.where(normalizer > 0, row_b / jnp.where(normalizer > 0, normalizer, 1.0), 0.0))
  denom = loss_normalizer(m, mode) if normalizer is None else normalizer
  if per_seq:
    return jnp.sum(_seq_means(loss_bt, m)) / denom
  return masked_sum(loss_bt, m) / denom


def _seq_means(loss_bt, m):
  """Each row's mean over its valid tokens (0 for an empty row)."""
  return masked_sum(loss_bt, m, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0)


def dynamic_bsz_scale(micro_mask_bt, minibatch_num_sequences):
  """verl's micro-batch weight under use_dynamic_bsz: (#sequences in micro-batch) / (#in mini-batch)."""
  return num_sequences(micro_mask_bt) / minibatch_num_sequences
