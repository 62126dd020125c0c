"""Partial rollouts (train.max_staleness > 0) on the REAL engine with a tiny random Llama: groups carried over between
calls come back complete, with exact sampling log-probs, at most max_staleness versions old, oldest first."""

import numpy as np
import pytest
from test_agent_engine import PROMPTS, _loop, _paged_loop, check_trajectories, params  # noqa: F401 (fixture)

from aepo_jax.rollout import PartialRollouts, RolloutInterrupted, TrajectoryRecord
from aepo_jax.rollout._agent_run import occupancy_profile
from aepo_jax.rollout.policies import rollout_policy


def _calls(partial, params, versions):
  out = []
  for v in versions:
    k = partial.wanted()
    assert k == (partial.capacity if v == versions[0] else partial.groups_per_call)
    payloads = [(v, i) for i in range(k)]  # (version it was given at, position)
    out.append((v, *partial(params, (PROMPTS * k)[:k], payloads, version=v, seed=11 + v)))
  return out


@pytest.mark.parametrize("layout", ["dense", pytest.param("paged", marks=pytest.mark.slow)])
def test_carried_groups_come_back_complete_exact_and_within_the_bound(params, layout):  # noqa: F811
  loop = _loop() if layout == "dense" else _paged_loop(num_pages=8 * 12 + 1)
  policy = rollout_policy("arpo", n=4, initial_rollouts=2, mode="corrected")
  partial = PartialRollouts(loop, policy, groups_per_call=len(PROMPTS), max_staleness=1)
  seen, carried, stale = [], 0, 0.0
  for v, tr, payloads, m in _calls(partial, params, range(5)):
    # Every group complete (n rows, tool results, forks), and the log-probs of carried trajectories equal a
    # teacher-forced forward: their KV cache survived the calls (the weights are the same here).
    check_trajectories(params, tr)
    assert [g for g, _ in payloads] == sorted(g for g, _ in payloads)  # oldest first
    assert all(v - g <= 1 for g, _ in payloads), (v, payloads)  # bounded staleness, by finishing first
    assert m["rollout/staleness_max"] <= 1 and m["rollout/group_age_max"] <= 1
    assert m["rollout/dropped_stale"] == 0 and 0 < m["rollout/slot_occupancy"] <= 1
    profile = [m[f"rollout/occupancy_t{10 * i:02d}"] for i in range(10)]  # this call's wall time in tenths
    assert all(0 <= x <= 1 for x in profile) and max(profile) > 0
    assert m["rollout/occupancy_wall"] == pytest.approx(np.mean(profile))
    seen += payloads
    carried = max(carried, m["rollout/carried_groups"])
    stale = max(stale, m["rollout/stale_token_fraction"])
  assert len(set(seen)) == len(seen) == 5 * len(PROMPTS)  # none handed back twice
  assert carried == len(PROMPTS) and stale > 0  # the calls really overlapped (tokens from an older version)
  assert partial.carried()[0] == len(PROMPTS) and partial.wanted() == len(PROMPTS)


def test_an_engine_running_6_rows_a_call_decodes_the_oldest_groups_first(params):  # noqa: F811
  """Engine(max_decode_rows=6) with up to 24 trajectories in 24 slots: each decode call runs 6 of them, those of the
  oldest groups first; the groups still come back complete and exact, within the bound."""
  loop = _loop(24, max_decode_rows=6)
  assert loop.engine.uses_cpu_kernels(params)
  partial = PartialRollouts(loop, rollout_policy("none", n=4, initial_rollouts=4), groups_per_call=3, max_staleness=1)
  calls = []
  real = loop.engine.decode

  def decode(p, state, steps, **kw):
    run = partial.run
    ages = [partial.groups[run.records[run.slot_rec[s]].prompt].order for s in kw["order"]]
    calls.append((ages, sorted(run.decoding)))
    active = loop.engine.host_info(state)["active"]
    first = [s for s in kw["order"] if active[s]][:6]
    state, out = real(p, state, steps, **kw)
    ran = np.flatnonzero(np.asarray(out.valid).any(1))
    assert set(ran.tolist()) <= set(first), (ran, kw["order"])
    return state, out

  loop.engine.decode = decode
  try:
    for v, tr, payloads, m in _calls(partial, params, range(3)):
      check_trajectories(params, tr)
      assert all(v - g <= 1 for g, _ in payloads) and m["rollout/staleness_max"] <= 1
  finally:
    del loop.engine.decode
  assert all(ages == sorted(ages) for ages, _ in calls)  # oldest group first
  assert max(len(d) for _, d in calls) > 6  # more decoding than the 6 rows a call runs


