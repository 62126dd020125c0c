"""'aepo': entropy pre-monitoring of the budget split and branching with a consecutive-branch penalty (spec §2.1)."""

import jax
import numpy as np

from aepo_jax.rollout.policies._base import RolloutPolicy
from aepo_jax.rollout.policies._entropy import premonitor_split
from aepo_jax.rollout.policies._registry import register_rollout_policy


@register_rollout_policy("aepo")
class AepoPolicy(RolloutPolicy):
  """Branch iff clip((u + w·ΔH)·f, 0, 1) ≥ τ with f = max(0, 1 − slope·l) and l the per-prompt counter."""

  rule = "aepo"

  def needs_probe(self) -> bool:
    return self.config.enable_dynamic_rollouts

  def initial_counts(self, num_prompts: int, probe=None) -> np.ndarray:
    cfg = self.config
    if not cfg.enable_dynamic_rollouts:  # the released scripts (spec §2.6); the 30efc15 fix: max(1, min(N0, n))
      return np.full((num_prompts,), max(1, min(cfg.initial_rollouts, cfg.n)), np.int32)
    if probe is None:
      raise ValueError(
        "AEPO with enable_dynamic_rollouts=True needs a probe (the agent loop provides it); "
        "or set enable_dynamic_rollouts=False."
      )
    h_root_p, h_tool_p = probe()
    self.last_probe = (np.asarray(h_root_p), np.asarray(h_tool_p))
    return np.asarray(
      jax.device_get(
        premonitor_split(h_root_p, h_tool_p, n=cfg.n, beta=cfg.premonitor_beta, formula=cfg.premonitor_formula)
      ),
      np.int32,
    )

  def _update_counters(self, children_p, refills_p) -> None:
    """After a round that created any copy: +1 for prompts that got one, reset to 0 for the others; rounds
    creating nothing leave the counters alone (spec §2.1). Refills count unless penalty_counts_refills=False."""
    new_p = children_p + (refills_p if self.config.penalty_counts_refills else 0)
    if not new_p.any():
      return
    self.consecutive_p = np.where(new_p > 0, self.consecutive_p + 1, 0).astype(np.int32)
