"""A run stopped inside its after-RL evaluation (its last step already saved) finishes that evaluation when the same
command runs again, and trains nothing; once it has, a rerun says there is nothing to do. Before, the rerun found the
steps done and stopped, and the after-RL evaluation's missing part (e.g. its Pass@k sampling) was silently lost.

The driver is the trainer's entry on configs/testing/tiny_rl.py (RL only, real tools, random tiny model); the stop is
an exception raised by the evaluation of phase 'after_rl', as a kill there would leave it."""

import json
import os
import time

import pytest

from aepo_jax.checkpoint import Checkpointer
from aepo_jax.train import _validation, load_config, run
from aepo_jax.train._trainer import NothingToDo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  from aepo_jax.testing import tiny_tokenizer

  return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _config(workdir, tok_dir):
  overrides = {
    "workdir": str(workdir),
    "model.tokenizer": tok_dir,
    "mode": "rl",
    "sft.enabled": False,
    "train.steps": 1,
    "eval.before_rl": False,
    "eval.after_rl": True,
  }
  return load_config(os.path.join(ROOT, "configs", "testing", "tiny_rl.py"), overrides=overrides)


def _rows(workdir):
  return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


@pytest.mark.slow
def test_a_run_stopped_inside_its_after_rl_evaluation_finishes_it_on_rerun(tmp_path, tok_dir, monkeypatch):
  workdir = tmp_path / "run"
  evaluate = _validation.Validation.__call__

  def stopped(self, params, step, phase="rl", **kw):
    if phase == "after_rl":
      raise KeyboardInterrupt("stopped inside the after-RL evaluation")
    return evaluate(self, params, step, phase, **kw)

  monkeypatch.setattr(_validation.Validation, "__call__", stopped)
  commit = Checkpointer._manifest_before_commit

  def slow_commit(self):  # the step's async save is still in flight when the evaluation stops the run
    time.sleep(2.0)
    commit(self)

  monkeypatch.setattr(Checkpointer, "_manifest_before_commit", slow_commit)
  with pytest.raises(KeyboardInterrupt):
    run(_config(workdir, tok_dir))
  monkeypatch.setattr(_validation.Validation, "__call__", evaluate)
  monkeypatch.setattr(Checkpointer, "_manifest_before_commit", commit)
  # The exception left the run only once that save had finished: its step is whole, no temporary directory is
  # left (before, the rerun's checkpoint manager deleted it under the save's rename: "state/ is missing").
  assert sorted(os.listdir(workdir / "checkpoints" / "rl")) == ["1"]
  assert {"state", "meta"} <= set(os.listdir(workdir / "checkpoints" / "rl" / "1"))
  trained = [r for r in _rows(workdir) if "reward/mean" in r]
  assert [r["step"] for r in trained] == [1]
  assert not (workdir / "eval" / "after_rl_1.jsonl").exists()

  summary = run(_config(workdir, tok_dir))  # the same command: the evaluation, no training
  assert summary["rl/steps"] == 1
  assert any(k.startswith("after_rl/eval/") for k in summary), sorted(summary)
  assert (workdir / "eval" / "after_rl_1.jsonl").exists() and (workdir / "eval" / "after_rl_1.done").exists()
  assert [r for r in _rows(workdir) if "reward/mean" in r] == trained  # no step trained again

  with pytest.raises(NothingToDo, match="already finished at step 1"):
    run(_config(workdir, tok_dir))


@pytest.mark.slow
def test_the_after_rl_evaluation_takes_over_the_periodic_one_of_the_last_step(tmp_path, tok_dir, monkeypatch):
  """eval_every dividing the steps: the last step's periodic evaluation and the after-RL one are of the same
  parameters; the greedy answers are evaluated once (the after-RL records a copy, its metrics not logged twice)."""
  workdir = tmp_path / "run"
  calls = []
  evaluate = _validation.evaluate

  def counted(config, rollout, params, records_path="", samples=1):
    calls.append(os.path.basename(records_path))
    return evaluate(config, rollout, params, records_path, samples)

  monkeypatch.setattr(_validation, "evaluate", counted)
  config = _config(workdir, tok_dir)
  config.unlock()
  config.train.steps, config.train.eval_every = 2, 1
  summary = run(config)
  assert calls == ["rl_1.jsonl", "rl_2.jsonl"], calls
  eval_dir = workdir / "eval"
  assert (eval_dir / "after_rl_2.jsonl").read_bytes() == (eval_dir / "rl_2.jsonl").read_bytes()
  rows = [r for r in _rows(workdir) if "eval/accuracy" in r]
  assert [r["step"] for r in rows] == [1, 2]
  assert summary["after_rl/eval/accuracy"] == rows[-1]["eval/accuracy"]