def test_admission_order_hands_back_the_oldest_groups_in_the_datas_order(params):  # noqa: F811
  """order='admission': each call returns exactly the groups_per_call oldest groups, in the order they were given,
  complete and exact, and it waits for them: at some point enough younger groups were complete for a
  'completion'-order call to return with them (which 'admission' removes: no bias toward short trees)."""
  loop = _loop()
  policy = rollout_policy("arpo", n=4, initial_rollouts=2, mode="corrected")
  partial = PartialRollouts(loop, policy, groups_per_call=len(PROMPTS), max_staleness=2, order="admission")
  waited, ready = [], partial._ready

  def watch(run, version):
    done = partial._complete(run)
    waited.append(len(done) >= partial.groups_per_call and not set(partial._oldest(partial.groups)) <= done)
    return ready(run, version)

  partial._ready = watch
  got = []
  for v, tr, payloads, m in _calls(partial, params, range(5)):
    check_trajectories(params, tr)
    assert all(v - g <= 2 for g, _ in payloads) and m["rollout/staleness_max"] <= 2
    got += payloads
  assert got == [(0, i) for i in range(9)] + [(v, i) for v in (1, 2) for i in range(3)]  # 9 in the first call
  assert any(waited)
  with pytest.raises(ValueError, match="order='fifo'"):
    PartialRollouts(loop, policy, groups_per_call=2, max_staleness=1, order="fifo")


def test_versions_follow_the_weights(params):  # noqa: F811
  """Each call is a new policy version: the tokens of carried trajectories carry the version of the call that sampled
  them, never decreasing along a trajectory and never beyond the last call, within the staleness bound."""
  loop = _loop()
  policy = rollout_policy("none", n=4, initial_rollouts=4)
  partial = PartialRollouts(loop, policy, groups_per_call=len(PROMPTS), max_staleness=2)
  outs = _calls(partial, params, range(4))
  assert max(m["rollout/staleness_max"] for _, _, _, m in outs) <= 2
  run = partial.run
  for rec in run.records:  # the carried ones: versions never decrease along a trajectory, none beyond the last call
    vs = rec.token_versions()
    assert (np.diff(vs) >= 0).all() and (vs <= 3).all()


def test_an_interruption_drops_the_carry_and_the_next_call_starts_fresh(params):  # noqa: F811
  loop = _loop()
  partial = PartialRollouts(loop, rollout_policy("none", n=4, initial_rollouts=4), groups_per_call=3, max_staleness=1)
  _calls(partial, params, [0])
  with pytest.raises(RolloutInterrupted):  # e.g. SIGTERM: asked before the first decode chunk
    partial(params, PROMPTS, ["a", "b", "c"], version=1, should_stop=lambda: True)
  assert partial.carried() == (0, 0) and partial.wanted() == 6
  tr, payloads, _ = partial(params, PROMPTS * 2, list("defghi"), version=2, seed=3)
  assert len(payloads) == 3 and set(payloads) <= set("defghi")
  check_trajectories(params, tr)


def test_aepo_pre_monitoring_runs_for_each_calls_new_prompts(params):  # noqa: F811
  loop = _loop()
  policy = rollout_policy("aepo", n=4, initial_rollouts=2, enable_dynamic_rollouts=True)
  partial = PartialRollouts(loop, policy, groups_per_call=3, max_staleness=1)
  for _, tr, _, m in _calls(partial, params, range(3)):
    check_trajectories(params, tr)
    assert "rollout/probe_h_root" in m


def test_occupancy_profile_weights_each_chunk_by_its_overlap_with_each_tenth():
  # A call from t=0 to 10 s, profiled in 5 bins of 2 s: half the slots sampled from 1 to 3 s, all from 5 to 10 s;
  # nothing in between (prefill, tools).
  got = occupancy_profile([(1.0, 3.0, 0.5), (5.0, 10.0, 1.0)], 0.0, 10.0, bins=5)
  np.testing.assert_allclose(got, [0.25, 0.25, 0.5, 1.0, 1.0])
  assert got.mean() == pytest.approx((2 * 0.5 + 5 * 1.0) / 10)  # slot-seconds sampling / slot-seconds
  np.testing.assert_allclose(occupancy_profile([], 0.0, 4.0, bins=4), 0.0)


def test_bad_arguments_are_named():
  loop = _loop()
  with pytest.raises(ValueError, match="max_staleness=0"):
    PartialRollouts(loop, rollout_policy("none", n=4), groups_per_call=3, max_staleness=0)
  partial = PartialRollouts(loop, rollout_policy("none", n=4), groups_per_call=3, max_staleness=1)
  with pytest.raises(ValueError, match="wanted"):
    partial(None, PROMPTS, ["a", "b", "c"], version=0)


