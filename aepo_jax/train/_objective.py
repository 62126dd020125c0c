"""The RL objective as a training config sets it up: the reward of a rollout, the advantages, the loss and
off-policy hyperparameters, the update step (what the trainer runs and launch/compile.py compiles), and a
rollout's metrics."""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("aepo_jax.train")


def make_reward(config):
  """fn(traj, prompts) -> rewards [N]: the configured reward on each decoded response (spec §1.6).

  Each response is scored in a `rewards.shared_pool()` worker within `reward.timeout_s`: a response that takes longer, or crashes its worker, scores 0 and the step goes on.
  """
  from aepo_jax import rewards as rewards_lib

  score = getattr(rewards_lib, config.reward.name)
  timeout_s = config.reward.timeout_s

  def reward(traj, prompts):
    answers = [prompts[g].answers for g in np.asarray(traj.group_id_b)]
    results = rewards_lib.shared_pool().map_results(score, list(zip(traj.response_text, answers)), timeout_s=timeout_s)
    failed = [res for res in results if res.status != "ok"]
    if failed:
      log.warning(
        "reward: %d of %d responses scored 0 (%s: %s)", len(failed), len(results), failed[0].status, failed[0].error
      )
    r = np.asarray([res.value if res.status == "ok" else 0.0 for res in results], np.float32)
    if config.algo.overlong_buffer:  # DAPO overlong shaping (spec §3.2)
      from aepo_jax import objectives

      r = r + np.asarray(
        objectives.overlong_reward_penalty(
          np.asarray(traj.response_len_b),
          max_response_length=config.rollout.max_response_len,
          buffer_length=config.algo.overlong_buffer,
          penalty_factor=config.algo.overlong_factor,
        )
      )
    return r

  return reward


def advantage_fn(config):
  """fn(rewards_b, group_ids_b, mask_bt, token_rewards_bt=None, *, tree=None) -> advantages_bt.

  token_rewards_bt (the KL-in-reward penalty, verl `apply_kl_penalty`): estimators with token-level returns
  (reinforce_pp) take it per token; outcome estimators (grpo, rloo, ...) see the sequence score
  R + sum_t token_rewards_t, as verl's GRPO sums `token_level_rewards`.
  tree: (traj.parent_b, traj.fork_pos_b), needed by algo.attribution='hard' (spec §1.4), which gives every token
  shared by branches the mean advantage of the trajectories sharing it.
  """
  from aepo_jax import objectives

  name = config.algo.advantage
  fn = objectives.advantage(name)
  defaults = objectives.advantage_defaults(name)
  hp = {"norm_by_std": config.algo.norm_by_std} if "norm_by_std" in defaults else {}

  def soft(rewards_b, group_ids_b, mask_bt, token_rewards_bt=None):
    if token_rewards_bt is None:
      return fn(rewards_b, group_ids_b, mask_bt, **hp)
    if "token_rewards" in defaults:
      return fn(rewards_b, group_ids_b, mask_bt, token_rewards=token_rewards_bt, **hp)
    seq_b = np.asarray(rewards_b, np.float32) + np.sum(np.asarray(token_rewards_bt) * (np.asarray(mask_bt) > 0), 1)
    return fn(seq_b, group_ids_b, mask_bt, **hp)

  def adv(rewards_b, group_ids_b, mask_bt, token_rewards_bt=None, *, tree=None):
    out = soft(rewards_b, group_ids_b, mask_bt, token_rewards_bt)
    if config.algo.attribution == "soft":
      return out
    if tree is None:
      raise ValueError(
        "algo.attribution='hard' needs the branching tree: call the advantage function with "
        "tree=(traj.parent_b, traj.fork_pos_b), or set algo.attribution='soft'."
      )
    return objectives.hard_attribution(out, mask_bt, *tree)

  return adv


def correct_b(traj, prompts) -> np.ndarray:
  """float[N]: 1 where the trajectory's answer is correct (`rewards.eval_correct`), for DAPO's 'acc' filter.

  Each answer is checked in a `rewards.shared_pool()` worker within the pool's timeout; one over it counts as wrong.
  """
  from aepo_jax import rewards as rewards_lib

  items = [
    (text, prompts[int(g)].answers, prompts[int(g)].family)
    for text, g in zip(traj.response_text, np.asarray(traj.group_id_b))
  ]
  ok = rewards_lib.shared_pool().map(rewards_lib.eval_correct, items, default=False)
  return np.asarray([float(bool(v)) for v in ok], np.float32)


