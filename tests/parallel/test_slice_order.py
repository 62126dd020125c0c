"""Meshes in a TPU slice's device order, on CPU processes standing in for the slice's hosts.

On a slice, `mesh_utils` orders chips by physical coordinates, so a mesh axis may alternate between hosts (v5p:2x2x2
with mesh (1, 4, 2): processes [0,0,1,1,0,0,1,1]); CPU devices are process-major. `parallel.emulate_topology` builds
every mesh over CPU devices as the slice's chips would be laid out. Checked here:

* the rows of a micro-batch each host holds come from the batch sharding's own index map (fast, no processes: the
  slice's chips and their index maps, through libtpu);
* the emulation refuses a process/device count that is not the slice's;
* on 2 processes as v5p:2x2x2 (and 4 as v6e:4x4): the meshes have the slice's process order; `process_rows` +
  `shard_batch` give each host the rows its devices hold and the global array equals the intended batch; the weight
  copy to each host's rollout mesh (`to_host_local`) equals the global parameters; one jitted update step on the
  mesh gives the parameters one device gives on the same global batch.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from aepo_jax import parallel
from aepo_jax.train._batch import batch_rows

# (slice, hosts, devices per host, training mesh (data, fsdp, tensor), micro-batch rows, slice's process order)
SLICES = {
  "v5p:2x2x2": (2, 4, (1, 4, 2), 8, [0, 0, 1, 1, 0, 0, 1, 1]),
  "v6e:4x4": (4, 4, (1, 4, 4), 8, [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]),
}


def _need_libtpu():
  if importlib.util.find_spec("libtpu") is None:
    if os.environ.get("AEPO_JAX_REQUIRE_LIBTPU") == "1":
      raise RuntimeError('libtpu is not installed but AEPO_JAX_REQUIRE_LIBTPU=1: pip install -e ".[tpu]"')
    pytest.skip('libtpu is not installed (pip install -e ".[tpu]")')


@pytest.mark.parametrize(
  "name, shape, rows, expected",
  [
    ("v5p:2x2x2", (1, 4, 2), 8, {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}),
    ("v5p:2x2x2", (8, 1, 1), 8, {0: [0, 2, 4, 6], 1: [1, 3, 5, 7]}),
    ("v6e:4x4", (1, 4, 4), 8, {0: [0, 1, 2, 3], 1: [0, 1, 2, 3], 2: [4, 5, 6, 7], 3: [4, 5, 6, 7]}),
    ("v5p:4x4x2", (1, 16, 2), 16, {0: [0, 1, 4, 5], 2: [2, 3, 6, 7], 4: [0, 1, 4, 5], 7: [10, 11, 14, 15]}),
  ],
)
def test_rows_each_host_holds_follow_the_batch_sharding(name, shape, rows, expected):
  _need_libtpu()
  chips = parallel.topology_devices(name)
  mesh = parallel.make_mesh(shape, chips)
  hosts = sorted({d.process_index for d in chips})
  held = {p: batch_rows(mesh, rows, process=p).tolist() for p in hosts}
  for p, want in expected.items():
    assert held[p] == want, held
  assert sorted(set().union(*map(set, held.values()))) == list(range(rows))  # every row on some host
  # Each host holds exactly the rows its chips' shards cover (the index map read device by device).
  for p in hosts:
    from aepo_jax.train._batch import batch_sharding

    index_map = batch_sharding(mesh).devices_indices_map((1, rows, 1))
    mine = {r for d, idx in index_map.items() if d.process_index == p for r in range(rows)[idx[1]]}
    assert held[p] == sorted(mine)


def test_describing_a_slice_off_a_tpu_vm_prints_no_libtpu_error():
  """libtpu started without a TPU VM's metadata prints an error block that looks like a failure; topology_devices
  gives it the slice's type while it loads, then restores the environment."""
  _need_libtpu()
  code = (
    "import os; from aepo_jax import parallel; chips = parallel.topology_devices('v5e:2x2'); "
    "print(len(chips), [k for k in ('TPU_ACCELERATOR_TYPE', 'TPU_WORKER_HOSTNAMES') if k in os.environ])"
  )
  env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "CLOUD_TPU", "MEGASCALE"))}
  done = subprocess.run(
    [sys.executable, "-c", code], env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.split() == ["4", "[]"], done.stdout
  assert "Failed to find host bounds" not in done.stderr and "INVALID_ARGUMENT" not in done.stderr, done.stderr


def test_emulation_refuses_a_run_that_is_not_the_slice():
  _need_libtpu()
  try:
    with pytest.raises(ValueError, match=r"v5p:2x2x2 has 2 hosts with 4 chips each.*--num_processes=2"):
      parallel.emulate_topology("v5p:2x2x2")  # this test process: one process
    with pytest.raises(ValueError, match="cannot describe the TPU slice"):
      parallel.emulate_topology("v5p:not-a-slice")
  finally:
    parallel.emulate_topology(None)
  assert parallel.emulated_topology() is None


_WORKER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from aepo_jax.parallel import use_cpu_xla_flags
    use_cpu_xla_flags()  # the launchers' XLA:CPU flags (and the test session's fast compiles), as a host gets them
    import jax
    import jax.numpy as jnp
    import optax
    jax.config.update("jax_default_matmul_precision", "highest")
    from aepo_jax import model as model_lib, parallel
    from aepo_jax.train import _batch, _logprob, _step

    port, pid, nproc, name = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    shape, rows = tuple(json.loads(sys.argv[5])), int(sys.argv[6])
    assert parallel.initialize_distributed(f"127.0.0.1:{port}", nproc, pid) == (pid, nproc)
    parallel.emulate_topology(name)
    mesh = parallel.make_mesh(shape)
    out = {"order": [d.process_index for d in mesh.devices.flat]}
    rollout_mesh = parallel.local_mesh((1, 1, -1))
    out["hosts_row_is_local_mesh"] = bool(
      (parallel.hosts_mesh((1, 1, -1)).devices[pid] == rollout_mesh.devices).all()
    )

    # -- each host's rows of a global batch ------------------------------------------------------------
    K, T = 2, 16
    cfg = model_lib.preset(
      "qwen3-0.6b", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, head_dim=16,
      vocab_size=256,
    )
    rng = np.random.default_rng(0)  # the same global batch on every host
    lengths = 6 + (np.arange(K * rows) % (T - 6))
    attention = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    loss = attention * (np.arange(T)[None] >= 4)
    full = {
      "tokens": rng.integers(1, cfg.vocab_size, (K * rows, T)).astype(np.int32) * attention,
      "attention_mask": attention,
      "loss_mask": loss.astype(np.int32),
      "advantages": (rng.normal(size=(K * rows, 1)) * loss).astype(np.float32),
    }
    full = {k: v.reshape(K, rows, T) for k, v in full.items()}
    mine = _batch.process_rows(full, mesh)
    out["rows"] = _batch.batch_rows(mesh, rows).tolist()
    batch = _batch.shard_batch(mine, mesh)
    for k, x in batch.items():
      assert x.shape == full[k].shape and not x.is_fully_addressable, (k, x.shape)
      np.testing.assert_array_equal(_batch.global_value(x), full[k])
      for shard in x.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[k][shard.index])
    out["batch_equal"] = True

    # -- the weight copy to each host's rollout mesh ------------------------------------------------------
    params = jax.jit(lambda k: model_lib.init_params(cfg, k), out_shardings=model_lib.param_shardings(cfg, mesh))(
      jax.random.PRNGKey(0)
    )
    shardings = model_lib.param_shardings(cfg.replace(param_dtype="bfloat16"), rollout_mesh)
    local = parallel.to_host_local(params, shardings, "bfloat16")
    for x, y, s in zip(jax.tree.leaves(params), jax.tree.leaves(local), jax.tree.leaves(shardings)):
      assert y.is_fully_addressable and y.dtype == jnp.bfloat16 and y.sharding.is_equivalent_to(s, y.ndim)
      np.testing.assert_array_equal(np.asarray(y), _batch.global_value(x).astype(jnp.bfloat16))
    same_dtype = parallel.to_host_local(params, model_lib.param_shardings(cfg, rollout_mesh))
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(same_dtype)):
      np.testing.assert_array_equal(np.asarray(y), _batch.global_value(x))
    out["host_local_equal"] = True

    # -- one update step on the slice-ordered mesh vs one device, same global batch --------------------------
    def update(mesh, params, batch):
      logprob = _logprob.make_logprob_fn(cfg, mesh=mesh)
      batch = dict(batch)
      batch["old_log_prob"], _ = logprob(params, batch["tokens"], batch["attention_mask"])
      opt = optax.sgd(1.0)  # the parameter change is the gradient itself: no Adam sign amplification
      step = _step.make_update_step(cfg, loss_fn="ppo", optimizer=opt, micro_batches=K, mesh=mesh)
      params, opt_state = _step.init_train_state(cfg, params, opt, mesh)
      new, _, metrics = step(params, opt_state, batch)
      return new, metrics

    host_params = jax.tree.map(_batch.global_value, params)  # before the step donates them
    new, metrics = update(mesh, params, batch)
    one = parallel.make_mesh((1, 1, 1), jax.local_devices()[:1])
    ref, ref_metrics = update(one, host_params, {k: jax.device_put(v, jax.local_devices()[0]) for k, v in full.items()})
    diffs = [
      float(np.abs(_batch.global_value(a) - np.asarray(b)).max()) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref))
    ]
    moved = [
      float(np.abs(np.asarray(b) - np.asarray(c)).max()) for b, c in zip(jax.tree.leaves(ref), jax.tree.leaves(host_params))
    ]
    out["update_max_abs_diff"] = max(diffs)
    out["update_max_change"] = max(moved)
    out["loss"] = [float(_batch.global_value(metrics["train/loss"])), float(np.asarray(ref_metrics["train/loss"]))]
    out["grad_norm"] = [float(_batch.global_value(metrics["train/grad_norm"])), float(np.asarray(ref_metrics["train/grad_norm"]))]
    print("RESULT " + json.dumps(out))