def test_record_versions_through_truncation_and_forks():
  rec = TrajectoryRecord(0, 0, "global", [1], 0, 32, 3, 0, version_marks=[(0, 0)])
  rec.append([5, 6, 7])
  rec.version_marks.append((3, 1))  # the weights changed after three tokens
  rec.append([8, 9])
  assert rec.token_versions().tolist() == [0, 0, 0, 1, 1]
  child = rec.fork(1, 4, 0, 1, lambda s: s)
  assert child.version_marks == [(0, 0), (3, 1)]
  rec.truncate(2)  # rewound into version 0's tokens: what is sampled again comes from version 1
  assert rec.token_versions().tolist() == [0, 0]
  rec.append([4])
  assert rec.token_versions().tolist() == [0, 0, 1]
  assert child.token_versions().tolist() == [0, 0, 0, 1]  # the parent's prefix, versions included


def _delayed_loop(mode: str, delay_s: float, max_slots: int = 8):
  """The loop of these tests with AgentConfig(tool_results=mode) and a tool that takes delay_s."""
  import dataclasses
  import time

  from aepo_jax.rollout import AgentLoop

  def tool(code):
    time.sleep(delay_s)
    return "2"

  base = _loop(max_slots, tool=tool)
  return AgentLoop(base.engine, base.tokenizer, base.tools, dataclasses.replace(base.config, tool_results=mode))


def _partial_run(params, mode, delay_s, calls=4):
  """Four calls of staleness-1 partial rollouts whose weights change every call (the lm_head scaled), so which
  version samples a token shows in the tokens; -> per call (payloads, tokens, version marks)."""
  loop = _delayed_loop(mode, delay_s)
  partial = PartialRollouts(
    loop, rollout_policy("arpo", n=4, initial_rollouts=2, mode="corrected"), groups_per_call=2, max_staleness=1
  )
  out = []
  for v in range(calls):
    w = dict(params, lm_head={"kernel": params["lm_head"]["kernel"] * (1.0 + 0.5 * v)})
    k = partial.wanted()
    tr, payloads, m = partial(w, (PROMPTS * k)[:k], [(v, i) for i in range(k)], version=v, seed=5)
    out.append((payloads, tr.tokens_bt.tolist(), m["rollout/staleness_mean"]))
  return out


def test_next_chunk_tool_results_make_partial_rollouts_repeat_whatever_the_tools_take(params):  # noqa: F811
  """tool_results='next_chunk': a tool result enters after the decode chunk that follows its call, so the groups
  each call hands back, their tokens and their versions are the same whether the tool answers at once or takes
  0.2 s (several chunks of this model). With 'when_ready' the slow tool changes what the calls hand back."""
  fast = _partial_run(params, "next_chunk", 0.0)
  assert _partial_run(params, "next_chunk", 0.2) == fast
  assert any(s > 0 for _, _, s in fast)  # tokens of an older version were handed back: the calls overlapped
  assert _partial_run(params, "when_ready", 0.2) != _partial_run(params, "when_ready", 0.0)


def test_the_synchronous_rollout_is_the_same_under_both_tool_result_modes(params):  # noqa: F811
  """With a slot for every trajectory (16 slots for 3 x 4), no trajectory is evicted and restarted, so the rollout
  does not depend on when results are collected, in either mode."""
  for seed in range(2):
    got = []
    for mode, delay in (("when_ready", 0.0), ("next_chunk", 0.05), ("when_ready", 0.05)):
      loop = _delayed_loop(mode, delay, max_slots=16)
      got.append(
        loop.rollout(params, PROMPTS, rollout_policy("arpo", n=4, initial_rollouts=2, mode="faithful"), seed=seed)
      )
      assert not any(loop.last_run.restarts.values())
    for tr in got[1:]:
      np.testing.assert_array_equal(tr.tokens_bt, got[0].tokens_bt)
      np.testing.assert_array_equal(tr.parent_b, got[0].parent_b)


def test_next_chunk_waits_for_a_slow_tool_but_not_past_an_interruption(params):  # noqa: F811
  """A 3 s tool under 'next_chunk': should_stop turning True while the loop waits for it ends the call within about
  the wait's 0.5 s poll, with RolloutInterrupted and the carry dropped."""
  import time

  loop = _delayed_loop("next_chunk", 3.0)
  partial = PartialRollouts(loop, rollout_policy("none", n=4, initial_rollouts=4), groups_per_call=3, max_staleness=1)
  stop_at = []

  def should_stop():
    if partial.run is not None and partial.run.futures and not stop_at:
      stop_at.append(time.monotonic())  # the first check that sees a tool call in flight
    return bool(stop_at) and time.monotonic() > stop_at[0] + 0.2

  with pytest.raises(RolloutInterrupted):
    partial(params, (PROMPTS * 2)[:6], list("abcdef"), version=0, should_stop=should_stop)
  assert stop_at and time.monotonic() - stop_at[0] < 2.0  # well before the tool's 3 s
  assert partial.carried() == (0, 0)


