"""The agent loop's run state and scheduling: one rollout call's mutable state (`_Run`), and the rounds (close,
branch, refill, fork on the device), the paged KV cache's bookkeeping (admission by free pages, stalls,
preemption, eviction) and the per-trajectory time limit as methods that `AgentLoop` (_agent.py) inherits.
"""

from __future__ import annotations

import collections
import time
from typing import Optional

import jax
import numpy as np

from aepo_jax.rollout.policies import RolloutPolicy, tree_stats

OCCUPANCY_BINS = 10  # the rollout phase's time profile: rollout/occupancy_t00 .. t90 (share of slots sampling)


def _tool_tags(config, tools) -> tuple:
  """The loop's call tags: AgentConfig.tool_tags, else the ToolSet's, else every registered tool's."""
  if config.tool_tags is not None:
    return tuple(config.tool_tags)
  tags = getattr(tools, "tags", None)
  if tags:
    return tuple(tags)
  from aepo_jax.tools import all_call_tags

  return tuple(dict.fromkeys(c for c, _ in all_call_tags()))


def occupancy_profile(spans, start: float, end: float, bins: int = OCCUPANCY_BINS) -> np.ndarray:
  """[bins] share of the engine's slots sampling in each 1/bins of a call's wall time [start, end], from `spans`
  (start, end, share of slots sampling) of its decode chunks; what lies between chunks (prefill, tool waits, the
  host's work) counts as 0. Its mean is the time-weighted occupancy of the call; the last bins show the tail (a
  few slots finishing while the rest wait)."""
  edges = np.linspace(start, max(end, start + 1e-9), bins + 1)
  busy = np.zeros(bins)
  for a, b, share in spans:
    busy += share * np.clip(np.minimum(edges[1:], b) - np.maximum(edges[:-1], a), 0.0, None)
  return busy / np.diff(edges)


class _Records:
  """A run's records by creation index, in creation order. Partial rollouts (_partial.py) `retire` the records of
  the prompt groups they hand back; indices are never reused, so slots, queue and futures keep pointing right."""

  def __init__(self):
    self._by_index: dict = {}
    self.next_index = 0

  def append(self, rec) -> None:
    if rec.index != self.next_index:
      raise ValueError(f"record index {rec.index} appended where {self.next_index} was due")
    self._by_index[rec.index] = rec
    self.next_index += 1

  def retire(self, indices) -> None:
    for i in indices:
      del self._by_index[i]

  def __getitem__(self, index: int):
    return self._by_index[index]

  def __iter__(self):
    return iter(list(self._by_index.values()))

  def __len__(self) -> int:
    return len(self._by_index)


