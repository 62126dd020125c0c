"""The clipped-ratio policy losses: PPO/GRPO/ARPO, DAPO, GPPO and AEPO.

All four share one token loss (spec §1.5, verl `compute_policy_loss`):
  r = exp(logπ_θ − logπ_old);  ℓ₁ = −A·r;  ℓ₂ = −A·clip(r, lo, hi);  ℓ = max(ℓ₁, ℓ₂)
  dual clip (A < 0, clip_c = c):  ℓ = min(ℓ, −c·A)
They differ only in the bounds. PPO/DAPO use constants lo = 1−ε_l, hi = 1+ε_h. A gradient-preserving
bound is b·r/sg(r): it equals b in the forward pass, and its gradient is b·∇logπ instead of 0.
AEPO (§2.2) preserves the upper bound only; GPPO (§3.5) preserves both.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from aepo_jax.objectives._aggregate import (
  aggregate,
  as_mask,
  masked_max,
  masked_mean,
  masked_min,
  masked_sum,
  masked_var,
)
from aepo_jax.objectives._loss_common import check_clip, finish, prepare, ratio_metrics
from aepo_jax.objectives._registry import register_policy_loss


def _preserving_bound(ratio, bound: float):
  # Forward: exactly `bound` (r − sg(r) is exactly 0), so AEPO's loss value equals PPO's bit for bit.
  # Backward: bound/sg(r)·∇r = bound·∇logπ (spec §2.2: F = 1+ε_h; §3.5: F = 1−ε_l).
  sg_ratio = jax.lax.stop_gradient(ratio)
  return bound + (ratio - sg_ratio) * (bound / sg_ratio)


def clipped_token_loss(ratio, adv, m, *, clip_low, clip_high, clip_c, preserve_low=False, preserve_high=False):
  """Per-token dual-clip PPO loss ℓ_bt and its clip metrics."""
  lo, hi = 1.0 - clip_low, 1.0 + clip_high
  lo_bound = _preserving_bound(ratio, lo) if preserve_low else lo
  hi_bound = _preserving_bound(ratio, hi) if preserve_high else hi
  loss1 = -adv * ratio
  loss2 = -adv * jnp.minimum(jnp.maximum(ratio, lo_bound), hi_bound)
  loss_bt = jnp.maximum(loss1, loss2)
  clipped = loss2 > loss1  # verl pg_clipfrac; A>0 means r > hi, A<0 means r < lo
  metrics = {
    "actor/pg_clipfrac": masked_mean(clipped, m),
    "actor/pg_clipfrac_upper": masked_mean(clipped & (adv > 0), m),
    "actor/pg_clipfrac_lower": masked_mean(clipped & (adv < 0), m),
  }
  if clip_c is not None:
    loss3 = -adv * clip_c
    negative = adv < 0
    # verl names this fraction `pg_clipfrac_lower`; here it is the dual clip (A<0, r > c).
    metrics["actor/dual_clipfrac"] = masked_mean(negative & (loss_bt > loss3), m)
    loss_bt = jnp.where(negative, jnp.minimum(loss_bt, loss3), loss_bt)
  else:
    metrics["actor/dual_clipfrac"] = jnp.float32(0.0)
  return loss_bt, metrics


def _clipped_loss(
  name,
  log_prob,
  old_log_prob,
  advantages,
  mask,
  *,
  clip_low,
  clip_high,
  clip_c,
  agg,
  normalizer,
  preserve_low=False,
  preserve_high=False,
  advantage_factor=None,
  extra_metrics=None,
):
  check_clip(name, clip_low, clip_high, clip_c)
  m, log_ratio, adv, _, _ = prepare(log_prob, old_log_prob, advantages, mask, loss_name=name)
  if advantage_factor is not None:
    adv = adv * advantage_factor
  ratio = jnp.exp(log_ratio)
  loss_bt, metrics = clipped_token_loss(
    ratio,
    adv,
    m,
    clip_low=clip_low,
    clip_high=clip_high,
    clip_c=clip_c,
    preserve_low=preserve_low,
    preserve_high=preserve_high,
  )
  metrics.update(ratio_metrics(ratio, log_ratio, m))
  metrics.update(extra_metrics or {})
  return finish(aggregate(loss_bt, m, agg, normalizer), metrics)


@register_policy_loss("ppo", "grpo", "arpo")
def ppo_loss(
  log_prob,
  old_log_prob,
  advantages,
  mask,
  entropy=None,
  *,
  clip_low=0.2,
  clip_high=0.2,
  clip_c=3.0,
  agg="token-mean",
  normalizer=None,
):
  """Dual-clip PPO (spec §1.5): the loss of verl's GRPO and of ARPO (ε = 0.2, c = 3, token-mean)."""
  del entropy  # accepted for a uniform signature
  return _clipped_loss(
    "ppo",
    log_prob,
    old_log_prob,
    advantages,
    mask,
    clip_low=clip_low,
    clip_high=clip_high,
    clip_c=clip_c,
    agg=agg,
    normalizer=normalizer,
  )


@register_policy_loss("dapo")
def dapo_loss(
  log_prob,
  old_log_prob,
  advantages,
  mask,
  entropy=None,
  *,
  clip_low=0.2,
  clip_high=0.28,
  clip_c=10.0,
  agg="token-mean",
  normalizer=None,
):
  """DAPO (spec §3.2): clip-higher ε_l=0.2, ε_h=0.28, token-level mean; verl recipe's c = 10."""
  del entropy
  return _clipped_loss(
    "dapo",
    log_prob,
    old_log_prob,
    advantages,
    mask,
    clip_low=clip_low,
    clip_high=clip_high,
    clip_c=clip_c,
    agg=agg,
    normalizer=normalizer,
  )


