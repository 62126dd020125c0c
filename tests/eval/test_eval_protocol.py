"""The evaluation protocol on the real engine (spec §2.5 / §4), driven by scripted tiny policies:
per-tool limits with the official refusal text (the model continues), `<result>{text}</result>` formatting,
answer extraction and scoring, the per-example record, and the stop sequences of the tool tags."""
import json

from aepo_jax.eval import Evaluator, Policy, Scorer, tool_calls_from_text, tool_stop_sequences
from aepo_jax.tools import PYTHON_LIMIT_MESSAGE, ToolSet

from eval_helpers import SETTINGS, short_examples



def _evaluator(config, params, tokenizer, settings=SETTINGS, tool=lambda code: "42"):
  tools = ToolSet({"python": tool}, mode="eval", retry_count=1)
  return Evaluator(Policy(config, params, tokenizer, "scripted"), tools, Scorer(), settings, show_progress=False)


def test_stop_sequences_cover_merged_left_contexts(tokenizer):
  seqs = tool_stop_sequences(tokenizer, ["python", "search"])
  for left in ("", " ", ")", "x"):
    for tag in ("python", "search"):
      ids = tokenizer.encode_continuation(f"{left}</{tag}>")
      assert any(ids[-len(s):] == s for s in seqs), (left, tag, ids, seqs)
  for s in seqs:
    assert "</python>" in tokenizer.decode(s) or "</search>" in tokenizer.decode(s)


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
  assert len(on_disk) == 6 and all(set(d) >= {"question", "response", "tool_calls", "extracted", "score", "scorer"}
                                   for d in on_disk)


def test_calls_beyond_the_python_limit_get_the_refusal_and_the_model_continues(tiny_config, scripted, tokenizer,
                                                                              tmp_path):
  calls = []
  ev = _evaluator(tiny_config, scripted["loop"], tokenizer, tool=lambda code: calls.append(code) or "42")
  rec = ev.run("toy", short_examples(1), str(tmp_path / "loop.jsonl"))[0]
  parsed = tool_calls_from_text(rec["response"])
  results = [c["result"] for c in parsed]
  assert results[:5] == ["42"] * 5                         # spec §2.5: at most 5 python calls run
  assert len(results) >= 6 and set(results[5:]) == {PYTHON_LIMIT_MESSAGE}  # then refusals, not the end
  assert len(calls) == 2 * 5                               # two samples, five real calls each
  assert rec["stop_reason"] == "length" and rec["response_len"] == SETTINGS.max_response_len
  assert rec["score"] == 0.0 and rec["extracted"] == ""


def test_a_prompt_longer_than_the_limit_is_recorded_wrong_not_dropped(tiny_config, scripted, tokenizer, tmp_path):
  ev = _evaluator(tiny_config, scripted["answer"], tokenizer)
  long = short_examples(1)[0].__class__("toy:long", "many words " * 200, ["18"], "toy", "math")
  recs = ev.run("toy", [long] + short_examples(1), str(tmp_path / "long.jsonl"))
  assert [r["stop_reason"] for r in recs] == ["prompt_too_long"] * 2 + ["eos"] * 2
  assert [r["score"] for r in recs] == [0.0, 0.0, 1.0, 1.0]


def test_trainer_validation_hook(tiny_config, scripted, tokenizer):
  """aepo_jax.eval.evaluate: what train/_wiring.evaluate calls (greedy, n = 1, accuracy)."""
  from aepo_jax.eval import evaluate
  from aepo_jax.train import base_config
  config = base_config()
  config.unlock()
  config.rollout.max_prompt_len, config.rollout.max_response_len = 256, 200
  config.rollout.max_slots, config.rollout.decode_chunk, config.data.template = 4, 8, "compact"
  tools = ToolSet({"python": lambda code: "42"}, mode="eval", retry_count=1)
  exs = short_examples(4)
  out = evaluate(config, tiny_config, scripted["answer"], tokenizer, exs, tools=tools)
  assert out == {"accuracy": 1.0, "num_examples": 4.0}
  wrong = short_examples(4, answer="19")
  assert evaluate(config, tiny_config, scripted["answer"], tokenizer, wrong, tools=tools)["accuracy"] == 0.0