class _Run:
  """Mutable state of one rollout call (of several, when partial rollouts carry it over: `version` is then the
  policy version of the weights in `params`)."""

  def __init__(self, engine, params, num_prompts: int, seed: int):
    self.engine, self.params = engine, params
    self.state = engine.init_decode_state()
    self.records = _Records()
    self.version = 0
    self.group_rounds: Optional[dict] = None  # prompt -> its round (partial rollouts), None: one clock, `round`
    self.group_rank: dict = {}  # prompt -> its admission number (partial rollouts): older groups decode first
    self.plans = 0  # plans made (per-group clocks fold it into the branch draws' key)
    self.queue: collections.deque = collections.deque()
    self.slot_rec: dict = {}
    self.free = list(range(engine.max_slots))
    self.decoding: set = set()
    self.futures: dict = {}  # record index -> (future, decoded tokens at submit, loop iteration at submit)
    self.iteration = 0  # the agent loop's iterations so far (AgentConfig.tool_results='next_chunk')
    self.round = 0
    self.counts_p = np.zeros((num_prompts,), np.int32)
    self.seed = int(seed)
    self.key = jax.random.PRNGKey(self.seed)
    self.decoded_tokens = 0  # tokens sampled by all slots so far
    self.slot_steps = 0  # decode steps x engine slots so far (slot occupancy = decoded_tokens / slot_steps)
    self.tool_overlap: list = []  # tokens decoded by other slots while each tool ran
    self.phase_start = time.monotonic()  # this call's start (partial rollouts: reset each call, `new_phase`)
    self.chunk_spans: list = []  # (start, end, share of the engine's slots sampling) of each decode chunk
    self.decisions: list = []
    self.restarts: dict = collections.Counter()
    # Paged KV cache (Engine kv_layout='paged'): slots stopped for want of a page, the open segments of trajectories
    # preempted mid-segment (record index -> its device accumulators), and whether a step was held back this
    # iteration for lack of pages.
    self.stalled: set = set()
    self.seg_resume: dict = {}
    self.page_blocked = False
    self.preemptions = 0
    self.stall_events = 0
    # max_calls_per_turn: record index -> (its open segment's number, generation calls in it, where the last began)
    self.turn_calls: dict = {}

  def new_phase(self) -> None:
    """Starts the time profile of a new call (partial rollouts carry one run over several calls)."""
    self.phase_start, self.chunk_spans = time.monotonic(), []

  def note_chunk(self, start: float, valid) -> None:
    """A decode chunk that began at `start` (time.monotonic) and sampled where `valid` [S, steps] is set."""
    steps_run = max(int(valid.any(axis=0).sum()), 1)  # steps with no slot active are skipped on device
    self.chunk_spans.append((start, time.monotonic(), float(valid.sum()) / (valid.shape[0] * steps_run)))

  def stats(self, records, policy: RolloutPolicy, vocab_size: int, paged: bool = False) -> dict:
    """The `rollout/*` metrics of this call for `records` (the trees it hands back) and the run's counters."""
    cfg = policy.config
    out = tree_stats(records, estimator=cfg.estimator, window=cfg.entropy_window, vocab_size=vocab_size)
    out["rollout/rounds"] = float(self.round)
    out["rollout/decode_tokens"] = float(self.decoded_tokens)
    out["rollout/slot_occupancy"] = self.decoded_tokens / max(self.slot_steps, 1)
    profile = occupancy_profile(self.chunk_spans, self.phase_start, time.monotonic())  # the tail made visible
    out.update({f"rollout/occupancy_t{100 * i // profile.size:02d}": float(v) for i, v in enumerate(profile)})
    out["rollout/occupancy_wall"] = float(profile.mean())
    out["rollout/engine_slots"] = float(self.engine.max_slots)  # what the occupancies are shares of (per host)
    if paged:
      out["rollout/preemptions"] = float(self.preemptions)
    if self.tool_overlap:
      out["rollout/decode_tokens_during_tool_mean"] = float(np.mean(self.tool_overlap))
    if getattr(policy, "last_probe", None) is not None and policy.needs_probe():
      out["rollout/probe_h_root"] = float(np.mean(policy.last_probe[0]))
      out["rollout/probe_h_tool"] = float(np.mean(policy.last_probe[1]))
    return out


