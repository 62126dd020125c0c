"""Outcome-reward advantage estimators: GRPO (and Dr.GRPO), RLOO, REINFORCE++ and its baseline form.

Each is `fn(rewards_b, group_ids_b, mask_bt, **hp) -> advantages_bt`, zero where the mask is zero.
`group_ids_b` are integers, equal for all n trajectories of one prompt (ARPO/AEPO branches included,
spec §1.4). Groups are found with a [B, B] same-id matrix, so any integer ids work under jit and vmap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aepo_jax.objectives._aggregate import as_mask, masked_whiten
from aepo_jax.objectives._registry import register_advantage


def _check(name, rewards, group_ids, mask):
  r, g, m = jnp.asarray(rewards), jnp.asarray(group_ids), jnp.asarray(mask)
  if r.ndim != 1:
    raise ValueError(f"{name}: rewards must be one scalar per sequence, shape [B]; got {r.shape}")
  if g.shape != r.shape:
    raise ValueError(f"{name}: group_ids shape {g.shape} must equal rewards shape {r.shape}")
  if m.ndim != 2 or m.shape[0] != r.shape[0]:
    raise ValueError(f"{name}: mask must be [B, T] with B = {r.shape[0]}; got {m.shape}")
  if not jnp.issubdtype(g.dtype, jnp.integer):
    raise ValueError(f"{name}: group_ids must be integers (one id per prompt); got dtype {g.dtype}")
  return r.astype(jnp.float32), g, as_mask(m)


def group_stats(rewards_b, group_ids_b):
  """Per sequence: its group's size, mean, unbiased std and whether all rewards in it are equal."""
  same_bb = (group_ids_b[:, None] == group_ids_b[None, :]).astype(jnp.float32)
  count_b = jnp.sum(same_bb, axis=1)
  # Elementwise sums, not a matmul: TPU matmuls default to bf16 passes.
  mean_b = jnp.sum(same_bb * rewards_b[None, :], axis=1) / count_b
  # Two-pass variance: sum over the group of (r_j − mean_i)², exact for equal rewards.
  sq_b = jnp.sum(same_bb * jnp.square(rewards_b[None, :] - mean_b[:, None]), axis=1)
  std_b = jnp.sqrt(sq_b / jnp.maximum(count_b - 1.0, 1.0))
  masked_hi = jnp.where(same_bb > 0, rewards_b[None, :], -jnp.inf)
  masked_lo = jnp.where(same_bb > 0, rewards_b[None, :], jnp.inf)
  all_equal_b = jnp.max(masked_hi, axis=1) == jnp.min(masked_lo, axis=1)
  return count_b, mean_b, std_b, all_equal_b


@register_advantage("grpo")
def grpo_advantage(rewards, group_ids, mask, *, epsilon=1e-6, norm_by_std=True):
  """GRPO (spec §3.1, verl `compute_grpo_outcome_advantage`): Â = (R − mean_g)/(std_g + ε).

  Unbiased std; a singleton group uses mean 0 and std 1; `norm_by_std=False` is Dr.GRPO (R − mean_g).
  A group whose rewards are all equal gets exactly 0 (verl can leave a rounding residue / ε there).
  """
  r, g, m = _check("grpo", rewards, group_ids, mask)
  count, mean, std, all_equal = group_stats(r, g)
  singleton = count == 1
  mean = jnp.where(singleton, 0.0, mean)
  std = jnp.where(singleton, 1.0, std)
  centered = jnp.where(all_equal & ~singleton, 0.0, r - mean)
  adv_b = centered / (std + epsilon) if norm_by_std else centered
  return adv_b[:, None] * m


@register_advantage("rloo")
def rloo_advantage(rewards, group_ids, mask):
  """RLOO (verl `compute_rloo_outcome_advantage`): R_i − mean of the other n−1 rewards of the group.

  Equals (R_i − mean_g)·n/(n−1). A singleton group keeps its raw reward, as in verl.
  """
  r, g, m = _check("rloo", rewards, group_ids, mask)
  count, mean, _, all_equal = group_stats(r, g)
  centered = jnp.where(all_equal, 0.0, r - mean)
  adv_b = jnp.where(count > 1, centered * count / jnp.maximum(count - 1.0, 1.0), r)
  return adv_b[:, None] * m


def outcome_token_rewards(rewards_b, mask_bt):
  """[B, T] rewards with R at the last valid token of each row (verl's naive reward manager)."""
  t = mask_bt.shape[-1]
  last_b = t - 1 - jnp.argmax(mask_bt[:, ::-1] > 0, axis=-1)
  has_b = jnp.any(mask_bt > 0, axis=-1)
  onehot_bt = (jnp.arange(t)[None, :] == last_b[:, None]) & has_b[:, None]
  return jnp.where(onehot_bt, rewards_b[:, None], 0.0)


def discounted_returns(token_rewards_bt, mask_bt, gamma=1.0, reset_at_mask=True):
  """G_t = r_t + γ·G_{t+1}, with the running return zeroed after every masked position (verl).

  verl's loop: running = r_t + γ·running; G_t = running; running *= m_t. So a tool-result hole cuts the
  return: tokens before the hole do not see rewards after it (spec §3.4). `reset_at_mask=False` lets
  the return flow through holes instead.
  """

  def step(running_b, xs):
    r_b, m_b = xs
    running_b = r_b + gamma * running_b
    ret_b = running_b
    if reset_at_mask:
      running_b = running_b * m_b
    return running_b, ret_b

  init_b = jnp.zeros(token_rewards_bt.shape[:1], jnp.float32)
  _, returns_tb = jax.lax.scan(step, init_b, (token_rewards_bt.T, mask_bt.T), reverse=True)
  return returns_tb.T


