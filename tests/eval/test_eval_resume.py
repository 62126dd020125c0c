"""Resume: an interrupted evaluation, rerun, ends with every (question, sample) exactly once, and (greedy) the
same answers as an uninterrupted run. In-process interruption (fast) and a killed subprocess (slow)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from aepo_jax.eval import Evaluator, Policy, Scorer, read_records
from aepo_jax.tools import ToolSet

from eval_helpers import SETTINGS, short_examples, toy_data_root

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Interrupting(Scorer):
  def __init__(self, after):
    super().__init__()
    self.left = after

  def score(self, example, response):
    if self.left == 0:
      raise KeyboardInterrupt
    self.left -= 1
    return super().score(example, response)


def _ev(config, params, tokenizer, scorer):
  tools = ToolSet({"python": lambda code: "42"}, mode="eval", retry_count=1)
  return Evaluator(Policy(config, params, tokenizer, "t"), tools, scorer, SETTINGS, show_progress=False)


def _pairs(records):
  return [(r["id"], r["sample"]) for r in records]


def test_interrupted_then_resumed_in_process(tiny_config, tiny_params, tokenizer, tmp_path):
  exs = short_examples(5)  # 10 answers in batches of 4
  path = str(tmp_path / "toy.jsonl")
  with pytest.raises(KeyboardInterrupt):
    _ev(tiny_config, tiny_params, tokenizer, Interrupting(after=6)).run("toy", exs, path)
  partial = read_records(path)
  assert _pairs(partial) == [(f"toy:{i}", k) for i in range(2) for k in range(2)]  # whole first batch only
  with open(path, "a") as f:
    f.write('{"benchmark": "toy", "id": "toy:2", "sam')  # a torn line, as a kill mid-write leaves
  resumed = _ev(tiny_config, tiny_params, tokenizer, Scorer()).run("toy", exs, path)
  expected = [(e.id, k) for e in exs for k in range(2)]
  assert _pairs(resumed) == expected
  on_disk = read_records(path)
  assert sorted(_pairs(on_disk)) == sorted(expected) and len(on_disk) == len(set(_pairs(on_disk)))
  clean = _ev(tiny_config, tiny_params, tokenizer, Scorer()).run("toy", exs, str(tmp_path / "clean.jsonl"))
  assert [r["response"] for r in resumed] == [r["response"] for r in clean]  # greedy: bit-identical answers
  # Rerunning a finished benchmark computes nothing and changes nothing.
  again = _ev(tiny_config, tiny_params, tokenizer, Interrupting(after=0)).run("toy", exs, path)
  assert again == resumed
  # A smaller --limit reuses what is there and keeps the other questions' records in the file.
  fewer = _ev(tiny_config, tiny_params, tokenizer, Interrupting(after=0)).run("toy", exs[:2], path)
  assert fewer == resumed[:4] and len(read_records(path)) == 10


def test_judge_failures_are_rescored_on_resume(tiny_config, scripted, tokenizer, tmp_path):
  class FlakyJudge:
    def __init__(self, fail):
      self.fail = fail

    def judge(self, q, labeled, pred):
      if self.fail:
        raise ConnectionError("judge down")
      return True

  exs = short_examples(2, family="deep_search", answer="eighteen")
  path = str(tmp_path / "ds.jsonl")
  tools = ToolSet({"python": lambda code: "42"}, mode="eval", retry_count=1)
  pol = Policy(tiny_config, scripted["answer"], tokenizer, "t")
  first = Evaluator(pol, tools, Scorer(FlakyJudge(True)), SETTINGS, show_progress=False).run("ds", exs, path)
  assert {r["scorer"] for r in first} == {"judge_failed"} and all("judge down" in r["judge_error"] for r in first)
  second = Evaluator(pol, tools, Scorer(FlakyJudge(False)), SETTINGS, show_progress=False).run("ds", exs, path)
  assert {r["scorer"] for r in second} == {"judge"} and all(r["score"] == 1.0 for r in second)
  assert [r["response"] for r in second] == [r["response"] for r in first]  # not regenerated, only re-judged


CLI = [
  "--benchmarks=gsm8k",
  "--limit=6",
  "--n=2",
  "--k=2",
  "--temperature=0",
  "--max_prompt_len=256",
  "--max_response_len=200",
  "--batch_size=4",
  "--template=compact",
  "--noprogress",
]


@pytest.mark.slow
def test_killed_subprocess_then_rerun_has_no_duplicates_or_gaps(orbax_ckpt, tmp_path, monkeypatch):
  data = toy_data_root(str(tmp_path / "data"))
  monkeypatch.setenv("AEPO_ARPO_DATA", data)
  out = str(tmp_path / "run")
  path = os.path.join(out, "gsm8k.jsonl")
  env = dict(os.environ, AEPO_ARPO_DATA=data, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  proc = subprocess.Popen(
    [sys.executable, os.path.join(ROOT, "launch", "evaluate.py"), f"--checkpoint={orbax_ckpt}", f"--output={out}"]
    + CLI,
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
  )
  deadline = time.time() + 400
  lines = 0
  while time.time() < deadline and proc.poll() is None:
    lines = sum(1 for _ in open(path)) if os.path.exists(path) else 0
    if lines >= 4:
      break
    time.sleep(0.05)
  assert proc.poll() is None, f"finished or crashed before the kill: {proc.stderr.read().decode()[-2000:]}"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  killed_at = len(read_records(path))
  assert 4 <= killed_at < 12, killed_at
  spec = __import__("importlib.util").util.spec_from_file_location(
    "evaluate_cli", os.path.join(ROOT, "launch", "evaluate.py")
  )
  cli = __import__("importlib.util").util.module_from_spec(spec)
  spec.loader.exec_module(cli)
  assert cli.main([f"--checkpoint={orbax_ckpt}", f"--output={out}"] + CLI) == 0
  recs = read_records(path)
  expected = sorted((f"gsm8k:{i}", k) for i in range(1, 7) for k in range(2))
  assert sorted(_pairs(recs)) == expected and len(recs) == 12
  summary = json.load(open(os.path.join(out, "summary.json")))
  assert summary["benchmarks"]["gsm8k"]["num_answers"] == 12 and "pass@2" in summary["benchmarks"]["gsm8k"]
  # Same greedy answers as an uninterrupted run.
  clean = str(tmp_path / "clean")
  assert cli.main([f"--checkpoint={orbax_ckpt}", f"--output={clean}"] + CLI) == 0
  by = lambda rs: {(r["id"], r["sample"]): r["response"] for r in rs}
  assert by(recs) == by(read_records(os.path.join(clean, "gsm8k.jsonl")))


def _damage_line(path, number):
  """Changes one byte of line `number` (1-based) so that it no longer parses."""
  lines = open(path, "rb").read().split(b"\n")
  lines[number - 1] = lines[number - 1].replace(b'"id":', b'"id"#', 1)
  open(path, "wb").write(b"\n".join(lines))


def test_a_bad_line_in_the_middle_is_skipped_and_reported_not_truncated(tmp_path, caplog):
  path = str(tmp_path / "b.jsonl")
  with open(path, "w") as f:
    for i in range(100):
      f.write(json.dumps({"id": f"q{i}", "sample": 0, "score": 1.0}) + "\n")
  _damage_line(path, 3)
  assert len(read_records(path, repair=False)) == 99 and len(open(path).readlines()) == 100  # read-only: untouched
  with open(path, "a") as f:
    f.write('{"id": "q100", "sam')  # and a torn last line
  recs = read_records(path)
  assert [r["id"] for r in recs] == [f"q{i}" for i in range(100) if i != 2]
  assert "skipped 1 unparsable line(s) (line 3), moved to" in caplog.text
  assert len(open(path).readlines()) == 99 and open(path).read().endswith("\n")  # on disk too; the tail is cut
  assert open(path + ".bad").read().startswith('{"id"# "q2"')  # kept for inspection
  assert len(read_records(path)) == 99


def test_a_damaged_record_is_evaluated_again(tiny_config, tiny_params, tokenizer, tmp_path):
  exs = short_examples(3)
  path = str(tmp_path / "toy.jsonl")
  first = _ev(tiny_config, tiny_params, tokenizer, Scorer()).run("toy", exs, path)
  _damage_line(path, 3)  # (toy:1, 0)
  again = _ev(tiny_config, tiny_params, tokenizer, Scorer()).run("toy", exs, path)
  assert _pairs(again) == _pairs(first) and [r["response"] for r in again] == [r["response"] for r in first]
  on_disk = read_records(path)
  assert sorted(_pairs(on_disk)) == sorted(_pairs(first)) and len(on_disk) == 6
  assert len(open(path + ".bad").readlines()) == 1
