"""Entropy statistics and branching rules of ARPO / AEPO as pure jitted functions (spec §1.2 2.2, 2.6; §2.1).

Everything here runs on device: the window statistic of a segment, ΔH, the branch draws and the per-prompt
budget accounting of one branching round, and the assignment of the children to free engine slots. The host only
builds the small input arrays (candidates in creation order) and does the tree bookkeeping with the result.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

ESTIMATORS = ("exact", "official")
RULES = ("arpo", "aepo")


def window_statistic(
  seg_count_s, seg_entropy_sum_s, seg_topk_entropy_sum_s, *, estimator: str, window: int, vocab_size: int
):
  """Step entropy of a segment from the engine's accumulators (sums over its first `window` tokens).

  exact:    mean full-vocabulary entropy over the first min(window, count) tokens (paper §1.3: "token entropy").
  official: top-k truncated entropy SUMMED over the same tokens, divided by ln|V| (ARPO code, spec §1.2 2.2).
  """
  if estimator == "exact":
    n_s = jnp.clip(seg_count_s, 1, window).astype(jnp.float32)
    return jnp.where(seg_count_s > 0, seg_entropy_sum_s / n_s, 0.0)
  if estimator == "official":
    return seg_topk_entropy_sum_s / math.log(vocab_size)
  raise ValueError(f"entropy estimator {estimator!r}: choose one of {ESTIMATORS}.")


def branch_probability(rule: str, delta_h, *, weight: float, threshold: float, penalty=1.0):
  """Closed form of the branch probability of one attempt (for tests and logging).

  arpo: P = clip(τ + w·ΔH, 0, 1)                         (branch iff clip(u − w·ΔH, 0, 1) ≤ τ, spec §1.2 2.6)
  aepo: P = clip(1 − τ/f + w·ΔH, 0, 1), 0 when f = 0
        (branch iff clip((u + w·ΔH)·f, 0, 1) ≥ τ, spec §2.1)
  Valid for 0 < τ ≤ 1 (AEPO) / 0 ≤ τ < 1 (ARPO).
  """
  delta_h = jnp.asarray(delta_h, jnp.float32)
  if rule == "arpo":
    return jnp.clip(threshold + weight * delta_h, 0.0, 1.0)
  if rule == "aepo":
    f = jnp.asarray(penalty, jnp.float32)
    safe_f = jnp.where(f > 0, f, 1.0)
    return jnp.where(f > 0, jnp.clip(1.0 - threshold / safe_f + weight * delta_h, 0.0, 1.0), 0.0)
  raise ValueError(f"branch rule {rule!r}: choose one of {RULES}.")


def _attempt_succeeds(rule, u_cz, delta_h_c, penalty_c, weight, threshold):
  """The official comparisons, draw by draw (so clipping edge cases match the released code exactly)."""
  if rule == "arpo":
    return jnp.clip(u_cz - weight * delta_h_c[:, None], 0.0, 1.0) <= threshold
  return jnp.clip((u_cz + weight * delta_h_c[:, None]) * penalty_c[:, None], 0.0, 1.0) >= threshold


@functools.partial(jax.jit, static_argnames=("rule", "beam_size", "num_prompts", "estimator", "window", "vocab_size"))
def decide_branches(
  key,
  stat_c,
  initial_c,
  valid_c,
  prompt_c,
  resident_c,
  remaining_p,
  consecutive_p,
  free_slots_f,
  num_free,
  *,
  rule: str,
  beam_size: int,
  num_prompts: int,
  weight: float,
  threshold: float,
  penalty_slope: float,
  estimator: Optional[str] = None,
  window: int = 20,
  vocab_size: int = 2,
):
  """One branching round (spec §1.2 2.6 with the AEPO rule of §2.1), for C candidates in creation order.

  Args:
    key: PRNG key of this round. stat_c / initial_c: step entropy now and the initial entropy ([C] float32); with
      `estimator`, the segments' accumulators instead ([C, 3]: count, entropy sum, top-k entropy sum), from which
      the window statistic (`window_statistic`) is computed inside this one compiled function.
    valid_c: real candidate (padding False). prompt_c: prompt index. resident_c: the candidate's state is still
      in an engine slot (a child can then be forked on device).
    remaining_p: n − rollouts so far, per prompt. consecutive_p: AEPO's consecutive-branch counter l.
    free_slots_f: free engine slot ids (padded), num_free: how many are real.
  Each candidate gets min(Z−1, remaining − created) attempts, counted when the candidate is visited, so a
  prompt never exceeds its budget. Returns a dict: children_c [C], prob_c [C] (closed-form probability),
  attempts_c [C], delta_h_c [C], child_src_k [K] (candidate index of child k, −1 = none; K = C·(Z−1),
  candidate-major order) and child_dst_k [K] (free slot for an on-device fork, −1 = re-prefill on the host).
  """
  if estimator is not None:
    stat_c, initial_c = (
      window_statistic(
        a[:, 0].astype(jnp.int32), a[:, 1], a[:, 2], estimator=estimator, window=window, vocab_size=vocab_size
      )
      for a in (stat_c, initial_c)
    )
  c_size = stat_c.shape[0]
  z1 = beam_size - 1
  delta_h_c = (stat_c - initial_c).astype(jnp.float32)
  penalty_c = jnp.maximum(0.0, 1.0 - penalty_slope * consecutive_p[prompt_c].astype(jnp.float32))
  if rule == "arpo":
    penalty_c = jnp.ones_like(penalty_c)
  u_cz = jax.random.uniform(key, (c_size, z1))
  success_cz = _attempt_succeeds(rule, u_cz, delta_h_c, penalty_c, weight, threshold)

  def visit(created_p, c):
    p = prompt_c[c]
    attempts = jnp.clip(jnp.minimum(z1, remaining_p[p] - created_p[p]), 0, z1)
    attempts = jnp.where(valid_c[c], attempts, 0).astype(jnp.int32)
    kids = jnp.sum(success_cz[c] & (jnp.arange(z1) < attempts)).astype(jnp.int32)
    return created_p.at[p].add(kids), (kids, attempts)

  _, (children_c, attempts_c) = jax.lax.scan(visit, jnp.zeros((num_prompts,), jnp.int32), jnp.arange(c_size))

  is_child_cz = jnp.arange(z1)[None, :] < children_c[:, None]
  is_child_k = is_child_cz.reshape(-1)
  src_k = jnp.repeat(jnp.arange(c_size), z1)
  (order_k,) = jnp.nonzero(is_child_k, size=c_size * z1, fill_value=-1)
  child_src_k = jnp.where(order_k >= 0, src_k[jnp.maximum(order_k, 0)], -1)
  on_device_k = (child_src_k >= 0) & resident_c[jnp.maximum(child_src_k, 0)]
  rank_k = jnp.cumsum(on_device_k) - 1
  slot_ok_k = on_device_k & (rank_k < num_free)
  child_dst_k = jnp.where(slot_ok_k, free_slots_f[jnp.clip(rank_k, 0, free_slots_f.shape[0] - 1)], -1)
  prob_c = branch_probability(rule, delta_h_c, weight=weight, threshold=threshold, penalty=penalty_c)
  return {
    "children_c": children_c,
    "attempts_c": attempts_c,
    "prob_c": jnp.where(valid_c, prob_c, 0.0),
    "delta_h_c": delta_h_c,
    "child_src_k": child_src_k,
    "child_dst_k": child_dst_k,
  }


PREMONITOR_FORMULAS = ("code", "paper")


@functools.partial(jax.jit, static_argnames=("n", "formula"))
def premonitor_split(h_root_p, h_tool_p, *, n: int, beta: float, formula: str = "code"):
  """AEPO entropy pre-monitoring (spec §2.1): the global samples m of the budget n per prompt.

  'code' (the released code): m = clamp(int(n·σ(β·(H_root − H̄_tool))) + 1, 1, n) (floor + 1).
  'paper': m = n·σ(β·(H_root − H̄_tool)), rounded half up to a whole sample, clamped to [1, n] (the paper leaves the
  rounding open; at ΔH = 0 it gives round(n/2), the code int(n/2) + 1)."""
  share_p = jax.nn.sigmoid(beta * (h_root_p - h_tool_p))
  if formula == "code":
    m = jnp.floor(n * share_p) + 1
  elif formula == "paper":
    m = jnp.floor(n * share_p + 0.5)
  else:
    raise ValueError(f"premonitor_split: formula={formula!r}; use one of {PREMONITOR_FORMULAS}.")
  return jnp.clip(m.astype(jnp.int32), 1, n)