@register_advantage("reinforce_pp")
def reinforce_pp_advantage(rewards, group_ids, mask, *, gamma=1.0, token_rewards=None, reset_at_mask=True):
  """REINFORCE++ (spec §3.4, verl `compute_reinforce_plus_plus_outcome_advantage`).

  Token rewards = R at the last valid token (+ `token_rewards`, e.g. −β·KL from `kl_reward_penalty`),
  discounted return-to-go with a reset at masked positions, then whitening over all valid tokens of the
  batch (unbiased var, +1e-8). `group_ids` is unused: REINFORCE++ has no group baseline.
  """
  r, _, m = _check("reinforce_pp", rewards, group_ids, mask)
  token_r = outcome_token_rewards(r, m)
  if token_rewards is not None:
    if jnp.shape(token_rewards) != m.shape:
      raise ValueError(f"reinforce_pp: token_rewards shape {jnp.shape(token_rewards)} must be {m.shape}")
    token_r = token_r + jnp.where(m > 0, jnp.asarray(token_rewards, jnp.float32), 0.0)
  returns = discounted_returns(token_r, m, gamma, reset_at_mask)
  return masked_whiten(returns, m) * m


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline_advantage(rewards, group_ids, mask):
  """REINFORCE++-baseline (verl): (R − group mean; singleton mean 0) on every token, then whitened."""
  r, g, m = _check("reinforce_pp_baseline", rewards, group_ids, mask)
  count, mean, _, all_equal = group_stats(r, g)
  centered_b = jnp.where(count == 1, r, jnp.where(all_equal, 0.0, r - mean))
  return masked_whiten(centered_b[:, None] * m, m) * m


# ---------------------------------------------------------------------------------------------------------
# Credit for prefixes shared by branches (spec §1.4).

ATTRIBUTIONS = ("soft", "hard")


def shared_prefix_owner(parent_b, fork_pos_b, seq_len: int):
  """owner_bt: the row whose token t row b holds, following the branching tree.

  A child row b forked from parent_b[b] copies the parent's tokens before fork_pos_b[b] (positions in the row,
  prompt included; -1 for a root). Token t of row b belongs to its parent's token t when t < fork_pos_b[b], and
  so on up the tree; rows with equal owner at t hold the same token (same context, same sample).
  """
  parent_b = jnp.asarray(parent_b, jnp.int32)
  fork_b = jnp.asarray(fork_pos_b, jnp.int32)
  b = parent_b.shape[0]
  t_bt = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32)[None, :], (b, seq_len))
  owner0 = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, seq_len))

  def up(owner_bt):
    return jnp.where((parent_b[owner_bt] >= 0) & (t_bt < fork_b[owner_bt]), parent_b[owner_bt], owner_bt)

  def cond(state):
    prev, cur = state
    return jnp.any(prev != cur)

  # One step per tree level (a parent row always precedes its children, so this ends within depth steps).
  _, owner = jax.lax.while_loop(cond, lambda s: (s[1], up(s[1])), (owner0, up(owner0)))
  return owner


def hard_attribution(advantages_bt, mask_bt, parent_b, fork_pos_b):
  """ARPO's hard advantage attribution (spec §1.4): every token shared by d trajectories gets the mean of their
  d advantages; a trajectory's own tokens keep its own.

  `advantages_bt` is the soft assignment (any estimator's per-token advantages, e.g. GRPO's Â_i on every token
  of row i). The sum over the copies of a shared token is unchanged (d·Â_shared in both), so the unclipped
  surrogate's gradient is the same; with clipping each copy is clipped at the mean instead of its own value.
  Zero where the mask is zero.
  """
  adv = jnp.asarray(advantages_bt, jnp.float32)
  m = as_mask(jnp.asarray(mask_bt))
  if adv.ndim != 2 or adv.shape != m.shape:
    raise ValueError(f"hard_attribution: advantages {adv.shape} and mask {m.shape} must both be [B, T]")
  b, t = adv.shape
  if jnp.shape(parent_b) != (b,) or jnp.shape(fork_pos_b) != (b,):
    raise ValueError(
      f"hard_attribution: parent_b {jnp.shape(parent_b)} and fork_pos_b {jnp.shape(fork_pos_b)} "
      f"must be [B] with B = {b} (Trajectories.parent_b / fork_pos_b)"
    )
  owner_bt = shared_prefix_owner(parent_b, fork_pos_b, t)
  key = (owner_bt * t + jnp.arange(t, dtype=jnp.int32)[None, :]).reshape(-1)
  valid = (m > 0).reshape(-1).astype(jnp.float32)
  total = jax.ops.segment_sum(adv.reshape(-1) * valid, key, num_segments=b * t)
  count = jax.ops.segment_sum(valid, key, num_segments=b * t)
  mean = (total / jnp.maximum(count, 1.0))[key].reshape(b, t)
  return mean * m
