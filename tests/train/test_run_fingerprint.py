"""A rerun in a workdir resumes only its own run: a different model, data source, objective, rollout policy or seed
is refused while the workdir holds checkpoints (naming the differences and the ways on), a matching rerun says
"resuming from step N", a finished run given more steps continues, and a run that would train nothing says so and
fails. Non-positive step counts are refused by validation for every phase."""

import logging
import os
import subprocess
import sys

import pytest

from aepo_jax.train import ConfigError, _fingerprint, load_config, run
from aepo_jax.train._trainer import NothingToDo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "testing", "tiny_sft.py")
TINY_RL = os.path.join(ROOT, "configs", "testing", "tiny_rl.py")


def _config(workdir, **overrides):
  return load_config(TINY, overrides={"workdir": str(workdir), "sft.steps": 3, **overrides}, num_devices=None)


def test_rerun_checks_what_it_resumes(tmp_path, caplog):
  workdir = tmp_path / "run"
  assert run(_config(workdir))["sft/steps"] == 3
  assert (workdir / _fingerprint.FILE).exists()

  with pytest.raises(_fingerprint.RunMismatchError) as e:  # another run in the same workdir: refused
    run(_config(workdir, **{"sft.seed": 7, "data.seed": 2}))
  msg = str(e.value)
  assert "sft.seed: recorded 0, now 7" in msg and "data.seed: recorded 0, now 2" in msg
  assert "newest sft/3" in msg and "new --config.workdir" in msg and "--config.checkpoint.resume=force" in msg

  with pytest.raises(NothingToDo, match="already finished at step 3 \\(sft.steps=3\\)"):  # the same run, done
    run(_config(workdir))

  caplog.set_level(logging.INFO, logger="aepo_jax.train")
  assert run(_config(workdir, **{"sft.steps": 4}))["sft/steps"] == 4  # more steps: continues
  assert "resuming from step 3" in caplog.text

  # force: the checkpoints continue with the new settings, which become the run's record
  assert run(_config(workdir, **{"sft.steps": 5, "sft.seed": 7, "checkpoint.resume": "force"}))["sft/steps"] == 5
  assert _fingerprint.fingerprint(_config(workdir, **{"sft.seed": 7}))["sft.seed"] == 7
  with pytest.raises(NothingToDo):
    run(_config(workdir, **{"sft.steps": 5, "sft.seed": 7}))


def test_an_empty_workdir_or_settings_outside_the_fingerprint_are_no_mismatch(tmp_path):
  a = _config(tmp_path / "a")
  b = _config(tmp_path / "a", **{"sft.lr": 1e-3, "sft.steps": 9, "checkpoint.every_steps": 1, "train.log_every": 5})
  assert _fingerprint.differences(_fingerprint.fingerprint(a), _fingerprint.fingerprint(b)) == []
  _fingerprint.check_resume(_config(tmp_path / "a", **{"sft.seed": 3}))  # no checkpoints there: nothing to check


def test_the_command_line_refuses_another_run_with_one_error_line(tmp_path):
  workdir = tmp_path / "run"
  run(_config(workdir))
  out = subprocess.run(
    [sys.executable, "launch/tpu_pod.py", f"--config={TINY}", f"--config.workdir={workdir}", "--config.sft.seed=5"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert out.returncode != 0, out.stderr[-3000:]
  assert "error: workdir" in out.stderr and "sft.seed: recorded 0, now 5" in out.stderr


@pytest.mark.parametrize(
  "key,value,needle",
  [
    ("train.steps", -5, "train.steps=-5: must be >= 1 (or 0: train.epochs decide)."),
    ("train.epochs", -1, "train.epochs=-1: must be >= 1"),
    ("sft.packed_rows", -2, "sft.packed_rows=-2: must be >= 0"),
    ("data.val_size", -1, "data.val_size=-1: must be >= 0."),
    ("tools.python_memory_mb", 0, "tools.python_memory_mb=0"),
    ("checkpoint.resume", "maybe", "checkpoint.resume='maybe': 'check' or 'force'."),
  ],
)
def test_negative_counts_are_refused_for_every_phase(key, value, needle):
  with pytest.raises(ConfigError) as e:
    load_config(TINY_RL, overrides={key: value, "mode": "rl"}, num_devices=None)
  assert needle in str(e.value)


def test_rl_steps_minus_five_fails_on_the_command_line():
  out = subprocess.run(
    [sys.executable, "launch/tpu_pod.py", f"--config={TINY_RL}", "--mode=rl", "--config.train.steps=-5", "--dry_run"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert out.returncode != 0 and "train.steps=-5: must be >= 1" in out.stderr, out.stderr[-2000:]
