"""The same answers scored under both protocols (`eval.rescore`, `launch/evaluate.py --rescore`): generation fields
kept, every scoring field the new scorer's, and the table of where the two disagree."""

import json
import os

import pytest

from aepo_jax import eval as eval_lib
from aepo_jax.eval import Scorer
from aepo_jax.data import Example

# math answers where the two scorers disagree (docs/evaluation.md): AIME's leading zero and a trailing ".0"
ANSWERS = [
  ("aime24:1", "025", "<answer> \\boxed{25} </answer>"),  # equal by value; the official compares strings
  ("aime24:2", "9", "<answer> \\boxed{9.0} </answer>"),
  ("aime24:3", "204", "<answer> \\boxed{204} </answer>"),  # both right
  ("aime24:4", "7", "<answer> \\boxed{8} </answer>"),  # both wrong
  ("aime24:5", "12", "ran out of time"),  # timed out: the prediction is "Timeout"
]


def _run_dir(tmp_path):
  out = str(tmp_path / "project")
  os.makedirs(out)
  scorer = Scorer(protocol="project")
  records = []
  for i, (qid, gold, response) in enumerate(ANSWERS):
    ex = Example(id=qid, question=f"question {i}", answers=[gold], source="aime24", family="math")
    timeout = "time" in response
    rec = {
      "benchmark": "aime24",
      "id": qid,
      "sample": 0,
      "family": "math",
      "question": ex.question,
      "answers": [gold],
      "response": response,
      "tool_calls": [],
      "stop_reason": "timeout" if timeout else "eos",
      "prompt_len": 10,
      "response_len": 5,
      "num_tool_calls": 0,
      "seconds": 0.5,
    }
    rec.update(scorer.score(ex, response, "Timeout") if timeout else scorer.score(ex, response))
    records.append(rec)
  with open(os.path.join(out, "aime24.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  eval_lib.write_summary(out, {"aime24": records}, ks=[1], families={"aime24": "math"}, meta={"protocol": "project"})
  return out, records


def test_rescore_keeps_the_answers_and_replaces_every_score(tmp_path):
  run, before = _run_dir(tmp_path)
  out = str(tmp_path / "official")
  summary = eval_lib.rescore(run, out, protocol="official")
  after = eval_lib.read_records(os.path.join(out, "aime24.jsonl"))
  assert [r["response"] for r in after] == [r["response"] for r in before]
  assert all(r["protocol"] == "official" and "math_equal" in r and "acc" in r for r in after)
  assert [r["correct"] for r in before] == [True, True, True, False, False]
  assert [r["correct"] for r in after] == [False, False, True, False, False]
  assert after[4]["prediction"] == "Timeout"
  assert summary["protocol"] == "official" and summary["source_protocol"] == "project"
  assert summary["benchmarks"]["aime24"]["pass@1"] == pytest.approx(0.2)
  table = eval_lib.protocol_differences(run, out)
  assert "| aime24 | 5 | 0.600 | 0.200 | 2 | 0 |" in table, table
  rows = eval_lib.disagreements(run, out)
  assert [(r["id"], r["a"]["correct"], r["b"]["correct"]) for r in rows] == [
    ("aime24:1", True, False),
    ("aime24:2", True, False),
  ]


def test_rescore_refuses_to_overwrite_and_other_answers(tmp_path):
  run, _ = _run_dir(tmp_path)
  with pytest.raises(ValueError, match="give a new directory"):
    eval_lib.rescore(run, run, protocol="official")
  other = str(tmp_path / "other")
  eval_lib.rescore(run, other, protocol="official")
  path = os.path.join(other, "aime24.jsonl")
  lines = open(path).read().splitlines()
  changed = json.loads(lines[0])
  changed["response"] = "something else"
  with open(path, "w") as f:
    f.write("\n".join([json.dumps(changed)] + lines[1:]) + "\n")
  with pytest.raises(ValueError, match="different answers"):
    eval_lib.protocol_differences(run, other)


def test_the_command_line_rescores(tmp_path, capsys):
  import sys

  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "launch"))
  import evaluate as cli

  run, _ = _run_dir(tmp_path)
  assert cli.main([f"--rescore={run}", "--protocol=official", "--noprogress"]) == 0
  printed = capsys.readouterr().out
  assert "only project" in printed and os.path.isfile(f"{run}_official/summary.json")
  assert cli.main([f"--rescore={tmp_path / 'missing'}", "--protocol=official"]) == 2