""")


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_slice(name, tmp_path):
  hosts, per_host, shape, rows, _ = SLICES[name]
  env = dict(
    os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={per_host}", JAX_PLATFORMS="cpu", PYTHONHASHSEED="0"
  )
  env.pop(parallel.EMULATE_TOPOLOGY_ENV, None)
  port = _free_port()
  logs = [open(tmp_path / f"worker{i}.log", "w+") for i in range(hosts)]
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", _WORKER, str(port), str(i), str(hosts), name, json.dumps(shape), str(rows)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=logs[i],
      text=True,
    )
    for i in range(hosts)
  ]
  try:
    outs = [p.communicate(timeout=900)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  results = []
  for i, (p, out) in enumerate(zip(procs, outs)):
    logs[i].seek(0)
    err = logs[i].read()
    logs[i].close()
    assert p.returncode == 0, f"process {i}:\n{err[-4000:]}"
    line = [s for s in out.splitlines() if s.startswith("RESULT ")]
    assert line, out[-2000:]
    results.append(json.loads(line[-1][len("RESULT ") :]))
  return results


@pytest.mark.slow
@pytest.mark.parametrize("name", ["v5p:2x2x2", "v6e:4x4"])
def test_hosts_in_a_slice_order(name, tmp_path):
  _need_libtpu()
  hosts, _, shape, rows, order = SLICES[name]
  results = _run_slice(name, tmp_path)
  print(name, json.dumps(results))  # the order, each host's rows and the update's difference (pytest -s)
  chips = parallel.topology_devices(name)
  mesh = parallel.make_mesh(shape, chips)
  for p, r in enumerate(results):
    assert r["order"] == order, r["order"]
    assert r["rows"] == batch_rows(mesh, rows, process=p).tolist()
    assert r["hosts_row_is_local_mesh"] and r["batch_equal"] and r["host_local_equal"]
    # SGD with learning rate 1: the parameter change is the gradient; the sharded step (float32, matmuls at
    # "highest" precision, reductions in another order) matches one device to 1e-5 of a change of order 1e-1.
    assert r["update_max_change"] > 1e-3, r
    assert r["update_max_abs_diff"] <= 1e-5, r
    assert abs(r["loss"][0] - r["loss"][1]) <= 1e-6, r
  assert len({json.dumps(r["order"]) for r in results}) == 1  # every host builds the same mesh


def test_launcher_refuses_a_process_count_that_is_not_the_slice(tmp_path):
  _need_libtpu()
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  env.pop(parallel.EMULATE_TOPOLOGY_ENV, None)
  cmd = [
    sys.executable,
    os.path.join(root, "launch", "tpu_pod.py"),
    "--config=configs/testing/tiny_rl.py",
    f"--config.workdir={tmp_path / 'run'}",
    "--emulate_topology=v5p:2x2x2",
  ]
  done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode != 0
  # One process got the slice's 4 devices per host, but the slice has 2 hosts.
  assert "v5p:2x2x2 has 2 hosts with 4 chips each, but this run has 1 processes with [4] devices" in done.stderr, (
    done.stderr[-3000:]
  )


def _launch_emulated(tmp_path, workdir, *overrides):
  """The main job as 2 processes standing in for the hosts of a v5p:2x2x2 slice; returns their logs."""
  from aepo_jax.testing import tiny_tokenizer

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  # The rerun takes its programs from the first run's compilation cache (written by process 0, read by both):
  # what it checks is the restore onto the slice-ordered mesh, not a second compile of the same programs.
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
  )
  env.pop("XLA_FLAGS", None)  # the launcher gives each process the slice's 4 devices per host
  env.pop(parallel.EMULATE_TOPOLOGY_ENV, None)
  port = _free_port()
  cmd = [
    sys.executable,
    os.path.join(root, "launch", "tpu_pod.py"),
    "--config=configs/testing/tiny_rl.py",
    f"--config.workdir={workdir}",
    f"--config.model.tokenizer={tiny_tokenizer(tmp_path / 'tok')}",
    "--config.checkpoint.shared_workdir=True",
    "--config.mesh.data=1",
    "--config.mesh.fsdp=4",
    "--config.mesh.tensor=2",
    "--config.sft.steps=1",
    *overrides,
    "--emulate_topology=v5p:2x2x2",
    f"--coordinator_address=127.0.0.1:{port}",
    "--num_processes=2",
  ]
  procs = [
    subprocess.Popen(
      cmd + [f"--process_id={i}"], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    for i in range(2)
  ]
  try:
    logs = [p.communicate(timeout=1200)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for i, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{log[-5000:]}"
  return logs


@pytest.mark.slow
def test_main_job_on_two_hosts_of_an_emulated_v5p_slice(tmp_path):
  """`launch/tpu_pod.py --emulate_topology=v5p:2x2x2`, 2 processes, training mesh (1, 4, 2) spanning the hosts on
  fsdp and tensor: SFT, evaluation (each host's rollout copy of the weights), two RL steps with tools, checkpoints,
  then a rerun with one more step resumes from the checkpoint; every host's rollout time is logged (`hosts/*`).

  The RL steps use partial rollouts (train.max_staleness=1, the decoupled objective): each host carries its own
  unfinished groups over to the next step, every update still sees both hosts' 8 trajectories and no token is more
  than one update old; what was carried over is dropped at the restart, and the log says so."""
  _need_libtpu()
  workdir = tmp_path / "run"
  partial = ("--config.train.max_staleness=1", "--config.algo.off_policy=decoupled")
  logs = _launch_emulated(tmp_path, workdir, "--config.train.steps=2", *partial)
  assert "meshes in the order of the TPU slice v5p:2x2x2: 2 hosts x 4 devices" in logs[0]
  assert "process 1/2, 8 devices (4 local)" in logs[1]
  assert "slowest host" in logs[0]  # the per-host table of the RL step
  with open(workdir / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  rl = [r for r in records if "reward/mean" in r]
  assert [r["step"] for r in rl] == [1, 2], rl
  for r in rl:
    assert r["rollout/trajectories"] == 8 and r["hosts/trajectories_min"] == r["hosts/trajectories_max"] == 4.0, r
    assert 0 < r["hosts/rollout_s_min"] <= r["hosts/rollout_s_max"], r
    assert r["rollout/staleness_max"] <= 1 and r["rollout/dropped_stale"] == 0 and "offpolicy/ess" in r, r
    assert r["rollout/carried_groups"] == 2, r  # each host: 2 groups in flight, 1 handed back, 1 carried
  assert [r["step"] for r in records if "eval/suite/accuracy" in r] == [0, 2]
  assert sorted(int(p) for p in os.listdir(workdir / "checkpoints" / "rl") if p.isdigit()) == [1, 2]

  # The checkpoint written on the slice-ordered mesh restores onto it: the rerun trains step 3 only.
  logs = _launch_emulated(tmp_path, workdir, "--config.train.steps=3", "--config.eval.after_rl=False", *partial)
  assert "dropped at the restart" in logs[0], logs[0][-3000:]
  with open(workdir / "metrics.jsonl") as f:
    rl = [json.loads(line) for line in f if "reward/mean" in line]
  assert [r["step"] for r in rl] == [1, 2, 3], [r["step"] for r in rl]
  assert sorted(int(p) for p in os.listdir(workdir / "checkpoints" / "rl") if p.isdigit()) == [2, 3]
