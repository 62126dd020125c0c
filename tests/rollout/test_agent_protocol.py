"""The agent loop against the protocol of spec §2.5 and §4: the tool-result text of training and of evaluation
(and which tokens the loss sees), and the evaluation's per-generation-call token cap (vLLM max_tokens), which is
separate from the trajectory's budget: every call may sample up to the cap, a call that reaches it ends the
trajectory, unless the official continuation (`max_calls_per_turn` > 1) gives the turn another call."""

import numpy as np
import pytest

from aepo_jax.rollout._agent import AgentConfig, AgentLoop
from aepo_jax.rollout.policies import rollout_policy
from test_agent_fakes import FILL, TOK, ScriptedEngine, make_tools

PROMPTS = [TOK.encode("Q1?"), TOK.encode("What is 2+2?")]


def _run(fill, cap, max_len=200, max_calls=3, result_mode="train"):
  engine = ScriptedEngine(max_slots=4, script=lambda rng, after_tool: (fill, True, 1.0))
  cfg = AgentConfig(
    max_response_len=max_len,
    max_tool_calls=max_calls,
    chunk_steps=4,
    tool_tags=("python",),
    max_tokens_per_call=cap,
    result_mode=result_mode,
  )
  loop = AgentLoop(engine, TOK, make_tools(), cfg)
  return loop.rollout(None, PROMPTS, rollout_policy("none", n=1, initial_rollouts=1), seed=0), loop


def test_calls_below_the_cap_add_up_past_it():
  # each call: 3 filler tokens + <python>1+1</python> (5 tokens) = 8 <= 10; four calls, three results, EOS
  traj, loop = _run(fill=3, cap=10)
  assert traj.stop_reason_b == ["call_limit"] * 2
  result = len(TOK.encode(" <result>\n2\n</result>"))
  assert traj.response_len_b.tolist() == [4 * 8 + 3 * result + 1] * 2  # far more than one call's cap
  for rec in loop.last_run.records:
    assert all(s.end - s.start <= 10 for s in rec.segments)


def test_a_call_that_reaches_the_cap_ends_the_trajectory():
  traj, _ = _run(fill=20, cap=10)
  assert traj.stop_reason_b == ["call_tokens"] * 2
  assert traj.response_len_b.tolist() == [10, 10]
  uncapped, _ = _run(fill=20, cap=0)  # training: only the trajectory's budget bounds a call
  assert uncapped.stop_reason_b == ["call_limit"] * 2 and min(uncapped.response_len_b) > 25


def test_the_trajectory_budget_still_applies_under_the_cap():
  traj, _ = _run(fill=3, cap=10, max_len=20)
  assert traj.stop_reason_b == ["length"] * 2 and traj.response_len_b.tolist() == [20, 20]


def test_a_negative_cap_is_refused():
  with pytest.raises(ValueError, match="max_tokens_per_call=-1"):
    AgentConfig(max_tokens_per_call=-1)


@pytest.mark.parametrize(
  "mode,text",
  [
    ("train", " <result>\n2\n</result>"),  # spec §1.2 2.4, §4
    ("eval", "<result>2</result>"),
  ],
)  # spec §2.5: no newlines
def test_tool_results_are_written_as_the_spec_says_and_get_no_loss(mode, text):
  traj, _ = _run(fill=2, cap=0, max_calls=1, result_mode=mode)
  row = traj.tokens_bt[0, traj.prompt_len_b[0] : traj.prompt_len_b[0] + traj.response_len_b[0]]
  mask = np.asarray(traj.loss_mask_bt[0, traj.prompt_len_b[0] : traj.prompt_len_b[0] + traj.response_len_b[0]])
  call = "xx<python>1+1</python>"
  assert TOK.decode(row) == call + text + call + "<eos>"  # the second call is over the limit: EOS ends it
  result = np.zeros(len(row), bool)
  result[len(TOK.encode(call)) : len(TOK.encode(call + text))] = True
  assert (mask[result] == 0).all() and (mask[~result] == 1).all()  # everything the model wrote is trained


def _run_turns(fills, cap, calls_per_turn, max_len=200):
  """One prompt; each generation call (the fake re-plans on every extend) takes the next of `fills` filler tokens
  then a python call."""
  it = iter(fills)
  engine = ScriptedEngine(max_slots=2, script=lambda rng, after_tool: (next(it, 1000), True, 1.0))
  cfg = AgentConfig(
    max_response_len=max_len,
    max_tool_calls=1,
    chunk_steps=4,
    tool_tags=("python",),
    max_tokens_per_call=cap,
    max_calls_per_turn=calls_per_turn,
    result_mode="eval",
  )
  loop = AgentLoop(engine, TOK, make_tools(), cfg)
  return loop.rollout(None, PROMPTS[:1], rollout_policy("none", n=1, initial_rollouts=1), seed=0), loop


def test_the_official_continuation_goes_on_until_a_tool_tag_closes():
  # call 1: 12 fillers > cap 10 -> continued; call 2: 3 fillers + <python>1+1</python> closes the tag: the tool runs
  traj, loop = _run_turns([12, 3], cap=10, calls_per_turn=4)
  rec = loop.last_run.records[0]
  assert rec.num_tool_calls == 1 and len(rec.segments) >= 2
  assert rec.segments[0].start == 0 and rec.segments[0].end == 10 + 8  # one turn: both calls in one segment
  # without continuation the first call's cap ends the trajectory
  traj, _ = _run_turns([12, 3], cap=10, calls_per_turn=1)
  assert traj.stop_reason_b == ["call_tokens"] and traj.response_len_b.tolist() == [10]


def test_the_continuation_stops_after_its_calls():
  traj, loop = _run_turns([20] * 10, cap=10, calls_per_turn=4)
  assert traj.stop_reason_b == ["call_tokens"] and traj.response_len_b.tolist() == [40]  # 4 calls of 10
  traj, _ = _run_turns([20] * 10, cap=10, calls_per_turn=2)
  assert traj.response_len_b.tolist() == [20]
  traj, _ = _run_turns([20] * 10, cap=10, calls_per_turn=4, max_len=25)  # the trajectory's budget still applies
  assert traj.stop_reason_b == ["length"] and traj.response_len_b.tolist() == [25]
  with pytest.raises(ValueError, match="max_calls_per_turn=0"):
    AgentConfig(max_calls_per_turn=0)


def test_no_continuation_once_the_turn_wrote_the_answer_tag():
  def run(call):
    engine = ScriptedEngine(max_slots=2, script=lambda rng, after_tool: (0, True, 1.0), call=call)
    cfg = AgentConfig(
      max_response_len=200, chunk_steps=4, tool_tags=("python",), max_tokens_per_call=10, max_calls_per_turn=4
    )
    loop = AgentLoop(engine, TOK, make_tools(), cfg)
    return loop.rollout(None, PROMPTS[:1], rollout_policy("none", n=1, initial_rollouts=1), seed=0)

  answered = run(TOK.encode("</answer>") + [FILL] * 30)
  assert answered.stop_reason_b == ["call_tokens"] and answered.response_len_b.tolist() == [10]
  going = run([FILL] * 30)
  assert going.stop_reason_b == ["call_tokens"] and going.response_len_b.tolist() == [40]
