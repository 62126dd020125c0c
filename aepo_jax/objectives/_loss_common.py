"""Pieces shared by the policy losses: input checks, the importance ratio, common metrics."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aepo_jax.objectives._aggregate import as_mask, masked_max, masked_mean, masked_min

# verl clamps log(π_θ/π_old) to ±20 before exp so a stale token cannot overflow the ratio. The released
# AEPO loss omits the clamp; the two differ only where |log r| > 20, where this one has zero gradient.
LOG_RATIO_CLAMP = 20.0


def prepare(log_prob, old_log_prob, advantages, mask, entropy=None, loss_name="policy loss"):
  """Checks shapes, casts to float32, zeroes masked positions so NaN/inf there never reach a gradient.

  Returns (mask_bt as 0/1 float32, log_ratio_bt clamped, advantages_bt, log_prob_bt, entropy_bt or None).
  """
  arrays = {"log_prob": log_prob, "old_log_prob": old_log_prob, "advantages": advantages, "mask": mask}
  if entropy is not None:
    arrays["entropy"] = entropy
  shapes = {k: jnp.shape(v) for k, v in arrays.items()}
  if len(shapes["log_prob"]) != 2:
    raise ValueError(f"{loss_name}: log_prob must be [B, T], got shape {shapes['log_prob']}")
  bad = {k: s for k, s in shapes.items() if s != shapes["log_prob"]}
  if bad:
    raise ValueError(
      f"{loss_name}: every input must have log_prob's shape {shapes['log_prob']}; "
      f"got {bad} (broadcast per-sequence advantages to [B, T] first)"
    )
  m = as_mask(mask)
  valid = m > 0
  log_prob = jnp.where(valid, jnp.asarray(log_prob, jnp.float32), 0.0)
  old_log_prob = jnp.where(valid, jnp.asarray(old_log_prob, jnp.float32), 0.0)
  log_ratio = jnp.clip(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  adv = jnp.where(valid, jnp.asarray(advantages, jnp.float32), 0.0)
  if entropy is not None:
    entropy = jnp.where(valid, jnp.asarray(entropy, jnp.float32), 0.0)
  return m, log_ratio, adv, log_prob, entropy


def check_clip(loss_name, clip_low, clip_high, clip_c=None):
  """Hyperparameters are Python scalars fixed per run; reject values that silently break clipping."""
  if not 0.0 <= clip_low <= 1.0:
    raise ValueError(f"{loss_name}: clip_low={clip_low} must lie in [0, 1] (lower bound is 1 - clip_low)")
  if clip_high < 0.0:
    raise ValueError(f"{loss_name}: clip_high={clip_high} must be >= 0 (upper bound is 1 + clip_high)")
  if clip_c is not None and clip_c <= 1.0:
    raise ValueError(
      f"{loss_name}: dual-clip clip_c={clip_c} must be > 1 (verl asserts the same); "
      "use clip_c=None to turn the dual clip off"
    )


def ratio_metrics(ratio, log_ratio, m):
  """Metrics every ratio-based loss reports: approx KL (old − new) and the ratio distribution."""
  return {
    "actor/ppo_kl": masked_mean(-log_ratio, m),
    "actor/ratio_mean": masked_mean(ratio, m),
    "actor/ratio_max": masked_max(ratio, m),
    "actor/ratio_min": masked_min(ratio, m),
  }


def finish(loss, metrics):
  metrics = dict(metrics, **{"actor/pg_loss": loss})
  return loss, jax.lax.stop_gradient(metrics)
