"""Partial rollouts with bounded staleness (`train.max_staleness` > 0; docs/rollout.md, "Partial rollouts").

One agent-loop run is carried from one call to the next, with up to groups_per_call x (max_staleness + 1) prompt
groups in it. Each call brings the new weights (a policy version) and as many new prompts as fill the run up again
(`wanted()`: all of them on the first call, groups_per_call after), and returns as soon as `groups_per_call`
prompt groups are complete; the trajectories still decoding stay in their engine slots (or queue for one), with
their KV cache, and go on under the new weights in the next call. The engine's slots thus always have work while
a step's slowest trajectories finish. What makes it safe for the objective:

- A prompt group (for ARPO/AEPO the whole tree: global samples, branches and refills) is handed back only when
  complete, so group advantages are exact.
- Every response token keeps the version of the weights that sampled it (`TrajectoryRecord.version_marks`) and its
  sampling log-prob (the behaviour policy of `algo.off_policy`).
- Bounded staleness, by finishing first: a call does not return before every group started at version
  <= version - max_staleness is complete, and complete groups are handed back oldest first, so no token of an
  update is more than max_staleness versions older than the weights being updated. Nothing is dropped for
  staleness (`rollout/dropped_stale` stays 0); what was carried over is dropped only when the run stops (a
  preemption, a restart: the resumed run starts with an empty carry, `drop()`).
- Which complete groups a call hands back (`order`): 'completion' (the default) returns as soon as any
  groups_per_call groups are complete, the oldest of them first; groups whose trees are short (no tool call, no
  branch) thus reach the update sooner than long ones of the same prompts' batch. 'admission' returns exactly the
  groups_per_call oldest groups, once all of them are complete: every update sees the prompts in the order the data
  gave them, with no bias toward short trees, at the cost of waiting for the oldest group's slowest trajectory (the
  younger groups decode meanwhile).
- Filling the run (`ramp`): by default the first call admits all groups_per_call x (max_staleness + 1) groups, so
  the first max_staleness + 1 updates all train on groups the initial weights started. With ramp=True the first
  call admits one batch (a synchronous step), and each later call one more than it hands back until the run is
  full: the update of call t then trains on groups started at call t - max_staleness or later, as in the steady
  state, at the cost of less overlap over the first max_staleness calls.
- A floor on each call's work (`call_floor`, a fraction): once its groups are ready, a call goes on decoding until
  it has sampled call_floor x the mean tokens per call so far in the run (or nothing is left to decode). In
  admission order a call whose oldest groups were already complete would otherwise return after little more than
  the new groups' prefill, and the run falls into a cycle of one long call that decodes every batch in flight
  (with its tail) and max_staleness short ones: a synchronous step over max_staleness + 1 batches. The floor
  spreads the decoding over the calls, so younger groups are further on when they become the oldest (their tokens
  a version older on average). 0 (default): return once ready.
- The KV cache of a carried trajectory is kept as computed by the older weights (as PipelineRL does; AReaL
  recomputes it): the new tokens' sampling log-probs are those of what actually sampled them, which the off-policy
  correction needs.

Which group completes in which call depends on when tool results enter their trajectories: with
`AgentConfig.tool_results='next_chunk'` (rollout.tool_results) that is fixed by the loop's own events, so partial
rollouts repeat run to run; with 'when_ready' it depends on how long each tool took.

Rounds are per group here (the synchronous rollout keeps the official lockstep of one round clock for the batch):
a group's tree closes its rounds, branches and refills on its own clock, so a new group never waits for an old
group's tool calls or long segments. Within a group everything is as in the synchronous rollout.

AEPO's pre-monitoring probe for the new prompts runs in its own engine state beside the carried one (twice the
KV memory while it runs).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import numpy as np

from aepo_jax.rollout._agent import AgentLoop, RolloutInterrupted
from aepo_jax.rollout._agent_run import _Run
from aepo_jax.rollout._trajectories import Trajectories, assemble


@dataclasses.dataclass
class _Group:
  payload: Any  # the caller's object for the prompt (the trainer's example, for the reward)
  version: int  # the policy version it started under
  order: int  # admission order (ties of version)


class PartialRollouts:
  """An `AgentLoop` and rollout policy whose unfinished groups carry over between calls.

    partial = PartialRollouts(loop, policy, groups_per_call=8, max_staleness=1)
    traj, payloads, metrics = partial(weights, prompt_ids, examples, version=step, seed=seed)

  Each call admits `wanted()` new prompts (a multiple of groups_per_call, so a data iterator of such batches stays in
  step with the calls) and returns `groups_per_call` complete groups, group ids 0.. in the order of `payloads`.
  """

  ORDERS = ("completion", "admission")

  def __init__(
    self,
    loop: AgentLoop,
    policy,
    *,
    groups_per_call: int,
    max_staleness: int,
    order: str = "completion",
    ramp: bool = False,
    call_floor: float = 0.0,
  ):
    if groups_per_call < 1 or max_staleness < 1:
      raise ValueError(
        f"PartialRollouts: groups_per_call={groups_per_call} must be >= 1 and max_staleness={max_staleness} >= 1 "
        "(0 is the synchronous rollout: use AgentLoop.rollout)."
      )
    if order not in self.ORDERS:
      raise ValueError(f"PartialRollouts: order={order!r}; use one of {self.ORDERS} (train.hand_back).")
    if not call_floor >= 0:
      raise ValueError(f"PartialRollouts: call_floor={call_floor!r} must be >= 0 (train.call_floor; 0: no floor).")
    self.call_floor = float(call_floor)
    self.loop, self.policy, self.order, self.ramp = loop, policy, order, bool(ramp)
    self.groups_per_call, self.max_staleness = int(groups_per_call), int(max_staleness)
    # Groups alive at once: at most those of the last max_staleness + 1 versions (the bound), one table of them.
    self.capacity = self.groups_per_call * (self.max_staleness + 1)
    self.run: Optional[_Run] = None
    self.groups: dict = {}  # prompt slot -> _Group
    self._admitted = 0
    self.calls = 0  # calls returned since the run started (ramp: the run fills one more batch per call)
    self.tokens = 0  # tokens sampled by those calls (call_floor: their mean)

  # -------------------------------------------------------------------------------------------- state
  def carried(self) -> tuple:
    """(groups, trajectories) carried over to the next call."""
    if self.run is None:
      return 0, 0
    return len(self.groups), len(self.run.records)

  def wanted(self) -> int:
    """New prompts the next call takes: what fills the run up to groups_per_call x (max_staleness + 1) groups (with
    `ramp`, up to groups_per_call x (calls so far + 1) while that is fewer)."""
    limit = self.capacity
    if self.ramp:
      limit = min(limit, self.groups_per_call * (self.calls + 1))
    return limit - len(self.groups)

  def drop(self) -> int:
    """Forget everything carried over (the engine state with it); returns the trajectories dropped."""
    n = 0 if self.run is None else sum(not r.done for r in self.run.records)
    self.run, self.groups, self.calls, self.tokens = None, {}, 0, 0
    return n

  def _start(self, params, seed: int) -> _Run:
    run = _Run(self.loop.engine, params, self.capacity, seed)
    run.counts_p[:] = self.policy.config.n  # free prompt slots: no budget, so no branch or refill lands there
    run.group_rounds = {}  # one round clock per group
    self.policy.begin(self.capacity)
    return run

  # -------------------------------------------------------------------------------------------- call
  def __call__(
    self,
    params,
    prompts: Sequence[Sequence[int]],
    payloads: Sequence[Any],
    *,
    version: int,
    seed: int = 0,
    should_stop: Optional[Callable] = None,
    on_finished: Optional[Callable] = None,
  ) -> tuple:
    """(Trajectories of `groups_per_call` complete groups, their payloads, metrics)."""
    prompts = [list(map(int, p)) for p in prompts]
    if len(prompts) != self.wanted() or len(payloads) != len(prompts):
      raise ValueError(
        f"PartialRollouts: {len(prompts)} prompts and {len(payloads)} payloads; this call takes wanted()="
        f"{self.wanted()} of both (groups_per_call={self.groups_per_call} x (max_staleness={self.max_staleness} "
        "+ 1), or x (calls so far + 1) while filling with ramp=True, less the groups carried over)."
      )
    loop = self.loop
    loop._check_prompts(prompts)
    if self.run is None:
      self.run = self._start(params, seed)
    run = self.run
    run.params = params
    if version != run.version:  # the weights changed: what each live trajectory samples from here on is `version`
      for rec in run.records:
        if not rec.done:
          rec.version_marks.append((rec.response_len, version))
      run.version = version
    tokens0, steps0 = run.decoded_tokens, run.slot_steps
    run.tool_overlap, run.decisions = [], []  # per call: the statistics of this step, and no growth over a run
    run.new_phase()
    loop._should_stop, loop._on_finished = should_stop, on_finished
    floor = self.call_floor * self.tokens / self.calls if self.calls else 0.0  # tokens this call samples at least
    try:
      self._admit(run, prompts, payloads, version, seed)
      loop._drive(run, self.policy, until=lambda r: self._ready(r, version) and self._worked(r, tokens0, floor))
    except RolloutInterrupted:
      self.drop()
      raise
    finally:
      loop._should_stop = loop._on_finished = None
    slots = self._choose(run)
    self.calls += 1
    self.tokens += run.decoded_tokens - tokens0
    return self._hand_back(run, slots, version, run.decoded_tokens - tokens0, run.slot_steps - steps0, floor)

  def _admit(self, run: _Run, prompts, payloads, version: int, seed: int) -> None:
    slots = [q for q in range(self.capacity) if q not in self.groups][: len(prompts)]
    policy = self.policy
    probe = None
    if policy.needs_probe():
      probe = lambda: self.loop._probe(run.params, prompts, policy, seed)  # noqa: E731
    counts = policy.initial_counts(len(prompts), probe)
    for k, (q, prompt, payload, m) in enumerate(zip(slots, prompts, payloads, counts)):
      run.counts_p[q] = 0
      policy.consecutive_p[q] = 0
      self.groups[q] = _Group(payload, version, self._admitted)
      run.group_rank[q] = self._admitted  # decode priority: older groups first (Engine max_decode_rows)
      self._admitted += 1
      run.group_rounds[q] = 0
      for _ in range(int(m)):
        self.loop._new_record(run, q, "global", prompt, first_round=0)
      if (k + 1) % self.groups_per_call == 0:
        # Prefill groups_per_call prompts at a time: the first call's capacity then runs the same prefill and
        # fork programs as every later call's groups_per_call (one shape, compiled once).
        self.loop._admit(run)

  def _complete(self, run: _Run) -> set:
    """Prompt slots whose group can change no more: its clock stopped after a round that left nothing alive (its
    budget spent: a group with budget left is refilled when its round closes)."""
    return set(self.groups) - set(run.group_rounds)

  def _oldest(self, groups) -> list:
    return sorted(groups, key=lambda q: (self.groups[q].version, self.groups[q].order))[: self.groups_per_call]

  def _ready(self, run: _Run, version: int) -> bool:
    done = self._complete(run)
    if self.order == "admission":
      return set(self._oldest(self.groups)) <= done
    forced = {q for q, g in self.groups.items() if g.version <= version - self.max_staleness}
    return len(done) >= self.groups_per_call and forced <= done

  def _worked(self, run: _Run, tokens0: int, floor: float) -> bool:
    """The call has sampled its floor of tokens, or every group in the run is complete (nothing left to decode)."""
    return run.decoded_tokens - tokens0 >= floor or self._complete(run) >= set(self.groups)

  def _choose(self, run: _Run) -> list:
    return self._oldest(self._complete(run))

  def _hand_back(self, run: _Run, slots: list, version: int, decoded: int, slot_steps: int, floor: float) -> tuple:
    rank = {q: i for i, q in enumerate(slots)}
    records = sorted((r for r in run.records if r.prompt in rank), key=lambda r: (rank[r.prompt], r.index))
    held = [s for s, i in run.slot_rec.items() if run.records[i].prompt in rank]
    self.loop._release(run, held)  # normally none: a finished trajectory leaves its slot when its round closes
    stats = self.loop._stats(run, records, self.policy)
    mask = np.concatenate([np.asarray(r.loss_mask, bool) for r in records]) if records else np.zeros(0, bool)
    stale = np.concatenate([version - r.token_versions() for r in records]) if records else np.zeros(0)
    stale = stale[mask] if mask.any() else np.zeros(1)
    started = np.asarray([version - self.groups[q].version for q in slots], np.float64)
    payloads = [self.groups[q].payload for q in slots]
    run.records.retire([r.index for r in records])
    for q in slots:
      del self.groups[q]
      run.group_rank.pop(q, None)
      run.counts_p[q] = self.policy.config.n
    groups_left, traj_left = self.carried()
    stats.update(
      {
        "rollout/rounds": float(max(r.end_round for r in records) + 1),  # the longest group's rounds
        "rollout/decode_tokens": float(decoded),
        "rollout/slot_occupancy": decoded / max(slot_steps, 1),
        "rollout/staleness_mean": float(stale.mean()),
        "rollout/staleness_max": float(stale.max()),
        "rollout/stale_token_fraction": float((stale > 0).mean()),
        "rollout/group_age_max": float(started.max()),
        "rollout/carried_groups": float(groups_left),
        "rollout/carried_trajectories": float(traj_left),
        "rollout/dropped_stale": 0.0,
        "rollout/call_floor_tokens": float(floor),
      }
    )
    traj: Trajectories = assemble(records, pad_id=self.loop.pad_id, decode=self.loop.tokenizer.decode, stats=stats)
    traj.group_id_b = np.asarray([rank[r.prompt] for r in records], np.int32)
    return traj, payloads, stats
