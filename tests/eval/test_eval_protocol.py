"""The evaluation protocol on the real engine (spec §2.5 / §4), driven by scripted tiny policies:
per-tool limits with the official refusal text (the model continues), `<result>{text}</result>` formatting,
answer extraction and scoring, the per-example record, and the stop sequences of the tool tags."""

import dataclasses
import json

import pytest

from aepo_jax.eval import Evaluator, Policy, Scorer, tool_calls_from_text
from aepo_jax.tools import PYTHON_LIMIT_MESSAGE, ToolSet

from eval_helpers import SETTINGS, short_examples


def _evaluator(config, params, tokenizer, settings=SETTINGS, tool=lambda code: "42"):
  tools = ToolSet({"python": tool}, mode="eval", retry_count=1)
  return Evaluator(Policy(config, params, tokenizer, "scripted"), tools, Scorer(), settings, show_progress=False)


def test_stop_sequences_cover_merged_left_contexts(tiny_config, tiny_params, tokenizer):
  tools = ToolSet({"python": lambda code: "42", "search": lambda query: "none"}, mode="eval", retry_count=1)
  ev = Evaluator(Policy(tiny_config, tiny_params, tokenizer, "t"), tools, Scorer(), SETTINGS, show_progress=False)
  seqs = [list(s) for s in ev.rollouts.engine.stop_sequences]
  for left in ("", " ", ")", "x"):
    for tag in ("python", "search"):
      ids = tokenizer.encode_continuation(f"{left}</{tag}>")
      assert any(ids[-len(s) :] == s for s in seqs), (left, tag, ids, seqs)
  for s in seqs:
    assert "</python>" in tokenizer.decode(s) or "</search>" in tokenizer.decode(s)
  assert ev.rollouts.engine.eos_ids[0] == tokenizer.eos_id  # the tokenizer's end of turn first, then the model's


def test_one_tool_call_then_correct_answer_is_scored(tiny_config, scripted, tokenizer, tmp_path):
  ev = _evaluator(tiny_config, scripted["answer"], tokenizer)
  recs = ev.run("toy", short_examples(3), str(tmp_path / "toy.jsonl"))
  assert [(r["id"], r["sample"]) for r in recs] == [(f"toy:{i}", k) for i in range(3) for k in range(2)]
  for r in recs:
    # Eval formatting: no newlines inside the result tags, unlike training's " <result>\n..\n</result>".
    assert r["response"].startswith("<python>1</python><result>42</result><answer>\\boxed{18}</answer>"), r["response"]
    assert r["stop_reason"] == "eos"
    assert r["tool_calls"] == [{"tool": "python", "input": "1", "result": "42"}]
    assert r["num_tool_calls"] == 1
    assert (r["extracted"], r["correct"], r["score"], r["scorer"]) == ("18", True, 1.0, "math_verify")
  on_disk = [json.loads(line) for line in open(tmp_path / "toy.jsonl")]
  assert len(on_disk) == 6 and all(
    set(d) >= {"question", "response", "tool_calls", "extracted", "score", "scorer"} for d in on_disk
  )


def test_calls_beyond_the_python_limit_get_the_refusal_and_the_model_continues(
  tiny_config, scripted, tokenizer, tmp_path
):
  calls = []
  ev = _evaluator(tiny_config, scripted["loop"], tokenizer, tool=lambda code: calls.append(code) or "42")
  rec = ev.run("toy", short_examples(1), str(tmp_path / "loop.jsonl"))[0]
  parsed = tool_calls_from_text(rec["response"])
  results = [c["result"] for c in parsed]
  assert results[:5] == ["42"] * 5  # spec §2.5: at most 5 python calls run
  assert len(results) >= 6 and set(results[5:]) == {PYTHON_LIMIT_MESSAGE}  # then refusals, not the end
  assert len(calls) == 2 * 5  # two samples, five real calls each
  assert rec["stop_reason"] == "length" and rec["response_len"] == SETTINGS.max_response_len
  assert rec["score"] == 0.0 and rec["extracted"] == ""


