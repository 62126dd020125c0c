"""DAPO extras (spec §3.2): the dynamic-sampling group filter and overlong reward shaping."""

from __future__ import annotations

import jax.numpy as jnp


def dynamic_sampling_keep(metric_b, group_ids_b):
  """bool[B]: keep sequences whose group has differing metric values, or is a singleton.

  verl `filter_groups`: a group whose metric (accuracy by default) has std 0 gives zero GRPO advantage
  and is dropped; the trainer keeps generating until the batch is full (max_num_gen_batches = 10).
  """
  metric_b = jnp.asarray(metric_b, jnp.float32)
  group_ids_b = jnp.asarray(group_ids_b)
  if metric_b.ndim != 1 or group_ids_b.shape != metric_b.shape:
    raise ValueError(
      f"dynamic_sampling_keep: metric {metric_b.shape} and group_ids {group_ids_b.shape} must both be [B]"
    )
  same_bb = group_ids_b[:, None] == group_ids_b[None, :]
  hi_b = jnp.max(jnp.where(same_bb, metric_b[None, :], -jnp.inf), axis=1)
  lo_b = jnp.min(jnp.where(same_bb, metric_b[None, :], jnp.inf), axis=1)
  singleton_b = jnp.sum(same_bb, axis=1) == 1
  return (hi_b > lo_b) | singleton_b


def overlong_reward_penalty(response_length_b, *, max_response_length, buffer_length, penalty_factor=1.0):
  """Soft overlong punishment added to the reward (DAPO eq. 13; verl recipe `overlong_buffer`).

  0 while |y| ≤ L_max − L_buf, then linear down to −factor at |y| = L_max:
  min(−(|y| − (L_max − L_buf))/L_buf · factor, 0). Clamped at −factor beyond L_max, the paper's −1
  (verl cannot see longer responses, so the two agree on every length it produces).
  """
  if buffer_length <= 0 or buffer_length > max_response_length:
    raise ValueError(
      f"overlong_reward_penalty: buffer_length={buffer_length} must lie in "
      f"(0, max_response_length={max_response_length}]"
    )
  length = jnp.asarray(response_length_b, jnp.float32)
  exceed = length - (max_response_length - buffer_length)
  penalty = jnp.minimum(-exceed / buffer_length * penalty_factor, 0.0)
  return jnp.maximum(penalty, -penalty_factor)
