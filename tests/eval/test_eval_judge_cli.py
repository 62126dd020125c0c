"""launch/evaluate.py --judge_url against a local OpenAI-compatible judge that answers by rule: QA answers are
scored by the judge OR math equivalence (the evaluation protocol, spec §2.5), and --nojudge_qa falls back to EM."""

import importlib.util
import json
import os
import re

import pytest

from aepo_jax.eval import read_records
from aepo_jax.testing import chat_server
from eval_helpers import save_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = {"two": "2", "eighteen": "18", "nineteen": "19"}


def _answers(body):
  prompt = body["messages"][0]["content"]
  return (
    re.search(r"Labeled Answer: (.*)", prompt).group(1).strip(),
    re.search(r"Predicted Answer: (.*)", prompt).group(1).strip(),
  )


def _rule(body):
  """ "Correct" iff the labeled and predicted answers name the same number."""
  labeled, pred = _answers(body)
  norm = lambda s: WORDS.get(s.lower(), s)
  return "Correct" if norm(labeled) == norm(pred) else "Incorrect"


def _asked(requests):
  """(model, labeled, predicted) of each judge request but the health probe (1 + 1 = 2)."""
  return [(body["model"], *_answers(body)) for body in requests if _answers(body)[1] != "2"]


@pytest.fixture()
def judge():
  with chat_server(_rule) as (url, requests):
    yield url, requests


@pytest.fixture()
def answering_ckpt(tmp_path, tiny_config, scripted, tok_dir):
  """A checkpoint of the scripted policy that calls python once and answers \\boxed{18}."""
  save_checkpoint(str(tmp_path / "run" / "checkpoints" / "rl"), tiny_config, scripted["answer"], tok_dir)
  return str(tmp_path / "run")


def _cli():
  spec = importlib.util.spec_from_file_location("evaluate_cli", os.path.join(ROOT, "launch", "evaluate.py"))
  cli = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(cli)
  return cli


def test_judge_scores_a_qa_subset(answering_ckpt, judge, tmp_path):
  judge_url, requests = judge
  qa = tmp_path / "qa.jsonl"  # the model always answers 18
  qa.write_text(
    "".join(
      json.dumps({"question": f"Question {i}?", "answer": a}) + "\n"
      for i, a in enumerate(["eighteen", ["18"], "nineteen", "Eighteen"])
    )
  )
  argv = [
    f"--checkpoint={answering_ckpt}",
    f"--benchmarks={qa}",
    "--data_family=qa",
    "--n=1",
    "--k=1",
    "--temperature=0",
    "--max_prompt_len=256",
    "--max_response_len=64",
    "--batch_size=2",
    "--template=compact",
    "--allow_unsandboxed",
    "--noprogress",
    f"--judge_url={judge_url}",
    "--judge_model=rule-judge",
    "--protocol=project",
  ]
  cli = _cli()
  assert cli.main(argv + [f"--output={tmp_path / 'judged'}"]) == 0
  recs = [r for r in read_records(str(tmp_path / "judged" / "qa.jsonl"))]
  assert [r["id"] for r in recs] == [f"qa:{i}" for i in range(1, 5)]  # JSONL lines count from 1
  assert [r["extracted"] for r in recs] == ["18"] * 4
  # the evaluation's tool-result format, without newlines (spec §2.5)
  assert all(r["response"].startswith("<python>1</python><result>1</result><answer>") for r in recs)
  assert [(r["scorer"], r["score"]) for r in recs] == [
    ("judge", 1.0),
    ("math_equal", 1.0),
    ("judge", 0.0),
    ("judge", 1.0),
  ]
  assert [r["em"] for r in recs] == [0.0, 1.0, 0.0, 0.0]  # EM is recorded, but the judge decides
  assert len(requests) == 4 and all(b["model"] == "rule-judge" for b in requests)  # 3 answers + the health probe
  assert sorted(_asked(requests)) == sorted(
    [("rule-judge", "eighteen", "18"), ("rule-judge", "nineteen", "18"), ("rule-judge", "Eighteen", "18")]
  )
  summary = json.load(open(tmp_path / "judged" / "summary.json"))
  assert summary["benchmarks"]["qa"]["pass@1"] == pytest.approx(0.75)

  del requests[:]
  assert cli.main(argv + ["--nojudge_qa", f"--output={tmp_path / 'em'}"]) == 0
  em = read_records(str(tmp_path / "em" / "qa.jsonl"))
  assert [(r["scorer"], r["score"]) for r in em] == [("em", 0.0), ("em", 1.0), ("em", 0.0), ("em", 0.0)]
  assert len(requests) == 1 and _asked(requests) == []  # only the health probe reached the judge


def test_a_judge_that_does_not_answer_fails_before_the_model_loads(answering_ckpt, tmp_path, capsys):
  qa = tmp_path / "qa.jsonl"
  qa.write_text(json.dumps({"question": "q?", "answer": "a"}) + "\n")
  assert (
    _cli().main(
      [
        f"--checkpoint={answering_ckpt}",
        f"--benchmarks={qa}",
        "--judge_url=http://127.0.0.1:9/v1",
        "--judge_model=m",
        f"--output={tmp_path / 'out'}",
      ]
    )
    == 2
  )
  assert "did not answer a health probe" in capsys.readouterr().err


