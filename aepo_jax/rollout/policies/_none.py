"""'none': n i.i.d. samples per prompt, no branching (the GRPO/DAPO/... baselines)."""

from aepo_jax.rollout.policies._base import RolloutPolicy
from aepo_jax.rollout.policies._registry import register_rollout_policy


@register_rollout_policy("none")
class NonePolicy(RolloutPolicy):
  rule = None