def make_rl_update_step(config, model_cfg, optimizer, mesh):
  """The RL update step as `config` sets it up (loss, KL, entropy, aggregation, logits): what the trainer runs and
  launch/compile.py compiles for a slice."""
  from aepo_jax.train import _config, _logprob, _step

  t, r, a = config.train, config.rollout, config.algo
  seq_len = r.max_prompt_len + r.max_response_len
  return _step.make_update_step(
    model_cfg,
    loss_fn=a.loss,
    loss_hp=loss_hparams(config),
    optimizer=optimizer,
    micro_batches=t.ppo_mini_batch_size * r.n // t.micro_batch_size,
    mesh=mesh,
    rules=_config.mesh_rules(config),
    temperature=r.temperature,
    kl_name=a.kl.name,
    kl_coef=0.0 if a.kl.use_in_reward else a.kl.coef,
    need_entropy=a.loss == "aepo" and a.entropy_advantage_coef > 0,
    logit_capacity=_logprob.logit_capacity(t.logit_fraction, t.micro_batch_size, seq_len),
    saved_logits_mb=t.saved_logits_mb,
    aggregation=a.aggregation,
    off_policy=a.off_policy,
    off_policy_hp=off_policy_hparams(config),
  )


def verl_max_token_len(config) -> int:
  """algo.verl_max_token_len, 0 resolved as the released scripts set ppo_max_token_len_per_gpu: 2 x (prompt +
  response length)."""
  r = config.rollout
  return int(config.algo.verl_max_token_len) or 2 * (r.max_prompt_len + r.max_response_len)


def verl_layout(config, traj, seq_len: int):
  """verl's dynamic micro-batches for this step's (global) trajectories (`_verl_batching`), or None when
  algo.verl_dynamic_bsz is off."""
  from aepo_jax.train import _verl_batching

  a = config.algo
  if not a.verl_dynamic_bsz:
    return None
  return _verl_batching.verl_dynamic_layout(
    np.asarray(traj.attention_mask_bt).sum(-1),
    np.asarray(traj.loss_mask_bt).sum(-1),
    rows_per_update=config.train.ppo_mini_batch_size * config.rollout.n,
    world_size=a.verl_world_size,
    max_token_len=verl_max_token_len(config),
    agg=a.agg,
    seq_len=seq_len,
  )


def update_batch_keys(config) -> list:
  """The arrays the RL update step reads from its batch (besides the ones every step has)."""
  a = config.algo
  keys = ["tokens", "attention_mask", "loss_mask", "old_log_prob", "advantages"]
  if a.kl.coef > 0 and not a.kl.use_in_reward:
    keys.append("ref_log_prob")
  if a.off_policy != "none":
    keys.append("sampler_log_prob")
  if a.verl_dynamic_bsz:
    keys.append("loss_denominator")
  if a.routing_replay == "rollout":
    keys.append("routes")
  return keys


def off_policy_hparams(config) -> dict:
  """algo.off_policy_cap -> the correction's keyword hyperparameters (0: its own default cap)."""
  from aepo_jax import objectives

  a = config.algo
  if a.off_policy == "none":
    return {}
  cap = float(a.off_policy_cap) or objectives.off_policy(a.off_policy).__kwdefaults__["cap"]
  return {"cap": cap}


def loss_hparams(config) -> dict:
  """algo.* -> the keyword hyperparameters the configured loss accepts (spec §1.5, §2.2, §3)."""
  from aepo_jax import objectives

  a = config.algo
  accepted = objectives.policy_loss_defaults(a.loss)
  candidates = {
    "clip_low": a.clip_low,
    "clip_high": a.clip_high,
    "clip_c": a.clip_c or None,
    "agg": a.agg,
    "entropy_advantage_coef": a.entropy_advantage_coef,
    "preserve_high_clip_grad": a.preserve_high_clip_grad,
  }
  return {k: v for k, v in candidates.items() if k in accepted}


def rollout_metrics(traj, rewards_b, adv_bt) -> dict:
  mask = np.asarray(traj.loss_mask_bt) > 0
  out = {
    "reward/mean": float(np.mean(rewards_b)),
    "reward/std": float(np.std(rewards_b)),
    "reward/format_errors": float(np.mean(rewards_b < 0)),
    "rollout/response_len_mean": float(np.mean(traj.response_len_b)),
    "rollout/tool_calls_mean": float(np.mean(traj.num_tool_calls_b)),
    "rollout/trajectories": float(len(rewards_b)),
    "actor/advantage_mean": float(np.mean(np.asarray(adv_bt)[mask])) if mask.any() else 0.0,
    "rollout/sampler_entropy_mean": float(np.mean(np.asarray(traj.sampler_entropy_bt)[mask])) if mask.any() else 0.0,
  }
  out.update({k if "/" in k else f"rollout/{k}": float(v) for k, v in dict(traj.stats).items()})
  return out


def rollout_histograms(traj, adv_bt) -> dict:
  mask = np.asarray(traj.loss_mask_bt) > 0
  return {
    "actor/entropy": np.asarray(traj.sampler_entropy_bt)[mask],
    "actor/advantage": np.asarray(adv_bt)[mask],
    "rollout/response_len": np.asarray(traj.response_len_b),
    "rollout/tool_calls": np.asarray(traj.num_tool_calls_b),
  }
