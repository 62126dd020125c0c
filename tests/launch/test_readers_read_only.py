"""Readers (export, evaluation and serving, which load through `load_policy`) open a run's checkpoints read-only:
a trainer's save in flight (`<step>.orbax-checkpoint-tmp-*`) survives them, and they create nothing."""

import os
import subprocess
import sys

import pytest

from aepo_jax import checkpoint as _checkpoint
from aepo_jax.train import CheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "launch"))
from test_export_hf import _tiny_run, tok_dir  # noqa: E402,F401  (tok_dir: the fixture)


def _in_flight(workdir):
  """What a trainer mid-save leaves in the run's directory: step 4's temporary directory, half written."""
  tmp = os.path.join(workdir, "checkpoints", "rl", "4.orbax-checkpoint-tmp-1733112233445566")
  os.makedirs(os.path.join(tmp, "state"))
  with open(os.path.join(tmp, "state", "partial"), "wb") as f:
    f.write(b"\0" * 1024)
  return tmp


def test_export_and_evaluation_leave_a_save_in_flight_alone(tmp_path, tok_dir):  # noqa: F811
  workdir, model_cfg, _ = _tiny_run(tmp_path, tok_dir)
  tmp = _in_flight(workdir)
  before = sorted(os.listdir(os.path.dirname(tmp)))
  out = subprocess.run(  # the command line: its absl flags cannot be defined twice in this process
    [sys.executable, "launch/export_hf.py", f"--checkpoint={workdir}", f"--output={tmp_path / 'hf'}"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert os.path.isfile(tmp_path / "hf" / "config.json")
  assert os.path.isfile(os.path.join(tmp, "state", "partial"))
  from aepo_jax.eval import load_policy, resolve_checkpoint

  policy = load_policy(resolve_checkpoint(workdir))  # what launch/evaluate.py and launch/serve.py open
  assert policy.config.vocab_size == model_cfg.vocab_size
  assert os.path.isfile(os.path.join(tmp, "state", "partial"))
  assert sorted(os.listdir(os.path.dirname(tmp))) == before


def test_a_reader_creates_nothing_and_cannot_save(tmp_path):
  missing = tmp_path / "nothing" / "checkpoints" / "rl"
  ckpt = _checkpoint.Checkpointer(str(missing), read_only=True)
  assert ckpt.latest_step() is None
  with pytest.raises(CheckpointError, match="read-only"):
    ckpt.save(1, {"x": __import__("numpy").zeros(2)}, {})
  ckpt.close()
  assert not (tmp_path / "nothing").exists()