def test_tool_results_is_checked():
  from aepo_jax.rollout import AgentConfig

  with pytest.raises(ValueError, match="tool_results='later'"):
    AgentConfig(tool_results="later")
  with pytest.raises(ValueError, match="sample_timeout_s"):
    AgentConfig(tool_results="next_chunk", sample_timeout_s=60.0)
  AgentConfig(tool_results="next_chunk")


@pytest.mark.parametrize("staleness", [1, 2])
def test_a_ramped_run_fills_one_batch_per_call_and_trains_on_groups_the_latest_weights_started(params, staleness):  # noqa: F811
  """ramp=True: the first call admits one batch and returns it (a synchronous step); each later call admits one
  batch more than it hands back until max_staleness + 1 batches are in flight. Every call's groups were then started
  at most max_staleness calls before it, also over the first calls (without the ramp, calls 1 to k + 1 all hand back
  groups of the first call), and they come back complete and exact."""
  gpc = len(PROMPTS)
  policy = rollout_policy("arpo", n=4, initial_rollouts=2, mode="corrected")
  ramped = PartialRollouts(_loop(), policy, groups_per_call=gpc, max_staleness=staleness, ramp=True)
  wanted, started = [], []
  for v in range(5):
    k = ramped.wanted()
    wanted.append(k // gpc)
    tr, payloads, m = ramped(params, (PROMPTS * k)[:k], [(v, i) for i in range(k)], version=v, seed=11 + v)
    check_trajectories(params, tr)
    started.append(sorted({g for g, _ in payloads}))
    assert all(v - g <= staleness for g, _ in payloads) and m["rollout/staleness_max"] <= staleness
  full = [1] + [2] * staleness + [1] * (4 - staleness)  # batches admitted per call: one more than handed back
  assert wanted == full, wanted
  assert started[0] == [0] and started[1] == [1]  # call 2 trains on what the second weights started
  unfinished = sum(not r.done for r in ramped.run.records)
  assert ramped.drop() == unfinished and ramped.calls == 0 and ramped.wanted() == gpc  # a restart ramps again
  plain = PartialRollouts(_loop(), policy, groups_per_call=gpc, max_staleness=staleness)
  assert plain.wanted() == gpc * (staleness + 1)


def test_a_call_floor_keeps_decoding_past_the_ready_groups(params):  # noqa: F811
  """call_floor=1 in admission order: every call after the first samples at least the mean tokens per call before it
  unless nothing is left to decode (every group in the run complete), its groups still complete, exact, oldest first
  and within the bound; the same calls without a floor include one that returns below that mean."""

  def calls(floor):
    loop = _loop()
    policy = rollout_policy("arpo", n=4, initial_rollouts=2, mode="corrected")
    partial = PartialRollouts(
      loop, policy, groups_per_call=len(PROMPTS), max_staleness=2, order="admission", ramp=True, call_floor=floor
    )
    out, admitted = [], []
    for v in range(6):
      k = partial.wanted()
      admitted += [(v, i) for i in range(k)]
      tr, payloads, m = partial(params, (PROMPTS * k)[:k], admitted[-k:], version=v, seed=11 + v)
      assert payloads == admitted[3 * v : 3 * v + 3]  # admission order kept
      check_trajectories(params, tr)
      assert all(v - g <= 2 for g, _ in payloads) and m["rollout/staleness_max"] <= 2
      complete = partial._complete(partial.run) >= set(partial.groups)
      out.append((m["rollout/decode_tokens"], m["rollout/call_floor_tokens"], complete, payloads))
    return out

  floored = calls(1.0)
  for i, (tokens, floor, complete, _) in enumerate(floored):
    assert floor == (0.0 if i == 0 else pytest.approx(np.mean([t for t, *_ in floored[:i]])))
    assert tokens >= floor or complete, (i, tokens, floor)
  plain = calls(0.0)
  assert any(t < np.mean([x for x, *_ in plain[:i]]) for i, (t, *_) in enumerate(plain) if i)
  with pytest.raises(ValueError, match="call_floor=-0.5"):
    PartialRollouts(_loop(), rollout_policy("none", n=4), groups_per_call=3, max_staleness=1, call_floor=-0.5)