@register_policy_loss("gppo")
def gppo_loss(
  log_prob,
  old_log_prob,
  advantages,
  mask,
  entropy=None,
  *,
  clip_low=0.2,
  clip_high=0.28,
  clip_c=None,
  agg="token-mean",
  normalizer=None,
):
  """GPPO (spec §3.5): both bounds gradient-preserving, F = 1−ε_l / 1+ε_h in the clipped regions."""
  del entropy
  return _clipped_loss(
    "gppo",
    log_prob,
    old_log_prob,
    advantages,
    mask,
    clip_low=clip_low,
    clip_high=clip_high,
    clip_c=clip_c,
    agg=agg,
    normalizer=normalizer,
    preserve_low=True,
    preserve_high=True,
  )


def entropy_stats(entropy_bt, mask_bt):
  """(mean, std) of the entropy over valid tokens: unbiased std, replaced by 1 if 0 or < 2 tokens.

  The official code takes them over the micro-batch the loss sees (spec §2.3). Compute them once on the
  whole mini-batch and pass `entropy_mean`/`entropy_std` to `aepo` for micro-batch-independent scaling.
  """
  m = as_mask(mask_bt)
  h = jnp.asarray(entropy_bt, jnp.float32)
  n = jnp.sum(m)
  mean = masked_sum(h, m) / jnp.maximum(n, 1.0)
  var = masked_sum(jnp.square(h - mean), m) / jnp.maximum(n - 1.0, 1.0)
  std = jnp.sqrt(var)
  # torch gives NaN for one token (ddof=1); 1 keeps the factor finite.
  return mean, jnp.where((std == 0) | (n < 2), 1.0, std)


def entropy_advantage_factor(entropy_bt, mask_bt, coef, entropy_mean=None, entropy_std=None):
  """sg(1 + a·(H − mean)/std), the entropy-aware advantage factor of spec §2.3."""
  if (entropy_mean is None) != (entropy_std is None):
    raise ValueError("aepo: pass both entropy_mean and entropy_std, or neither")
  if entropy_mean is None:
    entropy_mean, entropy_std = entropy_stats(entropy_bt, mask_bt)
  h_hat = (jnp.asarray(entropy_bt, jnp.float32) - entropy_mean) / entropy_std
  return jax.lax.stop_gradient(1.0 + coef * h_hat)


@register_policy_loss("aepo")
def aepo_loss(
  log_prob,
  old_log_prob,
  advantages,
  mask,
  entropy=None,
  *,
  clip_low=0.2,
  clip_high=0.2,
  clip_c=3.0,
  agg="token-mean",
  normalizer=None,
  entropy_advantage_coef=0.2,
  preserve_high_clip_grad=True,
  entropy_mean=None,
  entropy_std=None,
):
  """AEPO policy loss (spec §2.2 + §2.3).

  preserve_high_clip_grad: the upper bound is (1+ε_h)/sg(r)·r, so tokens with A>0 and r>1+ε_h keep
    gradient weight (1+ε_h)·A; the value equals `ppo`'s exactly. The dual clip c = 3 is kept (code).
  entropy_advantage_coef a: Ã = A·sg(1 + a·Ĥ), Ĥ the entropy standardised over the valid tokens this
    call sees (or by `entropy_mean`/`entropy_std`). Official value 0.2. 0 reproduces the released runs,
    where the actor never passed the entropy (§2.6); unlike that code, a nonzero `a` without `entropy`
    is an error, not a silent no-op.
  """
  off = isinstance(entropy_advantage_coef, numbers.Number) and entropy_advantage_coef == 0
  factor, extra = None, {}
  if not off:
    if entropy is None:
      raise ValueError(
        f"aepo: entropy_advantage_coef={entropy_advantage_coef} needs the per-token policy entropy "
        "(entropy=[B, T], from token_logprobs_and_entropy); pass it, or set "
        "entropy_advantage_coef=0.0 to reproduce the released AEPO configuration"
      )
    if jnp.shape(entropy) != jnp.shape(log_prob):
      raise ValueError(f"aepo: entropy shape {jnp.shape(entropy)} must equal log_prob's {jnp.shape(log_prob)}")
    m = as_mask(mask)
    entropy = jnp.where(m > 0, jnp.asarray(entropy, jnp.float32), 0.0)
    factor = entropy_advantage_factor(entropy, m, entropy_advantage_coef, entropy_mean, entropy_std)
    extra = {
      "actor/entropy_adv_factor_mean": masked_mean(factor, m),
      "actor/entropy_adv_factor_std": jnp.sqrt(masked_var(factor, m, unbiased=False)),
      "actor/entropy_adv_factor_min": masked_min(factor, m),
      "actor/entropy_adv_factor_max": masked_max(factor, m),
      # 1 + a·Ĥ < 0 flips the sign of A (only when Ĥ < −1/a, i.e. −5 for a = 0.2).
      "actor/entropy_adv_sign_flip_frac": masked_mean(factor < 0, m),
      "actor/entropy_mean": masked_mean(entropy, m),
    }
  return _clipped_loss(
    "aepo",
    log_prob,
    old_log_prob,
    advantages,
    mask,
    clip_low=clip_low,
    clip_high=clip_high,
    clip_c=clip_c,
    agg=agg,
    normalizer=normalizer,
    preserve_high=preserve_high_clip_grad,
    advantage_factor=factor,
    extra_metrics=extra,
  )
