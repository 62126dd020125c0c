"""Rollout policies: how a prompt's budget of n trajectories is spent (spec §1.2, §2.1).

rollout_policy(name, config=PolicyConfig(), **overrides) -> RolloutPolicy   'none' | 'arpo' | 'aepo'
register_rollout_policy(name)                 class decorator for new policies
PolicyConfig                                  n, initial_rollouts, beam_size, w, τ, window, estimator, mode, ...
RolloutPolicy.plan_round(...) -> RoundPlan    branches + refills at the end of a round (used by the agent loop)
Pure jitted pieces: window_statistic, branch_probability, decide_branches (from the segment accumulators: the
  statistic and the decision in one compiled function), premonitor_split
Tree statistics: tree_stats(records, ...); combine_stats(per-host stats) -> the stats of all hosts' rollouts
"""

from aepo_jax.rollout.policies._base import MODES, PolicyConfig, RolloutPolicy, RoundPlan
from aepo_jax.rollout.policies._entropy import (
  ESTIMATORS,
  PREMONITOR_FORMULAS,
  RULES,
  branch_probability,
  decide_branches,
  premonitor_split,
  window_statistic,
)
from aepo_jax.rollout.policies._registry import register_rollout_policy, rollout_policy, rollout_policy_names
from aepo_jax.rollout.policies import _none, _arpo, _aepo  # noqa: F401,E402  (register the built-ins)
from aepo_jax.rollout.policies._aepo import AepoPolicy
from aepo_jax.rollout.policies._arpo import ArpoPolicy
from aepo_jax.rollout.policies._none import NonePolicy
from aepo_jax.rollout.policies._stats import combine_stats, tree_stats
