"""Policy losses that are not a token-ratio clip: GSPO, CISPO and plain REINFORCE."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aepo_jax.objectives._aggregate import aggregate, masked_mean, masked_sum
from aepo_jax.objectives._loss_common import check_clip, finish, prepare, ratio_metrics
from aepo_jax.objectives._registry import register_policy_loss

_GSPO_LOG_RATIO_MAX = 10.0  # verl GSPO clamps log s_{i,t} at 10 (spec §3.3)


@register_policy_loss("gspo")
def gspo_loss(
  log_prob,
  old_log_prob,
  advantages,
  mask,
  entropy=None,
  *,
  clip_low=3e-4,
  clip_high=4e-4,
  clip_c=None,
  agg="seq-mean-token-mean",
  normalizer=None,
):
  """GSPO-token (spec §3.3, verl `compute_policy_loss_gspo`).

  log s_{i,t} = logπ_θ(t) − sg(logπ_θ(t)) + sg((1/|o_i|) Σ_t log r_{i,t}), clamped at ≤ 10;
  ℓ = max(−A·s, −A·clip(s, 1−ε_l, 1+ε_h)). No dual clip. verl always aggregates with
  seq-mean-token-mean whatever the config says; here that is the default and `agg` may change it.
  """
  del entropy
  if clip_c is not None:
    raise ValueError(f"gspo has no dual clip; got clip_c={clip_c}, use clip_c=None")
  check_clip("gspo", clip_low, clip_high)
  m, log_ratio, adv, log_prob, _ = prepare(log_prob, old_log_prob, advantages, mask, loss_name="gspo")
  seq_log_ratio_b = masked_sum(log_ratio, m, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0)
  log_s = log_prob - jax.lax.stop_gradient(log_prob) + jax.lax.stop_gradient(seq_log_ratio_b)[:, None]
  seq_ratio = jnp.exp(jnp.minimum(log_s, _GSPO_LOG_RATIO_MAX))
  loss1 = -adv * seq_ratio
  loss2 = -adv * jnp.clip(seq_ratio, 1.0 - clip_low, 1.0 + clip_high)
  loss_bt = jnp.maximum(loss1, loss2)
  clipped = loss2 > loss1
  has_tokens_b = jnp.sum(m, axis=-1) > 0
  metrics = {
    "actor/pg_clipfrac": masked_mean(clipped, m),
    "actor/pg_clipfrac_upper": masked_mean(clipped & (adv > 0), m),
    "actor/pg_clipfrac_lower": masked_mean(clipped & (adv < 0), m),
    "actor/dual_clipfrac": jnp.float32(0.0),
    "actor/seq_ratio_mean": masked_mean(jnp.exp(seq_log_ratio_b), has_tokens_b),
  }
  metrics.update(ratio_metrics(jnp.exp(log_ratio), log_ratio, m))
  return finish(aggregate(loss_bt, m, agg, normalizer), metrics)


@register_policy_loss("cispo")
def cispo_loss(
  log_prob,
  old_log_prob,
  advantages,
  mask,
  entropy=None,
  *,
  clip_low=1.0,
  clip_high=4.0,
  agg="token-mean",
  normalizer=None,
):
  """CISPO (spec §3.6, MiniMax-M1 eq. 4-5): ℓ = −sg(clip(r, 1−ε_l, 1+ε_h))·A·logπ_θ.

  Every valid token keeps the gradient r̂·A·∇logπ. Defaults follow ScaleRL/SkyRL: no lower bound
  (ε_l = 1 → 0) and an upper bound of 5 (ε_h = 4); AEPO's setting is unknown (§3.6).
  """
  del entropy
  check_clip("cispo", clip_low, clip_high)
  m, log_ratio, adv, log_prob, _ = prepare(log_prob, old_log_prob, advantages, mask, loss_name="cispo")
  ratio = jnp.exp(log_ratio)
  is_weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high))
  loss_bt = -is_weight * adv * log_prob
  metrics = {
    "actor/pg_clipfrac": masked_mean(is_weight != ratio, m),
    "actor/pg_clipfrac_upper": masked_mean(ratio > 1.0 + clip_high, m),
    "actor/pg_clipfrac_lower": masked_mean(ratio < 1.0 - clip_low, m),
    "actor/dual_clipfrac": jnp.float32(0.0),
  }
  metrics.update(ratio_metrics(ratio, log_ratio, m))
  return finish(aggregate(loss_bt, m, agg, normalizer), metrics)


@register_policy_loss("reinforce")
def reinforce_loss(log_prob, old_log_prob, advantages, mask, entropy=None, *, agg="token-mean", normalizer=None):
  """Plain policy gradient ℓ = −A·logπ_θ (verl `gpg` loss): no ratio, no clipping.

  Not REINFORCE++: per spec §3.4 REINFORCE++ trains with the `ppo` loss (ε = 0.2) on the
  `reinforce_pp` advantage. This is the unclipped on-policy reference point.
  """
  del entropy
  m, log_ratio, adv, log_prob, _ = prepare(log_prob, old_log_prob, advantages, mask, loss_name="reinforce")
  metrics = {
    "actor/pg_clipfrac": jnp.float32(0.0),
    "actor/pg_clipfrac_upper": jnp.float32(0.0),
    "actor/pg_clipfrac_lower": jnp.float32(0.0),
    "actor/dual_clipfrac": jnp.float32(0.0),
  }
  metrics.update(ratio_metrics(jnp.exp(log_ratio), log_ratio, m))
  return finish(aggregate(-adv * log_prob, m, agg, normalizer), metrics)
