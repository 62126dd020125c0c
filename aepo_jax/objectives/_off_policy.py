"""Off-policy corrections: per-token importance weights for tokens sampled by an older (behaviour) policy.

The trainer's `old_log_prob` is the proximal policy π_prox (the parameters at the start of the update, recomputed by
the trainer); the engine's sampling log-prob is the behaviour policy π_behav that actually drew each token (an
older parameter version with carried-over rollouts, or the same version in another numeric precision). With
w_t = π_prox(y_t) / π_behav(y_t) = exp(old_log_prob − behaviour_log_prob):

  none       w_t = 1: today's objective.
  decoupled  the decoupled PPO objective of AReaL (Fu et al. 2025, arXiv 2505.24298, eq. 5): the policy loss with its
             ratio against π_prox, each token's term weighted by w_t; tokens with w_t > cap are dropped from the
             loss (AReaL's `behav_imp_weight_cap`: filtered, not truncated). cap None keeps every token.
  tis        token-level truncated importance sampling (verl PR #2953, "Your efficient RL framework secretly brings
             you off-policy RL training"): w_t = min(w_t, cap), every token kept.

Applied to any registered policy loss by `apply_off_policy`, as advantages_t x sg(w_t): every registered loss is
linear in each token's advantage for a fixed ratio (the clip bounds act on the ratio, AEPO's entropy factor and the
dual clip scale with A), so this is the weighted per-token loss; the weights carry no gradient. When the behaviour
log-probs equal the proximal ones (synchronous training with identical numerics) every weight is 1 and the loss is
exactly the uncorrected one.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from aepo_jax.objectives._aggregate import as_mask, masked_max, masked_mean, masked_sum
from aepo_jax.objectives._registry import register_off_policy


def _log_ratio(proximal_log_prob, behaviour_log_prob, m):
  # Clamped before exp: a token the behaviour policy found 1e-30 likely must not overflow the weight.
  return jnp.where(m > 0, jnp.clip(proximal_log_prob - behaviour_log_prob, -20.0, 20.0), 0.0)


def _metrics(w, m, capped):
  """ESS of the weights over the kept tokens, normalised to [0, 1] ((Σw)² / (N·Σw²)), their mean and max, and the
  share of tokens the cap acted on."""
  n = jnp.maximum(masked_sum(jnp.ones_like(w), m), 1.0)
  s1, s2 = masked_sum(w, m), masked_sum(w * w, m)
  return {
    "offpolicy/ess": jnp.where(s2 > 0, s1 * s1 / (n * jnp.maximum(s2, 1e-30)), 1.0),
    "offpolicy/weight_mean": masked_mean(w, m),
    "offpolicy/weight_max": masked_max(w, m),
    "offpolicy/capped_frac": capped,
  }


@register_off_policy("none")
def no_correction(proximal_log_prob, behaviour_log_prob, mask):
  m = as_mask(mask)
  w = jnp.ones_like(proximal_log_prob, dtype=jnp.float32)
  return w, m, _metrics(w, m, jnp.float32(0.0))


@register_off_policy("decoupled")
def decoupled_weights(proximal_log_prob, behaviour_log_prob, mask, *, cap: Optional[float] = 5.0):
  m = as_mask(mask)
  w = jnp.exp(_log_ratio(proximal_log_prob, behaviour_log_prob, m))
  over = (w > cap) if cap is not None else jnp.zeros_like(w, dtype=bool)
  capped = masked_mean(over, m)
  keep = m * (~over).astype(m.dtype)
  w = jnp.where(over, 0.0, w)
  return jax.lax.stop_gradient(w), keep, _metrics(w, keep, capped)


@register_off_policy("tis")
def truncated_weights(proximal_log_prob, behaviour_log_prob, mask, *, cap: float = 2.0):
  m = as_mask(mask)
  w = jnp.exp(_log_ratio(proximal_log_prob, behaviour_log_prob, m))
  capped = masked_mean(w > cap, m)
  w = jnp.minimum(w, cap)
  return jax.lax.stop_gradient(w), m, _metrics(w, m, capped)


def check_off_policy(name: str, **hp) -> None:
  """Refuse a cap that makes no sense for `name` (a ConfigError upstream names the key)."""
  cap = hp.get("cap")
  if name == "tis" and (cap is None or not cap >= 1.0):
    raise ValueError(f"off-policy 'tis': cap={cap} must be >= 1 (verl's tis_imp_ratio_cap; 2 is common)")
  if name == "decoupled" and cap is not None and not cap > 1.0:
    raise ValueError(f"off-policy 'decoupled': cap={cap} must be > 1 or None (AReaL's behav_imp_weight_cap)")


def apply_off_policy(loss_fn: Callable, name: str, **hp) -> Callable:
  """`loss_fn` (a registered policy loss) with the off-policy correction `name`: the returned function takes the
  same arguments plus `behaviour_log_prob` and returns (loss, metrics + offpolicy/*). name 'none' returns a function
  equal to `loss_fn` (the extra argument ignored)."""
  from aepo_jax.objectives._registry import off_policy

  weights_fn = off_policy(name)
  check_off_policy(name, **hp)

  def corrected(log_prob, old_log_prob, advantages, mask, *args, behaviour_log_prob=None, **kw):
    if name == "none" or behaviour_log_prob is None:
      return loss_fn(log_prob, old_log_prob, advantages, mask, *args, **kw)
    w, keep, metrics = weights_fn(old_log_prob, behaviour_log_prob, mask, **hp)
    loss, loss_metrics = loss_fn(log_prob, old_log_prob, advantages * w.astype(advantages.dtype), keep, *args, **kw)
    return loss, {**loss_metrics, **metrics}

  return corrected