def test_a_prompt_longer_than_the_limit_is_recorded_wrong_not_dropped(tiny_config, scripted, tokenizer, tmp_path):
  ev = _evaluator(tiny_config, scripted["answer"], tokenizer)
  long = short_examples(1)[0].__class__("toy:long", "many words " * 200, ["18"], "toy", "math")
  recs = ev.run("toy", [long] + short_examples(1), str(tmp_path / "long.jsonl"))
  assert [r["stop_reason"] for r in recs] == ["prompt_too_long"] * 2 + ["eos"] * 2
  assert [r["score"] for r in recs] == [0.0, 0.0, 1.0, 1.0]


def test_trainer_validation_metrics(tiny_config, scripted, tokenizer):
  """aepo_jax.eval.evaluate, what train/_validation.evaluate calls: per-source accuracy, reward and tool calls."""
  from aepo_jax.eval import evaluate

  one = dataclasses.replace(SETTINGS, n=1)
  ev = _evaluator(tiny_config, scripted["answer"], tokenizer, settings=one)
  out = evaluate(ev, {"toy": short_examples(4), "wrong": short_examples(2, answer="19")})
  assert out["eval/toy/accuracy"] == 1.0 and out["eval/wrong/accuracy"] == 0.0
  assert out["eval/toy/tool_calls"] == out["eval/wrong/tool_calls"] == 1.0
  assert out["eval/accuracy"] == 0.5
  assert sorted(out) == ["eval/accuracy"] + [
    f"eval/{n}/{k}" for n in ("toy", "wrong") for k in ("accuracy", "reward", "tool_calls")
  ]


def test_validation_on_hosts_answers_its_share_and_sums_over_hosts(monkeypatch):
  """Host 1 of 2 answers examples 1, 3, 5 of the source; the allgather adds host 0's sums."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  from aepo_jax.eval import evaluate

  class Answers:  # an Evaluator that answers 18 to every question, with one tool call
    def __init__(self):
      self.seen = []

    def run(self, name, examples, path=None):
      self.seen += [ex.id for ex in examples]
      return [
        {
          "id": ex.id,
          "answers": list(ex.answers),
          "score": 1.0,
          "num_tool_calls": 1,
          "response": "<answer>\\boxed{18}</answer>",
        }
        for ex in examples
      ]

  host0 = np.asarray([3.0, 0.0, 0.0, 3.0])  # three answers, none right, three tool calls
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.stack([host0, x]))
  ev = Answers()
  out = evaluate(ev, {"toy": short_examples(6)})
  assert ev.seen == ["toy:1", "toy:3", "toy:5"]
  assert out["eval/toy/accuracy"] == out["eval/accuracy"] == 0.5
  assert out["eval/toy/tool_calls"] == 1.0


def test_official_continuation_on_the_real_engine(tiny_config, scripted, tokenizer):
  """A per-call cap far below the answer: without continuation the first call's cap ends it; with the official
  continuation (up to 4 calls per turn) the same greedy text goes on, one cap at a time."""
  capped = dataclasses.replace(SETTINGS, n=1, max_tokens_per_call=2)
  one = _evaluator(tiny_config, scripted["answer"], tokenizer, settings=capped).run("toy", short_examples(1))[0]
  cont = dataclasses.replace(capped, protocol="official", max_calls_per_turn=4)
  tools = ToolSet({"python": lambda code: "42"}, mode="eval", retry_count=1)
  ev = Evaluator(
    Policy(tiny_config, scripted["answer"], tokenizer, "scripted"),
    tools,
    Scorer(protocol="official"),
    cont,
    show_progress=False,
  )
  four = ev.run("toy", short_examples(1))[0]
  # "<python>1" fills the first call's cap of 2 tokens: without continuation the trajectory ends there
  assert (one["response"], one["stop_reason"], one["score"]) == ("<python>1", "call_tokens", 0.0)
  # with it, "</python>" closes in the second call, the tool runs, the answer turn is continued the same way
  assert four["response"].startswith("<python>1</python><result>42</result><answer>\\boxed{18}</answer>")
  assert (four["stop_reason"], four["score"], four["protocol"], four["python_calls"]) == ("eos", 1.0, "official", 1)


def test_sampled_validation_reports_pass_at_k_per_question_and_over_hosts(monkeypatch):
  """k = 3 samples per question: pass@1 = mean score, pass@3 = share of questions with a correct sample; host 1 of 2
  answers its questions' samples, the allgather adds host 0's sums (questions, pass@1 sum, pass@3 sum, calls)."""
  import types

  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  from aepo_jax.eval import evaluate

  scores = {"toy:1": [1, 0, 0], "toy:3": [1, 1, 1], "toy:5": [0, 0, 0]}

  class Samples:
    settings = types.SimpleNamespace(n=3)

    def run(self, name, examples, path=None):
      return [
        {"id": ex.id, "sample": j, "answers": list(ex.answers), "score": float(s), "num_tool_calls": 2, "response": ""}
        for ex in examples
        for j, s in enumerate(scores[ex.id])
      ]

  host0 = np.asarray([3.0, 1.0, 2.0, 3.0])  # three questions: pass@1 sum 1.0, pass@3 sum 2, one call per answer
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.stack([host0, x]))
  out = evaluate(Samples(), {"toy": short_examples(6)})
  # host 1: pass@1 = (1/3 + 1 + 0) = 4/3, pass@3 = 2 of 3, calls 2 per answer over 3 questions
  assert np.isclose(out["eval/toy/pass@1"], (1.0 + 4 / 3) / 6)
  assert np.isclose(out["eval/toy/pass@3"], (2 + 2) / 6)
  assert np.isclose(out["eval/toy/tool_calls"], (3 + 6) / 6)
  assert out["eval/pass@3"] == out["eval/toy/pass@3"] and "eval/accuracy" not in out


def test_pass_at_k_on_the_real_engine(tiny_config, scripted, tokenizer):
  """Two samples per question through the real engine: the scripted right answer passes at 1 and 2, the wrong at
  neither; each sample's answer is its own record."""
  from aepo_jax.eval import evaluate

  two = dataclasses.replace(SETTINGS, n=2)
  ev = _evaluator(tiny_config, scripted["answer"], tokenizer, settings=two)
  out = evaluate(ev, {"toy": short_examples(2), "wrong": short_examples(2, answer="19")})
  assert out["eval/toy/pass@1"] == out["eval/toy/pass@2"] == 1.0
  assert out["eval/wrong/pass@1"] == out["eval/wrong/pass@2"] == 0.0
  assert out["eval/pass@2"] == 0.5 and out["eval/toy/tool_calls"] == 1.0


