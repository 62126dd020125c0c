"""The multi-turn agent loop: drives the engine in chunks, pauses slots for tools, forks and refills by rounds.

Per iteration: admit queued trajectories into free slots (engine.add), resume slots whose tool result is in
(engine.extend, the result tokenized once), run `chunk_steps` decode steps for every decoding slot in one jitted
call, read the per-slot summary once, and submit the tool call of every slot that stopped on a closing tag to
the ToolSet's thread pool at once, so tools run while the other slots keep decoding.

Rounds (spec §1.2 step 2): round r closes when every trajectory alive in r has generated its r-th segment and
its tool has returned; then the policy decides branches and refills (policies/_base.py). A slot whose tool
returned early may already generate its next segment (`lookahead`, at most one round ahead); forks are made at a
recorded position (copy_slots + truncate), so running ahead changes neither the decisions nor the trees.
Token-in/token-out: the host keeps every id; text is decoded only to parse a tool call and, at the end, for
the reward. The run state, the rounds and the KV-page bookkeeping are in _agent_run.py, the settings in
_agent_config.py.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from aepo_jax.rollout import _state as st
from aepo_jax.rollout._agent_config import AgentConfig, RolloutInterrupted
from aepo_jax.rollout._agent_run import _Run, _Scheduling, _tool_tags
from aepo_jax.rollout._stop import _encode
from aepo_jax.rollout._trajectories import Segment, TrajectoryRecord, Trajectories, assemble
from aepo_jax.rollout.policies import RolloutPolicy, rollout_policy, window_statistic


class AgentLoop(_Scheduling):
  """Runs rollouts of a policy over prompts with an Engine and a ToolSet (docs/rollout.md)."""

  def __init__(self, engine, tokenizer, tools, config: AgentConfig = AgentConfig(), *, pad_id: Optional[int] = None):
    from aepo_jax.tools import format_result, parse_tool_call, trajectory_steps  # tools never import jax: lazily

    self._format, self._parse, self._steps = format_result, parse_tool_call, trajectory_steps
    self.engine, self.tokenizer, self.tools, self.config = engine, tokenizer, tools, config
    if not engine.eos_ids:
      raise ValueError("AgentLoop: the engine has no eos_ids; the loop needs one to end trajectories.")
    self.eos_id = int(engine.eos_ids[0])
    cfg_pad = getattr(engine.config, "pad_token_id", None)
    self.pad_id = int(pad_id if pad_id is not None else (cfg_pad if cfg_pad is not None else self.eos_id))
    self.last_run: Optional[_Run] = None
    self._should_stop: Optional[Callable] = None  # these two are set for the duration of a rollout call
    self._on_finished: Optional[Callable] = None
    self.stop_checker = None
    self.tool_tags = _tool_tags(config, tools)
    self.result_tags = dict(getattr(tools, "result_tags", None) or {})
    if config.check_stop_strings:
      from aepo_jax.rollout._stop import StopStringChecker

      self.stop_checker = StopStringChecker(tokenizer, [f"</{t}>" for t in self.tool_tags], engine.config.vocab_size)

  # ------------------------------------------------------------------------------------------------ API
  def rollout(
    self,
    params,
    prompts: Sequence[Sequence[int]],
    policy,
    *,
    seed: int = 0,
    should_stop: Optional[Callable] = None,
    on_finished: Optional[Callable] = None,
  ) -> Trajectories:
    """Exactly policy.config.n trajectories per prompt, rows prompt-major in creation order. `should_stop()` is
    asked between decode chunks and tool polls (the probe's included); True abandons the rollout with
    RolloutInterrupted. `on_finished()` is called as each trajectory ends (progress; not for the probe's)."""
    self._should_stop, self._on_finished = should_stop, on_finished
    try:
      return self._rollout(params, prompts, policy, seed)
    finally:
      self._should_stop = self._on_finished = None

  def _rollout(self, params, prompts, policy, seed: int) -> Trajectories:
    if isinstance(policy, str):
      policy = rollout_policy(policy)
    prompts = [list(map(int, p)) for p in prompts]
    self._check_prompts(prompts)
    window = getattr(self.engine, "entropy_window", policy.config.entropy_window)
    if window != policy.config.entropy_window:  # the engine sums entropies over ITS window
      raise ValueError(
        f"PolicyConfig.entropy_window={policy.config.entropy_window} differs from the engine's "
        f"entropy_window={window}; build both with the same value."
      )
    start = time.monotonic()  # the phase's time profile includes AEPO's probe
    probe = (lambda: self._probe(params, prompts, policy, seed)) if policy.needs_probe() else None
    m_p = policy.initial_counts(len(prompts), probe)
    policy.begin(len(prompts))
    run = _Run(self.engine, params, len(prompts), seed)
    run.phase_start = start
    for p, m in enumerate(m_p):
      for _ in range(int(m)):
        self._new_record(run, p, "global", prompts[p], first_round=0)
    self._drive(run, policy)
    n = policy.config.n
    if (run.counts_p != n).any():
      raise RuntimeError(f"rollout budget violated: trajectories per prompt {run.counts_p.tolist()}, expected {n}.")
    records = sorted(run.records, key=lambda r: (r.prompt, r.index))
    stats = self._stats(run, records, policy)
    run.state = run.params = None  # the KV cache and weights are not kept past the call (last_run is for stats)
    self.last_run = run
    return assemble(records, pad_id=self.pad_id, decode=self.tokenizer.decode, stats=stats)

  def _check_prompts(self, prompts) -> None:
    if not prompts:
      raise ValueError("AgentLoop.rollout: no prompts.")
    for i, p in enumerate(prompts):
      if not p:
        raise ValueError(f"AgentLoop.rollout: prompt {i} is empty.")
      if len(p) + self.config.max_response_len > self.engine.max_len:
        raise ValueError(
          f"AgentLoop.rollout: prompt {i} ({len(p)} tokens) + max_response_len "
          f"{self.config.max_response_len} exceeds the engine's max_len={self.engine.max_len}; "
          "build the Engine with a larger max_len or lower AgentConfig.max_response_len."
        )
      if self._paged() and self._pages_for(len(p) + self.config.max_response_len) > self.engine.num_pages - 1:
        raise ValueError(
          f"AgentLoop.rollout: prompt {i} ({len(p)} tokens) + max_response_len {self.config.max_response_len} "
          f"needs {self._pages_for(len(p) + self.config.max_response_len)} KV pages but the engine's pool has "
          f"{self.engine.num_pages - 1} of {self.engine.page_size} tokens; the pool cannot hold one trajectory: "
          "raise rollout.kv_tokens (Engine num_pages) or lower max_response_len."
        )

  # ------------------------------------------------------------------------------------------------ probe
  def _probe(self, params, prompts, policy: RolloutPolicy, seed: int):
    """AEPO pre-monitoring (spec §2.1): per prompt, an H_root sample of probe_tokens tokens and one full
    tool-using probe trajectory; both discarded. Returns (H_root, mean segment entropy of the probe) per prompt."""
    cfg = policy.config
    run = _Run(self.engine, params, len(prompts), seed + 7_654_321)
    for p, prompt in enumerate(prompts):
      self._new_record(
        run, p, "probe", prompt, 0, max_len=min(cfg.probe_tokens, self.config.max_response_len), max_calls=0
      )
      self._new_record(run, p, "probe", prompt, 0)
    self._drive(run, rollout_policy("none"))
    stat = lambda accums: np.asarray(
      window_statistic(
        np.asarray([a[0] for a in accums], np.int32),
        np.asarray([a[1] for a in accums], np.float32),
        np.asarray([a[2] for a in accums], np.float32),
        estimator=cfg.estimator,
        window=cfg.entropy_window,
        vocab_size=self.engine.config.vocab_size,
      )
    )
    h_root, h_tool = np.zeros(len(prompts), np.float32), np.zeros(len(prompts), np.float32)
    for p in range(len(prompts)):
      root, full = run.records[2 * p], run.records[2 * p + 1]
      h_root[p] = stat([root.segments[0].accum])[0]
      segs = [s.accum for s in full.segments if s.end >= 0]
      h_tool[p] = stat(segs).mean() if segs else h_root[p]
    return h_root, h_tool

  # ------------------------------------------------------------------------------------------------ records
  def _seed(self, run: _Run, index: int) -> int:
    return (run.seed * 1_000_003 + index * 92_821 + run.restarts[index] * 7_919 + 17) % (2**31 - 1)

  def _new_record(self, run, p, kind, prompt, first_round, *, max_len=None, max_calls=None):
    rec = TrajectoryRecord(
      index=run.records.next_index,
      prompt=p,
      kind=kind,
      prompt_tokens=prompt,
      first_round=first_round,
      max_response_len=max_len or self.config.max_response_len,
      max_tool_calls=self.config.max_tool_calls if max_calls is None else max_calls,
      seed=0,
      call_state=self._new_call_state(),
      version_marks=[(0, run.version)],
    )
    rec.seed = self._seed(run, rec.index)
    run.records.append(rec)
    run.queue.append(rec.index)
    if kind != "probe":
      run.counts_p[p] += 1
    return rec

  def _new_call_state(self):
    from aepo_jax.tools import CallState

    return CallState()

  def _end(self, rec, reason: str) -> None:
    rec.done, rec.stop_reason = True, reason
    rec.end_round = rec.segments[-1].round if rec.segments else rec.first_round
    if self._on_finished is not None and rec.kind != "probe":
      self._on_finished()

  def _call_budget(self, rec) -> int:
    """Tokens the next generation call may sample: the trajectory's room, capped per call when configured."""
    cap = self.config.max_tokens_per_call
    return min(rec.room, cap) if cap else rec.room

  def _start_segment(self, rec) -> None:
    rec.segments.append(Segment(round=rec.first_round + len(rec.segments), start=rec.response_len))

  # ------------------------------------------------------------------------------------------------ driving
  def _drive(self, run: _Run, policy: RolloutPolicy, until: Optional[Callable] = None) -> None:
    """Decode, run tools and close rounds until every trajectory is finished, or until `until(run)` holds
    (partial rollouts: the slots and the KV cache are then kept, to go on in the next call)."""
    while True:
      if self._should_stop is not None and self._should_stop():
        self._release(run, list(run.slot_rec))
        run.state = run.params = None
        raise RolloutInterrupted(
          f"rollout interrupted in round {run.round} after {run.decoded_tokens} sampled tokens "
          f"({sum(r.done for r in run.records)} of {len(run.records)} trajectories finished)."
        )
      run.page_blocked = False
      self._unstall(run)
      self._admit(run)
      self._resume(run)
      run.iteration += 1
      if run.decoding:
        self._decode_chunk(run)
      elif run.futures and self.config.tool_results == "when_ready":
        concurrent.futures.wait(
          [f for f, _, _ in run.futures.values()],
          timeout=self.config.tool_poll_s,
          return_when=concurrent.futures.FIRST_COMPLETED,
        )
      self._collect_tools(run)
      if self.config.sample_timeout_s:
        self._expire(run)
      while self._round_closed(run):
        if not self._end_round(run, policy):
          self._release(run, list(run.slot_rec))
          return
      if until is not None and until(run):
        return
      if not run.decoding and not run.futures and (run.stalled or run.page_blocked):
        self._preempt(run)  # every slot waits for pages that only a preempted trajectory can free
      elif not run.decoding and not run.futures and not self._progress_possible(run):
        self._evict_paused(run)

  def _next_round(self, rec) -> int:
    return rec.first_round + len(rec.segments)

  def _may_start(self, run, rec) -> bool:
    if rec.index in run.seg_resume:  # preempted mid-segment: its round is already open
      return True
    return self._next_round(rec) <= self._clock(run, rec) + (1 if self.config.lookahead else 0)

  def _admit(self, run: _Run) -> None:
    ready = [i for i in run.queue if self._may_start(run, run.records[i])]
    if not ready:
      return
    if len(ready) > len(run.free):  # free slots held by finished trajectories (kept for possible forks)
      self._release(run, [s for s, i in run.slot_rec.items() if run.records[i].done][: len(ready) - len(run.free)])
    take = ready[: len(run.free)]
    if self._paged():  # only as many as the free pages hold, beyond those reserved for the slots already running
      free, fit = self._spare_pages(run), 0
      for i in take:  # its tokens' pages and the page of its first decode write
        free -= self._pages_for(len(run.records[i].prompt_tokens) + run.records[i].response_len + 1)
        if free < 0:
          run.page_blocked = True
          break
        fit += 1
      take = take[:fit]
    if not take:
      return
    slots = [run.free.pop(0) for _ in take]
    recs = [run.records[i] for i in take]
    for i in take:
      run.queue.remove(i)
    added = self._fork_refills(run, slots, recs)  # fresh samples of a prompt another slot holds: forked
    if added:
      run.state = self.engine.add(
        run.params,
        run.state,
        [s for s, _ in added],
        [r.prompt_tokens + r.tokens for _, r in added],
        [self._seed(run, r.index) for _, r in added],
        [self._resume_budget(r, run) if r.index in run.seg_resume else self._call_budget(r) for _, r in added],
      )
    resumed = []
    for s, r in added:
      r.slot, r.device_len = s, r.response_len
      run.slot_rec[s] = r.index
      if r.index in run.seg_resume:  # preempted mid-segment: the same segment goes on
        resumed.append((s, run.seg_resume.pop(r.index)))
      else:
        self._start_segment(r)
      run.decoding.add(s)
    if resumed:
      run.state = self.engine.set_segment(run.state, [s for s, _ in resumed], [snap for _, snap in resumed])

  def _resume(self, run: _Run) -> None:
    """Extends paused slots with their tool results (already on the host record) when the round allows."""
    recs = [run.records[i] for i in run.slot_rec.values()]
    recs = [
      r
      for r in recs
      if not r.done
      and r.slot not in run.decoding
      and r.index not in run.futures
      and r.device_len < r.response_len
      and self._may_start(run, r)
    ]
    if recs and self._paged():
      free, fit = self._spare_pages(run), []
      for r in recs:
        p0 = len(r.prompt_tokens)
        free -= self._pages_for(p0 + r.response_len + 1) - self._pages_for(p0 + r.device_len)
        if free < 0:
          run.page_blocked = True
          break
        fit.append(r)
      recs = fit
    if not recs:
      return
    run.state = self.engine.extend(
      run.params,
      run.state,
      [r.slot for r in recs],
      [r.tokens[r.device_len :] for r in recs],
      [self._call_budget(r) for r in recs],
    )
    for r in recs:
      r.device_len = r.response_len
      self._start_segment(r)
      run.decoding.add(r.slot)

  def _decode_chunk(self, run: _Run) -> None:
    order = {"order": self._decode_order(run)} if getattr(self.engine, "max_decode_rows", 0) else {}
    t0 = time.monotonic()
    run.state, out = self.engine.decode(run.params, run.state, self.config.chunk_steps, **order)
    tok, lp, ent, valid = jax.device_get((out.token, out.logprob, out.entropy, out.valid))
    run.note_chunk(t0, valid)
    info = self.engine.host_info(run.state)
    run.decoded_tokens += int(valid.sum())
    run.slot_steps += int(valid.shape[0]) * int(valid.shape[1])
    stopped, cuts = [], []
    now = time.monotonic()
    for s in sorted(run.decoding):
      rec = run.records[run.slot_rec[s]]
      if not rec.started:  # its clock (sample_timeout_s) starts once its first chunk is out: compiles excluded
        rec.started = now
      v = np.asarray(valid[s], bool)
      rec.append(tok[s][v], lp[s][v], ent[s][v], mask=1)
      rec.device_len = rec.response_len
      cut = self._missed_stop(rec, tok[s][v], int(info["stop_reason"][s]))
      if cut is not None:
        cuts.append((s, cut))
      elif not info["active"][s] and info["stop_reason"][s] != st.RUNNING:
        stopped.append((s, int(info["stop_reason"][s])))
    if cuts:  # a stop string the device's token sequences missed: rewind the slot to just after it
      run.state = self.engine.truncate(
        run.state, [s for s, _ in cuts], [len(run.records[run.slot_rec[s]].prompt_tokens) + c for s, c in cuts]
      )
      info = self.engine.host_info(run.state)
      for s, c in cuts:
        rec = run.records[run.slot_rec[s]]
        rec.truncate(c)
        rec.device_len = c
        stopped.append((s, st.STOP_SEQUENCE))
    for s, reason in stopped:
      rec = run.records[run.slot_rec[s]]
      run.decoding.discard(s)
      if reason == st.STOP_NO_PAGES:  # paused mid-segment until pages are free (_unstall) or preempted
        run.stalled.add(s)
        run.stall_events += 1
        continue
      seg = rec.segments[-1]
      seg.end = rec.response_len
      seg.accum = (int(info["seg_count"][s]), float(info["seg_entropy_sum"][s]), float(info["seg_topk_entropy_sum"][s]))
      if rec.initial_accum is None:  # corrected mode's H_initial: the first segment (a branch inherits it)
        rec.initial_accum = seg.accum
      self._on_stop(run, rec, reason)

  def _missed_stop(self, rec, new_tokens, reason: int) -> Optional[int]:
    """Response offset just after the first tool closing tag of the open segment, when the device did not stop
    there (its stop sequences cover the usual tokenizations only; contract: StopStringChecker)."""
    if self.stop_checker is None or not self.stop_checker.has_candidate(new_tokens):
      return None
    seg = rec.segments[-1]
    k = self.stop_checker.first_stop(rec.tokens[seg.start :])
    if k is None or (reason == st.STOP_SEQUENCE and seg.start + k == rec.response_len):
      return None
    return seg.start + k

  def _on_stop(self, run: _Run, rec, reason: int) -> None:
    seg = rec.segments[-1]
    if reason == st.STOP_SEQUENCE:
      # Like the official rollout, parse the last <tag>...</tag> of the whole sequence (the opening tag may sit
      # in the prompt when a caller prefills it). Decoded for parsing only; nothing is re-encoded.
      text = self.tokenizer.decode(rec.prompt_tokens + rec.tokens[: seg.end])
      call = self._parse(text, self.tool_tags)
      if call is None or not text.rstrip().endswith(f"</{call.tag}>"):  # e.g. a configured '</answer>' stop
        return self._end(rec, "stop_sequence")
      if rec.num_tool_calls >= rec.max_tool_calls:
        return self._limit(rec)
      seg.tool_pending = True
      steps = (
        self._steps(rec.tokens, rec.loss_mask, self.tokenizer.decode) if self.tools.wants_trajectory(call.tag) else None
      )
      future = self.tools.submit(call, rec.call_state, trajectory=steps)
      run.futures[rec.index] = (future, run.decoded_tokens, run.iteration)
      return None
    if reason == st.STOP_EOS:
      return self._end(rec, "eos")
    if reason == st.STOP_BUDGET and self.config.max_tokens_per_call and rec.room > 0:  # the call's cap, not L
      if self._continue_call(run, rec):
        return None
      return self._end(rec, "call_tokens")
    return self._end(rec, "length" if reason == st.STOP_BUDGET else st.STOP_REASON_NAMES.get(reason, str(reason)))

  def _continue_call(self, run: _Run, rec) -> bool:
    """max_calls_per_turn > 1: a call that reached its cap goes on with a fresh cap (the same segment, the same
    slot), unless the turn has used its calls or written `</answer>` (official `call_local_llm`)."""
    n = self.config.max_calls_per_turn
    if n <= 1:
      return False
    seg = rec.segments[-1]
    turn, calls, _ = run.turn_calls.get(rec.index, (len(rec.segments), 1, seg.start))
    if turn != len(rec.segments):
      calls = 1
    if calls >= n or "</answer>" in self.tokenizer.decode(rec.tokens[seg.start :]):
      return False
    run.turn_calls[rec.index] = (len(rec.segments), calls + 1, rec.response_len)
    seg.end = -1  # the segment (the turn) stays open: its round is not done
    run.state = self.engine.extend(run.params, run.state, [rec.slot], [[]], [self._call_budget(rec)])
    run.decoding.add(rec.slot)
    return True

  def _limit(self, rec) -> None:
    """A call over the limit: append EOS (mask 1) and end (training, spec §1.2 2.3)."""
    if rec.room > 0:
      rec.append([self.eos_id], mask=1)
    self._end(rec, "call_limit")

  def _due_tools(self, run: _Run) -> list:
    """The calls whose results enter now (AgentConfig.tool_results): 'when_ready' those done; 'next_chunk' those
    submitted in an earlier iteration of the loop (so after the decode chunk that followed them), waited for."""
    if self.config.tool_results == "when_ready":
      return [i for i, (f, _, _) in run.futures.items() if f.done()]
    due = [i for i, (_, _, it) in run.futures.items() if it < run.iteration]
    pending = [run.futures[i][0] for i in due]
    while pending:
      pending = list(concurrent.futures.wait(pending, timeout=0.5).not_done)
      if pending and self._should_stop is not None and self._should_stop():
        return []  # the loop raises RolloutInterrupted at its next check
    return due

  def _collect_tools(self, run: _Run) -> None:
    for idx in self._due_tools(run):
      fut, at, _ = run.futures.pop(idx)
      run.tool_overlap.append(run.decoded_tokens - at)
      rec, out = run.records[idx], fut.result()
      seg = rec.segments[-1]
      seg.tool_pending = False
      if out.info.get("limit_reached"):
        self._limit(rec)
        continue
      if out.info.get("empty_call"):  # the official rollout ends the copy silently (spec §1.2 2.3)
        self._end(rec, "empty_tool_call")
        continue
      rec.num_tool_calls += 1
      rec.tool_failures += int(not out.ok)
      result = self._format(out.text, self.config.result_mode, self.result_tags.get(out.tag, "result"))
      ids = _encode(self.tokenizer, result)
      truncated = len(ids) >= rec.room
      rec.append(ids[: rec.room], mask=0)
      seg.result_end, seg.calls_after, seg.call_state = rec.response_len, rec.num_tool_calls, rec.call_state.copy()
      if truncated:  # no room left to generate: truncated at L (spec §1.2 step 4)
        self._end(rec, "length")

  # ------------------------------------------------------------------------------------------------ stats
  def _stats(self, run: _Run, records, policy: RolloutPolicy) -> dict:
    return run.stats(records, policy, self.engine.config.vocab_size, paged=self._paged())
