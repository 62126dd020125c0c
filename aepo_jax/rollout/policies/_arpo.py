"""'arpo': N0 global samples, entropy-based branching after tool calls, one refill per round (spec §1.2)."""

import numpy as np

from aepo_jax.rollout.policies._base import RolloutPolicy
from aepo_jax.rollout.policies._registry import register_rollout_policy


@register_rollout_policy("arpo")
class ArpoPolicy(RolloutPolicy):
  """P(branch) = clip(τ + w·ΔH, 0, 1) per attempt, Z−1 attempts per candidate (spec §1.2 2.6)."""

  rule = "arpo"

  def initial_counts(self, num_prompts: int, probe=None) -> np.ndarray:
    return np.full((num_prompts,), min(self.config.initial_rollouts, self.config.n), np.int32)  # N0' (step 1)