@pytest.mark.parametrize("protocol", ["project", "official"])
def test_an_answer_past_the_sample_timeout_is_recorded_as_the_official_timeout(
  tiny_config, scripted, tokenizer, protocol
):
  """EvalSettings.sample_timeout_s on the real engine: a tool that hangs past the limit ends the answer where it
  stands (stop reason 'timeout', the tool abandoned: the evaluation returns while the call still blocks), the text
  gets the official marker and the prediction is "Timeout" (wrong); the same answers with a fast tool and a limit
  they stay within are unaffected."""
  import threading

  release, running = threading.Event(), []

  def hangs(code):  # blocks until the test releases it: returning while it blocks proves it was abandoned
    running.append(code)
    release.wait(300)
    return "42"

  limit = dataclasses.replace(SETTINGS, n=1, sample_timeout_s=1.0, protocol=protocol)
  ev = _evaluator(tiny_config, scripted["answer"], tokenizer, settings=limit, tool=hangs)
  try:
    recs = ev.run("toy", short_examples(2))
    assert running and not release.is_set()  # the calls were made and are still blocked: nothing waited for them
  finally:
    release.set()
  for r in recs:
    assert r["stop_reason"] == "timeout"
    assert r["response"].startswith("<python>1</python>") and r["response"].endswith("\n[Timeout (exceeding 1s)]")
    assert r["score"] == 0.0 and not r["correct"]
    assert r["extracted"] == "Timeout" or r.get("prediction") == "Timeout"
  # A limit the answers stay within changes nothing (not 1 s: the engine's later programs compile within the clock).
  roomy = dataclasses.replace(limit, sample_timeout_s=300.0)
  fast = _evaluator(tiny_config, scripted["answer"], tokenizer, settings=roomy)
  assert all(r["stop_reason"] == "eos" and r["score"] == 1.0 for r in fast.run("toy", short_examples(2)))


def test_the_command_line_applies_the_official_timeout_by_default():
  import importlib.util
  import os

  path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "launch")
  spec = importlib.util.spec_from_file_location("launch_evaluate", os.path.join(path, "evaluate.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  assert mod.sample_timeout(None, "official") == 1500.0 and mod.sample_timeout(None, "project") == 0.0
  assert mod.sample_timeout(30, "official") == 30.0 and mod.sample_timeout(0, "official") == 0.0