class _Scheduling:
  """Rounds and KV pages of AgentLoop (it provides engine, config and the record helpers these call)."""

  # ------------------------------------------------------------------------------------------------ rounds
  @staticmethod
  def _decode_order(run: _Run) -> list:
    """The decoding slots by priority, for an engine that runs only some of them per call (max_decode_rows): the
    oldest prompt group first (partial rollouts: a call waits for the groups of older versions), then the oldest
    trajectory."""
    rank = run.group_rank

    def key(slot):
      i = run.slot_rec[slot]
      return rank.get(run.records[i].prompt, 0), i

    return sorted(run.decoding, key=key)

  # One round clock for the whole run (`run.round`, the official lockstep), or one per prompt group
  # (`run.group_rounds`, partial rollouts: a group's tree advances by its own rounds, so groups admitted in different
  # steps never wait for each other's tool calls).
  @staticmethod
  def _clock(run: _Run, rec) -> int:
    return run.round if run.group_rounds is None else run.group_rounds.get(rec.prompt, 0)

  @staticmethod
  def _closed(records, r: int) -> bool:
    """Round r is closed for `records` when every one alive in it has finished its r-th segment and tool."""
    for rec in records:
      if rec.first_round > r:
        continue
      if rec.done and rec.end_round <= r:
        continue
      if rec.first_round + rec.rounds_done() - 1 < r:
        return False
    return True

  def _round_closed(self, run: _Run) -> bool:
    if run.group_rounds is not None:
      return bool(self._closed_groups(run))
    return self._closed(run.records, run.round)

  def _closed_groups(self, run: _Run) -> list:
    by = collections.defaultdict(list)  # (a probe runs in a run of its own: no probe records here)
    for rec in run.records:
      if rec.prompt in run.group_rounds:
        by[rec.prompt].append(rec)
    return [q for q in run.group_rounds if self._closed(by.get(q, ()), run.group_rounds[q])]

  def _end_round(self, run: _Run, policy: RolloutPolicy) -> bool:
    """Applies the policy's plan for the closing round. Returns False when the rollout is complete."""
    if run.group_rounds is not None:
      return self._end_group_rounds(run, policy)
    rnd = run.round
    live = [r for r in run.records if r.kind != "probe"]
    self._apply_plan(run, policy, live, rnd, run.counts_p.copy(), jax.random.fold_in(run.key, rnd))
    run.round += 1
    # Finished trajectories are no fork source after their last round (one that finished early, running ahead,
    # may still be a candidate when its own round closes in corrected mode).
    self._release(run, [s for s, i in run.slot_rec.items() if run.records[i].done and run.records[i].end_round <= rnd])
    # Not `any(not r.done)`: with lookahead a trajectory may have finished a round ahead; the rounds up to its
    # last still have to be closed, since the policy may branch from it or refill its prompt there.
    return any(not r.done or r.end_round > rnd for r in run.records)

  def _apply_plan(self, run: _Run, policy: RolloutPolicy, records, rnd: int, counts_p, key):
    """The policy's plan for round `rnd` of `records`: branches forked (on the device where a slot is free) or
    queued, refills queued. Returns the plan."""
    plan = policy.plan_round(records, rnd, counts_p, list(run.free), key, self.engine.config.vocab_size)
    if plan.decisions:
      run.decisions.append({"round": rnd, **{k: np.asarray(v) for k, v in plan.decisions.items()}})
    forks = []
    for parent, fork_pos, dst in plan.children:
      child = parent.fork(run.records.next_index, fork_pos, 0, rnd + 1, lambda s: s.copy() if s is not None else None)
      child.version_marks.append((fork_pos, run.version))  # its own tokens come from the weights of now
      run.records.append(child)
      run.counts_p[child.prompt] += 1
      child.seed = self._seed(run, child.index)
      if dst >= 0:
        forks.append((parent, child, dst))
      else:
        run.queue.append(child.index)
    if forks:
      self._fork_on_device(run, forks)
    refills = []
    for p in plan.refills:
      first = next(r for r in run.records if r.prompt == p and r.kind != "probe")
      refills.append(self._new_record(run, p, "refill", first.prompt_tokens, rnd + 1))
    self._start_refills(run, refills)
    return plan

  def _end_group_rounds(self, run: _Run, policy: RolloutPolicy) -> bool:
    """Per-group clocks: every group whose round closed gets its plan (groups closing the same round number
    together), then its next round; a group with nothing left after its round stops ticking (it is complete).
    AEPO's consecutive-branch counter goes per group: +1 after a round of the group that gave it a copy, else 0.
    Returns False when no group ticks any more."""
    by_round = collections.defaultdict(list)
    for q in self._closed_groups(run):
      by_round[run.group_rounds[q]].append(q)
    n = policy.config.n
    for rnd, groups in sorted(by_round.items()):
      members = set(groups)
      records = [r for r in run.records if r.prompt in members]
      counts = np.full_like(run.counts_p, n)  # other groups: no budget, so no branch or refill lands there
      counts[groups] = run.counts_p[groups]
      before = policy.consecutive_p.copy()
      run.plans += 1
      key = jax.random.fold_in(jax.random.fold_in(run.key, rnd), run.plans)
      plan = self._apply_plan(run, policy, records, rnd, counts, key)
      copies = collections.Counter(parent.prompt for parent, _, _ in plan.children)
      if policy.config.penalty_counts_refills:
        copies.update(plan.refills)
      policy.consecutive_p = before
      alive = {r.prompt for r in run.records if r.prompt in members and (not r.done or r.end_round > rnd)}
      for q in groups:
        if policy.rule == "aepo":
          policy.consecutive_p[q] = before[q] + 1 if copies[q] else 0
        run.group_rounds[q] = rnd + 1
        if q not in alive:
          del run.group_rounds[q]  # complete: its budget is spent (a stuck group was refilled above)
      self._release(
        run,
        [
          s
          for s, i in run.slot_rec.items()
          if run.records[i].prompt in members and run.records[i].done and run.records[i].end_round <= rnd
        ],
      )
    return bool(run.group_rounds)

  def _fork_on_device(self, run: _Run, forks) -> None:
    """Children copy their parent's slot and rewind to the fork position. Where the parent's device state stops
    short of it (the tool result that ends the fork prefix is still on the host, waiting for the parent's next
    round), the child is rewound to what the device holds and extended with the rest, as the parent would be."""
    src = [p.slot for p, _, _ in forks]
    dst = [d for _, _, d in forks]
    cut = {c.index: min(p.device_len, c.fork_pos) for p, c, _ in forks}
    if self._paged():  # at most a copied page for the fork, one for the cut, and the pages of the extension
      need = sum(
        2
        + self._pages_for(len(c.prompt_tokens) + c.fork_pos + 1)
        - self._pages_for(len(c.prompt_tokens) + cut[c.index])
        for _, c, _ in forks
      )
      if need > self._spare_pages(run):
        run.page_blocked = True
        for _, child, _ in forks:  # re-prefilled from the host tokens once pages are free
          child.slot = -1
          run.queue.append(child.index)
        return
    run.state = self.engine.copy_slots(run.state, src, dst, [c.seed for _, c, _ in forks])
    run.state = self.engine.truncate(run.state, dst, [len(c.prompt_tokens) + cut[c.index] for _, c, _ in forks])
    for _, child, d in forks:
      run.free.remove(d)
      run.slot_rec[d] = child.index
      child.slot, child.device_len, child.forked_on_device = d, cut[child.index], True
    ok = [c for _, c, _ in forks if c.room > 0]
    for _, c, _ in forks:
      if c.room <= 0:
        self._end(c, "length")
    if ok:
      run.state = self.engine.extend(
        run.params,
        run.state,
        [c.slot for c in ok],
        [c.tokens[c.device_len : c.fork_pos] for c in ok],
        [self._call_budget(c) for c in ok],
      )
      for c in ok:
        c.device_len = c.fork_pos
        self._start_segment(c)
        run.decoding.add(c.slot)

  def _fork_refills(self, run: _Run, slots, recs) -> list:
    """Starts the fresh trajectories among `recs` (a refill, a new global sample: nothing generated yet) whose prompt
    another slot holds by copying that slot and rewinding it to the prompt, instead of prefilling the prompt again
    (the same KV, computed once; paged: its full pages shared). Each keeps its own key and budget, as `add` would
    give it. Returns the (slot, record) pairs left for `add`. A prompt's KV may have been computed by an earlier
    version of the weights (partial rollouts), as a carried trajectory's is."""
    holder = {}
    for s, i in run.slot_rec.items():
      other = run.records[i]
      if other.kind != "probe":
        holder.setdefault((other.prompt, len(other.prompt_tokens)), (s, other.prompt_tokens))
    forks, rest = [], []
    for s, r in zip(slots, recs):
      src = holder.get((r.prompt, len(r.prompt_tokens)))
      fresh = not r.response_len and r.index not in run.seg_resume and r.kind != "probe"
      if fresh and src is not None and src[1] == r.prompt_tokens:
        forks.append((src[0], s, r))
      else:
        rest.append((s, r))
    if forks and self._paged():  # a fork takes at most 3 pages (its copied last page, a cut's copy, its first write)
      need = 3 * len(forks) + sum(self._pages_for(len(r.prompt_tokens) + r.response_len + 1) for _, r in rest)
      if need > self._spare_pages(run):
        return list(zip(slots, recs))
    if forks:
      dst = [d for _, d, _ in forks]
      seeds = [self._seed(run, r.index) for _, _, r in forks]
      run.state = self.engine.copy_slots(run.state, [a for a, _, _ in forks], dst, seeds)
      run.state = self.engine.truncate(run.state, dst, [len(r.prompt_tokens) for _, _, r in forks])
      budgets = [self._call_budget(r) for _, _, r in forks]
      run.state = self.engine.extend(run.params, run.state, dst, [[] for _ in forks], budgets)
      for _, d, r in forks:
        r.forked_on_device, r.slot, r.device_len = True, d, 0
        run.slot_rec[d] = r.index
        self._start_segment(r)
        run.decoding.add(d)
    return rest

  def _start_refills(self, run: _Run, refills) -> None:
    """Refills planned at a round's close start at once where a slot is free and a slot of their group holds the
    prompt (forked as `_fork_refills`; before the round's finished trajectories give their slots back), as
    branches do; the others wait in the queue for `_admit`."""
    take = refills[: len(run.free)]
    if not take:
      return
    slots = [run.free.pop(0) for _ in take]
    for r in take:
      run.queue.remove(r.index)
    for s, r in self._fork_refills(run, slots, take):  # no slot holds the prompt: prefilled when admitted
      run.free.append(s)
      run.queue.append(r.index)
    run.free.sort()

  # ------------------------------------------------------------------------------------------------ pages
  def _paged(self) -> bool:
    return bool(getattr(self.engine, "page_size", 0))

  def _pages_for(self, length: int) -> int:
    return int(self.engine.pages_held(length))

  def _tokens_held(self, run: _Run, slot: int) -> int:
    rec = run.records[run.slot_rec[slot]]
    return len(rec.prompt_tokens) + rec.device_len

  def _spare_pages(self, run: _Run) -> int:
    """Free pages beyond one for each running or stalled slot (the page its next write may need): what admission,
    extension and forks may take without starving the slots already going (a preempted trajectory would otherwise
    take back at once the pages that a stalled slot was waiting for)."""
    return self.engine.pages_free(run.state) - len(run.decoding) - len(run.stalled)

  def _resume_budget(self, rec, run: Optional[_Run] = None) -> int:
    """The budget of a trajectory re-admitted mid-segment: its room, and what is left of the call's cap."""
    cap = self.config.max_tokens_per_call
    start = rec.segments[-1].start
    if run is not None and rec.index in run.turn_calls and run.turn_calls[rec.index][0] == len(rec.segments):
      start = run.turn_calls[rec.index][2]  # a continued call: its cap counts from where it began
    return min(rec.room, cap - (rec.response_len - start)) if cap else rec.room

  def _unstall(self, run: _Run) -> None:
    """Slots that stopped for want of a page decode again, as many as there are free pages (one each to start)."""
    if not run.stalled:
      return
    free = self.engine.pages_free(run.state)
    if free <= 0:
      run.page_blocked = True
      return
    slots = sorted(run.stalled)[:free]
    run.state = self.engine.resume(run.state, slots)
    run.stalled.difference_update(slots)
    run.decoding.update(slots)

  def _preempt(self, run: _Run) -> None:
    """No slot decodes, no tool runs, and what waits needs pages: release the waiting trajectory that holds the most
    tokens; it goes back to the queue (its tokens are on the host) and is re-prefilled when pages are free, in the
    same segment if it was cut mid-segment."""
    waiting = [s for s, i in run.slot_rec.items() if not run.records[i].done and s not in run.decoding]
    waiting = [s for s in waiting if run.slot_rec[s] not in run.futures]
    done = [s for s, i in run.slot_rec.items() if run.records[i].done]
    if done:  # finished trajectories kept as fork sources go first
      self._release(run, done)
      return
    if not waiting:  # nothing holds pages but what this rollout cannot run without (checked up front, so rare)
      pool = (self.engine.num_pages - 1) * self.engine.page_size
      raise RuntimeError(
        f"AgentLoop: the KV page pool ({self.engine.num_pages - 1} pages of {self.engine.page_size} tokens, "
        f"{pool} tokens) cannot hold one trajectory of this rollout (prompt + max_response_len); raise "
        "rollout.kv_tokens (Engine num_pages)."
      )
    s = max(waiting, key=lambda s: self._tokens_held(run, s))
    idx = run.slot_rec[s]
    if s in run.stalled:  # mid-segment: its segment's per-position entropies go back in with the re-prefill
      run.seg_resume[idx] = self.engine.segment_snapshot(run.state, s)
      run.stalled.discard(s)
    self._release(run, [s])
    run.restarts[idx] += 1
    run.preemptions += 1
    run.queue.append(idx)
    # Never loop for ever: each preemption re-prefills a trajectory.
    if run.preemptions > 8 * run.records.next_index + 16:
      raise RuntimeError(
        f"AgentLoop: {run.preemptions} preemptions for {run.records.next_index} trajectories: the KV page pool "
        f"({self.engine.num_pages - 1} pages of {self.engine.page_size} tokens) is too small for this many slots at "
        "these lengths; raise rollout.kv_tokens or lower rollout.max_slots."
      )

  def _release(self, run: _Run, slots) -> None:
    slots = [s for s in slots if s in run.slot_rec]
    if not slots:
      return
    # Routing replay (Engine(record_routes=True)): a record takes its slot's routes at every release (end, round
    # close, eviction, preemption), the last one winning: a trajectory re-prefilled after an eviction keeps the routes
    # of the recomputed KV, which its latest tokens attended to (those sampled before attended to the first one's:
    # one route per position, the newest). A fork's slot carries its parent's routes with the copied KV.
    if getattr(self.engine, "record_routes", False):
      for s in slots:
        rec = run.records[run.slot_rec[s]]
        if rec.kind != "probe":
          rec.routes = self.engine.slot_routes(run.state, s)
    run.state = self.engine.release(run.state, slots)
    for s in slots:
      run.records[run.slot_rec.pop(s)].slot = -1
      run.free.append(s)
    run.free.sort()

  def _expire(self, run: _Run) -> None:
    """Ends every trajectory older than sample_timeout_s where it stands: a decoding slot stops (its tokens so far
    kept) and is freed, a pending tool call is abandoned, a queued or paused one never starts again."""
    deadline = time.monotonic() - self.config.sample_timeout_s
    for rec in [r for r in run.records if not r.done and 0 < r.started < deadline]:
      if rec.slot in run.decoding:
        run.decoding.discard(rec.slot)
        rec.segments[-1].end = rec.response_len
      run.stalled.discard(rec.slot)
      if run.futures.pop(rec.index, None) is not None:  # the tool's thread finishes on its own; its result is unused
        rec.segments[-1].tool_pending = False
      if rec.index in run.queue:
        run.queue.remove(rec.index)
      run.seg_resume.pop(rec.index, None)
      if rec.slot >= 0:
        self._release(run, [rec.slot])
      self._end(rec, "timeout")

  def _progress_possible(self, run: _Run) -> bool:
    ready = any(self._may_start(run, run.records[i]) for i in run.queue)
    resumable = any(
      self._may_start(run, run.records[i]) and run.records[i].device_len < run.records[i].response_len
      for i in run.slot_rec.values()
      if not run.records[i].done
    )
    return (ready and (run.free or any(run.records[i].done for i in run.slot_rec.values()))) or resumable

  def _evict_paused(self, run: _Run) -> None:
    """More live trajectories than slots and every slot waits for a later round: move one back to the queue
    (its tokens are on the host; it is re-prefilled when it may run)."""
    paused = [
      s for s, i in run.slot_rec.items() if not run.records[i].done and s not in run.decoding and i not in run.futures
    ]
    if not paused or not run.queue:
      raise RuntimeError(
        f"AgentLoop: no progress possible in round {run.round} (queue={list(run.queue)}, "
        f"slots={run.slot_rec}); this is a bug."
      )
    s = max(paused, key=lambda s: self._next_round(run.records[run.slot_rec[s]]))
    idx = run.slot_rec[s]
    self._release(run, [s])
    run.restarts[idx] += 1
    run.queue.append(idx)
