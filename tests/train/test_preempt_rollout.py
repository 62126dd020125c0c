"""SIGTERM in the middle of an RL rollout (a TPU VM's ~30 s preemption notice arrives while trajectories decode): the
rollout stops at its next decode chunk, the state at the start of that step is saved and the process exits within
seconds; the same command then redoes the step and ends bit-identical to an uninterrupted run.

The driver is the trainer's entry on configs/testing/tiny_rl.py (RL only, real tools, random tiny model). The only
thing it adds: at the start of RL step 2's rollout it sends itself SIGTERM (the signal handler is the trainer's own),
so the signal lands inside the rollout at a known point.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from aepo_jax import model as model_lib
from aepo_jax.checkpoint import model_config_from_json
from aepo_jax.train import Checkpointer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DRIVER = textwrap.dedent("""
    import os, signal, sys, time
    from aepo_jax.train import _wiring, load_config, run
    if sys.argv[3] == "preempt":
      call, calls = _wiring.Rollout.__call__, []
      def rollout(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:  # RL step 2's rollout (no evaluation rollouts in this config)
          print(f"sigterm at {time.time()}", flush=True)
          os.kill(os.getpid(), signal.SIGTERM)
        return call(self, *a, **k)
      _wiring.Rollout.__call__ = rollout
    overrides = {
      "workdir": sys.argv[1], "model.tokenizer": sys.argv[2], "mode": "rl", "sft.enabled": False,
      "train.steps": 2, "checkpoint.every_steps": 10, "eval.before_rl": False, "eval.after_rl": False,
    }
    run(load_config("configs/testing/tiny_rl.py", overrides=overrides))
    print(f"exited at {time.time()}", flush=True)
""")


def _run(workdir, tok_dir, mode):
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false")
  proc = subprocess.run(
    [sys.executable, "-c", DRIVER, str(workdir), tok_dir, mode],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _params(workdir, step):
  ck = Checkpointer(f"{workdir}/checkpoints/rl", read_only=True)
  cfg = model_config_from_json(ck.restore_meta(step)["model_config"])
  return jax.device_get(ck.restore_params(step, model_lib.param_shapes(cfg)))


def _train_steps(workdir):
  return [r["step"] for r in map(json.loads, open(os.path.join(workdir, "metrics.jsonl"))) if "reward/mean" in r]


@pytest.mark.slow
def test_sigterm_in_a_rollout_saves_the_step_start_and_the_rerun_is_bit_identical(tmp_path):
  from aepo_jax.testing import tiny_tokenizer

  tok_dir = str(tmp_path / "tok")
  tiny_tokenizer(tok_dir)
  victim = tmp_path / "preempted"
  out = _run(victim, tok_dir, "preempt")
  signalled = float(out.stdout.split("sigterm at ")[1].split()[0])
  exited = float(out.stdout.split("exited at ")[1].split()[0])
  assert "preempted during the rollout of RL step 2: saving step 1" in out.stderr, out.stderr[-3000:]
  assert "rollout interrupted in round" in out.stderr
  assert exited - signalled < 30  # the notice a TPU VM gets; the save of step 1 is committed before the exit
  assert Checkpointer(f"{victim}/checkpoints/rl", read_only=True).all_steps() == [1]
  assert _train_steps(victim) == [1]  # step 2 was abandoned, not logged

  _run(victim, tok_dir, "plain")  # the same command: resumes at step 1, redoes step 2 from its start
  assert _train_steps(victim) == [1, 2]
  straight = tmp_path / "straight"
  _run(straight, tok_dir, "plain")
  a, b = _params(straight, 2), _params(victim, 2)
  for (path, x), (_, y) in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]):
    assert np.array_equal(np.asarray(x), np.asarray(y)), f"{jax.tree_util.keystr(path)} differs"
