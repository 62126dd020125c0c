"""What a rollout policy decides at the end of each round: branches (who, how many, where), refills, counters.

The agent loop (aepo_jax/rollout/_agent.py) runs rounds (spec §1.2 step 2: every active trajectory generates to
its next stop and its tool returns) and calls `plan_round` when one closes. The policy looks at the host
records, builds small candidate arrays in creation order and makes the decision in one jitted call
(`decide_branches` from the segment accumulators: the window statistics and the decision in one compiled
function); the agent then forks (engine.copy_slots + truncate) and queues refills.

Quirk modes (spec §1.2 Q1 and "branch timing", §5.5):
  faithful:  initial entropy from a table keyed by the within-call copy index that is never cleared (it
             persists across rollout calls on this policy object, like the official instance attribute); the
             decision for tool call k uses the segment that ENDED with call k (one-call lag); a child is a copy
             of the state right after result k.
  corrected: initial entropy = the entropy of the trajectory's first segment (a branch inherits its parent's);
             the decision for call k uses the first `entropy_window` tokens generated AFTER result k, so it is
             made one round later, and the child is forked at the position right after result k (copy_slots +
             truncate). A prompt with a decision still pending (a tool result this round) counts as having a
             candidate for the refill rule, so the budget is not spent on refills before its branches are decided.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from aepo_jax.rollout.policies._entropy import ESTIMATORS, PREMONITOR_FORMULAS, decide_branches

MODES = ("corrected", "faithful")


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  """Rollout-policy hyperparameters, with the same defaults as `aepo_jax.train.base_config()`'s rollout.* keys.

  Constants marked "official" are those of the released ARPO/AEPO code and scripts (spec §1.7, §2.1, §2.4: the
  14B deep-search scripts for n and N0). Two defaults deliberately differ from the code: `estimator='exact'`
  (the paper's full-vocabulary token entropy; the code's top-10 sum is 'official') and `mode='corrected'` (the
  code's quirks Q1 and the one-call lag fixed; 'faithful' reproduces them). The `:released` presets in
  configs/ set both to the code's values.
  """

  n: int = 12  # rollout.n: trajectories per prompt (the group); official (14B scripts)
  initial_rollouts: int = 6  # N0 global samples (ARPO; AEPO when dynamic rollouts are off); official
  beam_size: int = 2  # Z: Z-1 attempts per candidate; official
  entropy_weight: float = 0.2  # w; official (scripts; the code's own default is 0.5)
  branch_threshold: float = 0.5  # τ; official
  entropy_window: int = 20  # tokens per segment that enter the step entropy; official (hard-coded)
  estimator: str = "exact"  # 'exact' (paper) | 'official' (top-10 summed / ln|V|, the code)
  mode: str = "corrected"  # 'corrected' (ours) | 'faithful' (the code's quirks)
  penalty_slope: float = 0.05  # AEPO: f = max(0, 1 - slope * l); official (hard-coded)
  penalty_counts_refills: bool = True  # AEPO code: refills also advance the consecutive-branch counter
  enable_dynamic_rollouts: bool = True  # AEPO pre-monitoring: paper; the released scripts set False (spec §2.6)
  premonitor_beta: float = 0.5  # β of the pre-monitoring sigmoid; official (hard-coded)
  premonitor_formula: str = "code"  # 'code': int(n·σ) + 1 (official); 'paper': n·σ rounded (spec §2.1)
  probe_tokens: int = 50  # max tokens of the H_root sample; official

  def __post_init__(self):
    def bad(key, why):
      raise ValueError(f"PolicyConfig.{key}={getattr(self, key)!r}: {why}")

    if self.n < 1:
      bad("n", "needs at least one trajectory per prompt.")
    if self.initial_rollouts < 1:
      bad("initial_rollouts", "must be >= 1 (global samples per prompt).")
    if self.beam_size < 1:
      bad("beam_size", "must be >= 1 (Z; 2 gives one branch attempt per candidate).")
    if self.entropy_window < 1:
      bad("entropy_window", "must be >= 1 token.")
    if self.estimator not in ESTIMATORS:
      bad("estimator", f"choose one of {ESTIMATORS}.")
    if self.mode not in MODES:
      bad("mode", f"choose one of {MODES}.")
    if not 0.0 <= self.branch_threshold <= 1.0:
      bad("branch_threshold", "τ must be in [0, 1].")
    if self.probe_tokens < 1:
      bad("probe_tokens", "must be >= 1.")
    if self.premonitor_formula not in PREMONITOR_FORMULAS:
      bad("premonitor_formula", f"choose one of {PREMONITOR_FORMULAS}.")


@dataclasses.dataclass
class RoundPlan:
  """children: (parent record, response offset to fork at, engine slot or -1 = re-prefill) in creation order.
  refills: prompt ids that get one fresh sample. decisions: per-candidate arrays for statistics."""

  children: list
  refills: list
  decisions: dict


def _bucket(n: int) -> int:
  return max(8, 1 << max(0, n - 1).bit_length())


class RolloutPolicy:
  """Base: i.i.d. sampling (no branching, no refills). Subclasses set `rule` and the initial split."""

  name = "none"
  rule: Optional[str] = None

  def __init__(self, config: PolicyConfig = PolicyConfig(), **overrides):
    self.config = dataclasses.replace(config, **overrides) if overrides else config
    self._initial_table: dict = {}  # faithful mode (Q1): copy index -> accumulators, never cleared
    self.consecutive_p = np.zeros((0,), np.int32)

  # -------------------------------------------------------------------------------------- budget split
  def needs_probe(self) -> bool:
    return False

  def initial_counts(self, num_prompts: int, probe=None) -> np.ndarray:
    """Global samples per prompt; `probe` (AEPO) returns (h_root_p, h_tool_p) when called."""
    return np.full((num_prompts,), self.config.n, np.int32)

  def begin(self, num_prompts: int) -> None:
    """Start of a rollout call: AEPO's counters are reset (spec §2.1); the faithful table is not (Q1)."""
    self.consecutive_p = np.zeros((num_prompts,), np.int32)

  # -------------------------------------------------------------------------------------- round end
  def initial_accum(self, rec) -> Optional[tuple]:
    if self.config.mode == "faithful":
      return self._initial_table.get(rec.index)
    return rec.initial_accum

  def _observe_first_segments(self, records) -> None:
    if self.config.mode != "faithful":
      return
    for rec in records:
      if rec.segments and rec.segments[0].end >= 0 and rec.index not in self._initial_table:
        self._initial_table[rec.index] = rec.segments[0].accum

  def _candidates(self, records, rnd: int):
    """(record, current accumulators, fork offset) in creation order, and prompts with a pending decision."""

    def seg(rec, r):
      return next((s for s in rec.segments if s.round == r), None)

    def alive_after(rec, r):
      return rec.end_round < 0 or rec.end_round > r

    cands, pending = [], set()
    for rec in sorted(records, key=lambda r: r.index):
      cur = seg(rec, rnd)
      if self.config.mode == "faithful":
        if cur is not None and cur.end >= 0 and cur.result_end is not None and alive_after(rec, rnd):
          cands.append((rec, cur.accum, cur.result_end))
      else:
        prev = seg(rec, rnd - 1)
        if prev is not None and prev.result_end is not None and cur is not None and cur.end >= 0:
          cands.append((rec, cur.accum, prev.result_end))
        if cur is not None and cur.result_end is not None and alive_after(rec, rnd):
          pending.add(rec.prompt)
    return cands, pending

  def plan_round(self, records, rnd: int, counts_p: np.ndarray, free_slots, key, vocab_size: int) -> RoundPlan:
    """Branches and refills at the end of round `rnd` (spec §1.2 steps 2.5-2.8, §2.1)."""
    if self.rule is None:
      return RoundPlan([], [], {})
    cfg = self.config
    self._observe_first_segments(records)
    cands, pending = self._candidates(records, rnd)
    num_prompts = counts_p.shape[0]
    c = len(cands)
    children_p = np.zeros((num_prompts,), np.int32)
    children, decisions = [], {}
    if c and cfg.beam_size > 1:
      size = _bucket(c)
      cur = np.zeros((size, 3), np.float32)
      ini = np.zeros((size, 3), np.float32)
      valid = np.zeros((size,), bool)
      prompt = np.zeros((size,), np.int32)
      resident = np.zeros((size,), bool)
      for i, (rec, accum, _) in enumerate(cands):
        init = self.initial_accum(rec)
        cur[i], ini[i] = accum, (accum if init is None else init)
        valid[i], prompt[i] = True, rec.prompt
        resident[i] = rec.slot >= 0 and rec.device_len > 0  # the agent extends a child with what is on the host
      free = np.full((_bucket(max(len(free_slots), 1)),), -1, np.int32)
      free[: len(free_slots)] = free_slots
      out = jax.device_get(
        decide_branches(
          key,
          jnp.asarray(cur),
          jnp.asarray(ini),
          jnp.asarray(valid),
          jnp.asarray(prompt),
          jnp.asarray(resident),
          jnp.asarray(cfg.n - counts_p, jnp.int32),
          jnp.asarray(self.consecutive_p, jnp.int32),
          jnp.asarray(free),
          len(free_slots),
          estimator=cfg.estimator,
          window=cfg.entropy_window,
          vocab_size=vocab_size,
          rule=self.rule,
          beam_size=cfg.beam_size,
          num_prompts=num_prompts,
          weight=cfg.entropy_weight,
          threshold=cfg.branch_threshold,
          penalty_slope=cfg.penalty_slope,
        )
      )
      for src, dst in zip(out["child_src_k"], out["child_dst_k"]):
        if src < 0:
          break
        rec, _, fork_pos = cands[int(src)]
        children.append((rec, int(fork_pos), int(dst)))
        children_p[rec.prompt] += 1
      decisions = {
        "delta_h": out["delta_h_c"][:c],
        "prob": out["prob_c"][:c],
        "children": out["children_c"][:c],
        "attempts": out["attempts_c"][:c],
        "prompt": prompt[:c],
        "consecutive": self.consecutive_p[prompt[:c]].copy(),
      }
    has_cand = np.zeros((num_prompts,), bool)
    for rec, _, _ in cands:
      has_cand[rec.prompt] = True
    for p in pending:
      has_cand[p] = True
    # A prompt whose trajectories have all ended can get no later candidate (possible in corrected mode, where a
    # finished trajectory can still be a candidate): it is refilled like a prompt without candidates.
    alive_p = np.zeros((num_prompts,), np.int32)
    for rec in records:  # alive after this round; NOT `not rec.done`, which depends on how far lookahead ran
      alive_p[rec.prompt] += rec.end_round < 0 or rec.end_round > rnd
    stuck = (alive_p == 0) & (children_p == 0)
    refills = [p for p in range(num_prompts) if (not has_cand[p] or stuck[p]) and counts_p[p] + children_p[p] < cfg.n]
    self._update_counters(children_p, np.bincount(np.asarray(refills, np.int64), minlength=num_prompts))
    return RoundPlan(children, refills, decisions)

  def _update_counters(self, children_p, refills_p) -> None:
    """AEPO's consecutive-branch counter l (spec §2.1); a no-op for the others."""
