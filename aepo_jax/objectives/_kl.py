"""Per-token KL estimators (Schulman, "Approximating KL divergence"; verl `kl_penalty`).

Each is `fn(log_prob_bt, ref_log_prob_bt) -> kl_bt`. Use one as a loss term (`kl_loss`, verl
`use_kl_loss`) or as a reward penalty (`kl_reward_penalty`, verl `use_kl_in_reward`). ARPO/AEPO run
`low_var_kl` with coefficient 0, i.e. no KL at all (spec §1.5).
"""

from __future__ import annotations

import jax.numpy as jnp

from aepo_jax.objectives._aggregate import aggregate, as_mask
from aepo_jax.objectives._registry import kl as get_kl
from aepo_jax.objectives._registry import register_kl


@register_kl("k1", "kl")
def k1(log_prob, ref_log_prob):
  """log π − log π_ref: unbiased, high variance, can be negative."""
  return log_prob - ref_log_prob


@register_kl("abs")
def kl_abs(log_prob, ref_log_prob):
  return jnp.abs(log_prob - ref_log_prob)


@register_kl("k2", "mse")
def k2(log_prob, ref_log_prob):
  """½(log π − log π_ref)²."""
  return 0.5 * jnp.square(log_prob - ref_log_prob)


@register_kl("k3", "low_var_kl")
def k3(log_prob, ref_log_prob):
  """exp(Δ) − Δ − 1 with Δ = log π_ref − log π, Δ clamped to ±20 and the result to ±10 (verl)."""
  delta = jnp.clip(ref_log_prob - log_prob, -20.0, 20.0)
  return jnp.clip(jnp.exp(delta) - delta - 1.0, -10.0, 10.0)


def kl_loss(log_prob, ref_log_prob, mask, *, estimator="low_var_kl", agg="token-mean", normalizer=None):
  """Aggregated KL loss term; multiply by the coefficient (verl `kl_loss_coef`) in the trainer."""
  m = as_mask(mask)
  valid = m > 0
  kl_bt = get_kl(estimator)(jnp.where(valid, log_prob, 0.0), jnp.where(valid, ref_log_prob, 0.0))
  return aggregate(kl_bt, m, agg, normalizer)


def kl_reward_penalty(log_prob, ref_log_prob, mask, *, coef, estimator="k1"):
  """Token rewards −β·KL·m (verl `apply_kl_penalty`), e.g. `token_rewards=` of `reinforce_pp`.

  verl computes it from the rollout-time (old) log-probs and the reference log-probs.
  """
  m = as_mask(mask)
  valid = m > 0
  kl_bt = get_kl(estimator)(jnp.where(valid, log_prob, 0.0), jnp.where(valid, ref_log_prob, 0.0))
  return -coef * kl_bt * m
