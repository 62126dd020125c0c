"""Two CPU processes with gloo collectives (launch/tpu_pod.py --num_processes=2) train the tiny SFT config to
the same parameters as one process over the same two devices (same global batch, same seeds)."""

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from aepo_jax import model as model_lib
from aepo_jax.train import Checkpointer
from aepo_jax.checkpoint import model_config_from_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 4


def _cmd(workdir, *extra):
  return [
    sys.executable,
    os.path.join(ROOT, "launch/tpu_pod.py"),
    "--config=configs/testing/tiny_sft.py",
    f"--config.workdir={workdir}",
    f"--config.sft.steps={STEPS}",
    "--config.checkpoint.every_steps=2",
    *extra,
  ]


def _env(devices):
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def _params(workdir):
  ck = Checkpointer(f"{workdir}/checkpoints/sft")
  cfg = model_config_from_json(ck.restore_meta(STEPS)["model_config"])
  return jax.device_get(
    ck.restore_params(STEPS, jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.PRNGKey(0))))
  )


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
  s = socket.socket()
  s.bind(("127.0.0.1", 0))
  port = s.getsockname()[1]
  s.close()
  multi = tmp_path / "two_processes"
  procs = [
    subprocess.Popen(
      _cmd(
        multi,
        "--config.checkpoint.shared_workdir=True",
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
        f"--process_id={i}",
      ),
      cwd=ROOT,
      env=_env(1),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  single = subprocess.run(
    _cmd(tmp_path / "one_process"), cwd=ROOT, env=_env(2), capture_output=True, text=True, timeout=600
  )
  outs = [p.communicate(timeout=600)[0] for p in procs]
  assert single.returncode == 0, single.stderr[-3000:]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  assert "process 1/2, 2 devices (1 local)" in outs[1]
  a, b = _params(multi), _params(tmp_path / "one_process")
  diffs = jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))), a, b))
  assert max(diffs) == 0.0, f"max |difference| {max(diffs)}"  # measured: bit-identical
