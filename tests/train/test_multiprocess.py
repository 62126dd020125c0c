"""Two CPU processes (gloo collectives, 2 fake devices each, mesh data=2 × fsdp=2) run three update steps on a
global batch split across the processes, and end with the parameters of one process on the whole batch.

Run as a script, this file is one worker: `python test_multiprocess.py WORKER_ID NUM_PROCS PORT OUT`.
"""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

STEPS = 3
M, N = 2, 16  # 2 micro-batches of 8 rows; each process holds 4 rows of each
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _steps_batches():
  from test_step_fixtures import rl_batch

  return [rl_batch(M, seed=s, n=N) for s in range(STEPS)]


def _train(mesh, local_rows=None, ulp_seeds=()):
  """[(params, losses)] of STEPS AdamW updates; `local_rows(x)` picks this process's rows of a [M, mb, T] array.
  One more run per seed in `ulp_seeds` (same compiled step), from initial parameters each moved by one ulp
  (relative eps, random sign), as in test_step_fixtures.float32_spread."""
  import jax
  from aepo_jax.train._batch import shard_batch
  from aepo_jax.train._optim import make_optimizer
  from aepo_jax.train._step import init_train_state, make_update_step
  from test_step_fixtures import CFG, TEMPERATURE, host_params

  # eps=1e-6 (optax's default 1e-8): Adam divides by sqrt(v) + eps, so an element whose gradient is ~1e-8 turns
  # the float32 summation-order noise of the all-reduce (~1e-10) into a visible update difference (seen: one
  # element of 4096 off by 2.7e-5 after 3 steps at lr 1e-2). The test is about the data-parallel gradient.
  opt = make_optimizer(1e-2, grad_clip=1.0, eps=1e-6)
  step = make_update_step(
    CFG, loss_fn="ppo", optimizer=opt, micro_batches=M, mesh=mesh, temperature=TEMPERATURE, logprob_chunk=8
  )
  runs = []
  for seed in (None, *ulp_seeds):
    init = host_params()
    if seed is not None:
      rng, eps = np.random.default_rng(1000 + seed), np.float32(np.finfo(np.float32).eps)
      init = jax.tree.map(lambda x: (x * (1 + eps * rng.choice([-1, 1], x.shape))).astype(x.dtype), init)
    params, opt_state = init_train_state(CFG, init, opt, mesh)
    losses = []
    for batch in _steps_batches():
      if local_rows is not None:
        batch = {k: local_rows(v) for k, v in batch.items()}
      params, opt_state, metrics = step(params, opt_state, shard_batch(batch, mesh))
      losses.append(float(metrics["train/loss"]))
    runs.append((params, losses))
  return runs


def _worker(pid, nproc, port, out):
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_default_matmul_precision", "highest")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
  from jax.experimental import multihost_utils
  from aepo_jax.parallel import make_mesh

  assert jax.process_count() == nproc and len(jax.devices()) == 2 * nproc
  mesh = make_mesh({"data": nproc, "fsdp": 2})  # data across processes, fsdp inside each

  def local_rows(x):  # this process's contiguous share of every micro-batch
    rows = x.shape[1] // nproc
    return x[:, pid * rows : (pid + 1) * rows]

  [(params, losses)] = _train(mesh, local_rows)
  gathered = multihost_utils.process_allgather(params, tiled=True)
  if pid == 0:
    flat = {
      "/".join(str(k.key) for k in path): np.asarray(v) for path, v in jax.tree_util.tree_leaves_with_path(gathered)
    }
    np.savez(out, losses=np.asarray(losses), **flat)
  jax.distributed.shutdown()


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
  import jax
  from aepo_jax.parallel import make_mesh

  out = str(tmp_path / "params.npz")
  port = _free_port()
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, REPO, os.environ.get("PYTHONPATH", "")]))
  procs = [
    subprocess.Popen(
      [sys.executable, __file__, str(i), "2", str(port), out],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  try:
    logs = [p.communicate(timeout=600)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-4000:]

  (params, losses), *moved_runs = _train(make_mesh((1, 1, 1), jax.devices()[:1]), ulp_seeds=(0, 1))
  multi = np.load(out)
  # Two processes sum the gradient in another order than one: the bound is 4x how far float32 rounding alone moves
  # the one-process result (initial parameters moved by one ulp, 2 draws), never below one ulp of the largest
  # parameter. Adam's 1 / (sqrt(v) + eps) amplifies rounding where gradients are tiny, so a fixed atol measures one
  # machine (params measured 4e-6 against the former atol=1e-5; the bound here is ~2.3e-5).
  params = jax.device_get(params)
  eps = float(np.finfo(np.float32).eps)
  spread_p = eps * max(float(np.abs(x).max()) for x in jax.tree.leaves(params))
  spread_l = eps * float(np.abs(losses).max())
  for moved, moved_losses in moved_runs:
    diffs = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), jax.device_get(moved), params)
    spread_p = max(spread_p, *jax.tree.leaves(diffs))
    spread_l = max(spread_l, float(np.abs(np.asarray(moved_losses) - losses).max()))
  np.testing.assert_allclose(multi["losses"], losses, rtol=0, atol=4 * spread_l)
  leaves = jax.tree_util.tree_leaves_with_path(params)
  assert len(leaves) == len(multi.files) - 1
  for path, value in leaves:
    name = "/".join(str(k.key) for k in path)
    np.testing.assert_allclose(multi[name], value, rtol=0, atol=4 * spread_p, err_msg=str(path))


if __name__ == "__main__":
  _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
