"""objectives: the RL math of AEPO/ARPO and its baselines, as pure JAX functions registered by name.

Policy losses  `policy_loss(name)(log_prob, old_log_prob, advantages, mask, entropy=None, **hp)`
               -> (loss, metrics); names: ppo (= grpo = arpo), dapo, gspo, gppo, cispo, aepo, reinforce.
               Hyperparameters: clip_low, clip_high, clip_c (dual clip, None = off), agg, normalizer;
               aepo adds entropy_advantage_coef and preserve_high_clip_grad.
Advantages     `advantage(name)(rewards_b, group_ids_b, mask_bt, **hp) -> advantages_bt`;
               grpo, rloo, reinforce_pp, reinforce_pp_baseline.
               `hard_attribution(adv_bt, mask_bt, parent_b, fork_pos_b)`: ARPO's hard credit for shared
               prefixes (ATTRIBUTIONS: soft = the advantages as they are, hard).
KL             `kl(name)(log_prob, ref_log_prob) -> kl_bt`; k1/kl, abs, k2/mse, k3/low_var_kl;
               `kl_loss`, `kl_reward_penalty`.
Aggregation    `aggregate`, `loss_normalizer` (global token-mean under gradient accumulation),
               `dynamic_bsz_scale` (verl's per-micro-batch weighting).
DAPO extras    `dynamic_sampling_keep`, `overlong_reward_penalty`.
Off-policy     `off_policy(name)(proximal_log_prob, behaviour_log_prob, mask, **hp) -> (w, mask, metrics)`: none,
               decoupled (AReaL), tis (truncated IS); `apply_off_policy(loss_fn, name, **hp)` for any policy loss.
Logits         `token_logprobs_and_entropy` (chunked over T; `HeadSharding`: vocabulary-sharded on a mesh),
               `entropy_from_logits`.
See docs/objectives.md for formulas, defaults and where the official code differs.
"""

from aepo_jax.objectives._aggregate import (
  AGG_MODES,
  aggregate,
  dynamic_bsz_scale,
  loss_normalizer,
  masked_mean,
  masked_var,
  masked_whiten,
  num_sequences,
)
from aepo_jax.objectives._registry import (
  advantage,
  advantage_defaults,
  kl,
  list_advantages,
  list_kl_estimators,
  list_off_policy,
  list_policy_losses,
  off_policy,
  policy_loss,
  policy_loss_defaults,
  register_advantage,
  register_kl,
  register_off_policy,
  register_policy_loss,
)

# Importing these modules registers their functions.
from aepo_jax.objectives._clipped_losses import (
  aepo_loss,
  clipped_token_loss,
  dapo_loss,
  entropy_advantage_factor,
  entropy_stats,
  gppo_loss,
  ppo_loss,
)
from aepo_jax.objectives._pg_losses import cispo_loss, gspo_loss, reinforce_loss
from aepo_jax.objectives._advantages import (
  ATTRIBUTIONS,
  discounted_returns,
  grpo_advantage,
  group_stats,
  hard_attribution,
  outcome_token_rewards,
  reinforce_pp_advantage,
  reinforce_pp_baseline_advantage,
  rloo_advantage,
  shared_prefix_owner,
)
from aepo_jax.objectives._kl import k1, k2, k3, kl_abs, kl_loss, kl_reward_penalty
from aepo_jax.objectives._dapo import dynamic_sampling_keep, overlong_reward_penalty
from aepo_jax.objectives._logits import HeadSharding, entropy_from_logits, token_logprobs_and_entropy
from aepo_jax.objectives._off_policy import apply_off_policy, check_off_policy, decoupled_weights, truncated_weights

__all__ = [
  "apply_off_policy",
  "check_off_policy",
  "decoupled_weights",
  "truncated_weights",
  "off_policy",
  "list_off_policy",
  "register_off_policy",
  "AGG_MODES",
  "aggregate",
  "dynamic_bsz_scale",
  "loss_normalizer",
  "masked_mean",
  "masked_var",
  "masked_whiten",
  "num_sequences",
  "advantage",
  "advantage_defaults",
  "kl",
  "list_advantages",
  "list_kl_estimators",
  "list_policy_losses",
  "policy_loss",
  "policy_loss_defaults",
  "register_advantage",
  "register_kl",
  "register_policy_loss",
  "aepo_loss",
  "clipped_token_loss",
  "dapo_loss",
  "entropy_advantage_factor",
  "entropy_stats",
  "gppo_loss",
  "ppo_loss",
  "cispo_loss",
  "gspo_loss",
  "reinforce_loss",
  "ATTRIBUTIONS",
  "hard_attribution",
  "shared_prefix_owner",
  "discounted_returns",
  "grpo_advantage",
  "group_stats",
  "outcome_token_rewards",
  "reinforce_pp_advantage",
  "reinforce_pp_baseline_advantage",
  "rloo_advantage",
  "k1",
  "k2",
  "k3",
  "kl_abs",
  "kl_loss",
  "kl_reward_penalty",
  "dynamic_sampling_keep",
  "overlong_reward_penalty",
  "entropy_from_logits",
  "token_logprobs_and_entropy",
  "HeadSharding",
]