def _official_rule(body):
  """The official prompt: a verbose reply that only the official (lenient) reading accepts; the health probe (the
  project's prompt) gets a plain verdict."""
  prompt = body["messages"][0]["content"]
  if "Golden Answer:" not in prompt:
    return _rule(body)
  labeled = re.search(r"Golden Answer: (.*)", prompt).group(1).strip()
  pred = re.search(r"Predicted Answer: (.*)", prompt).group(1).strip()
  norm = lambda s: WORDS.get(s.lower(), s)
  return f"<judgment>The prediction is {'Correct' if norm(labeled) == norm(pred) else 'Incorrect'}.</judgment>"


def test_official_protocol_scores_with_the_official_judge(answering_ckpt, tmp_path):
  from aepo_jax.rewards import official

  qa = tmp_path / "qa.jsonl"  # the model always answers 18
  qa.write_text(
    "".join(
      json.dumps({"question": f"Question {i}?", "answer": a}) + "\n"
      for i, a in enumerate(["eighteen", ["18"], "nineteen", "Eighteen"])
    )
  )
  with chat_server(_official_rule) as (judge_url, requests):
    argv = [
      f"--checkpoint={answering_ckpt}",
      f"--benchmarks={qa}",
      "--data_family=qa",
      "--n=1",
      "--k=1",
      "--temperature=0",
      "--max_prompt_len=256",
      "--max_response_len=64",
      "--batch_size=2",
      "--template=compact",
      "--allow_unsandboxed",
      "--noprogress",
      f"--judge_url={judge_url}",
      "--judge_model=rule-judge",
      f"--output={tmp_path / 'official'}",
    ]  # no --protocol: official is the CLI's default
    assert _cli().main(argv) == 0
    recs = read_records(str(tmp_path / "official" / "qa.jsonl"))
    official_requests = [b for b in requests if "Golden Answer:" in b["messages"][0]["content"]]
  assert {r["protocol"] for r in recs} == {"official"}
  assert [(r["scorer"], r["llm_equal"], r["score"], r["correct"]) for r in recs] == [
    ("llm_equal", 1, 1.0, True),
    ("llm_equal", 1, 1.0, True),
    ("llm_equal", 0, 0.0, False),
    ("llm_equal", 1, 1.0, True),
  ]
  assert [(r["em"], r["acc"], r["math_equal"], r["prediction"]) for r in recs] == [
    (0.0, 0, 0, "18"),
    (1.0, 1, 1, "18"),
    (0.0, 0, 0, "18"),
    (0.0, 0, 0, "18"),
  ]
  assert all(r["python_calls"] == 1 and r["tools_used"] == "python" for r in recs)
  # every valid answer is judged (the official evaluator asks before OR-ing is_equiv), with the official request
  assert len(official_requests) == 4
  assert all(sorted(b) == ["messages", "model"] for b in official_requests)
  assert official_requests[0]["messages"][0]["content"] == official.format_prompt("Question 0?", "eighteen", "18")
  summary = json.load(open(tmp_path / "official" / "summary.json"))
  assert summary["protocol"] == "official" and summary["settings"]["protocol"] == "official"
  bench = summary["benchmarks"]["qa"]
  assert bench["protocol"] == "official" and bench["pass@1"] == pytest.approx(0.75)
  assert bench["official"]["llm_equal"] == pytest.approx(0.75) and bench["official"]["em"] == pytest.approx(0.25)
  assert bench["official"]["tool_call"] == 1.0 and bench["official"]["num_valid_answer"] == "4 of 4"
  md = open(tmp_path / "official" / "summary.md").read()
  assert "protocol: official" in md and "Official metrics" in md


def test_the_template_defaults_to_the_checkpoints_own(tmp_path, tiny_config, scripted, tok_dir):
  """Without --template the evaluation asks in the system prompt the checkpoint was trained with (its saved
  data.template), not the code_search default; --template still wins."""
  from aepo_jax.eval import training_config

  run = tmp_path / "run"
  save_checkpoint(
    str(run / "checkpoints" / "rl"),
    tiny_config,
    scripted["answer"],
    tok_dir,
    training={"data": {"template": "compact"}},
  )
  assert training_config(str(run))["data"]["template"] == "compact"
  qa = tmp_path / "qa.jsonl"
  qa.write_text(json.dumps({"question": "Question?", "answer": "18"}) + "\n")
  argv = [
    f"--checkpoint={run}",
    f"--benchmarks={qa}",
    "--data_family=qa",
    "--n=1",
    "--k=1",
    "--temperature=0",
    "--max_prompt_len=512",
    "--max_response_len=32",
    "--batch_size=1",
    "--allow_unsandboxed",
    "--noprogress",
    "--protocol=project",
  ]
  cli = _cli()
  assert cli.main(argv + [f"--output={tmp_path / 'own'}"]) == 0
  # without search the fallback would be 'math'
  assert json.load(open(tmp_path / "own" / "summary.json"))["settings"]["template"] == "compact"
  assert cli.main(argv + ["--template=math", f"--output={tmp_path / 'chosen'}"]) == 0
  assert json.load(open(tmp_path / "chosen" / "summary.json"))["settings"]["template"] == "math"
