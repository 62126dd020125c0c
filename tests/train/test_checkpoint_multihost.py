"""Two CPU processes (gloo) standing in for two hosts restore from one shared checkpoint directory: a step that
fails verification on ONE host (its own read error) is damaged for both, so both resume from the same older step
instead of diverging into different collectives.

Run as a script, this file is one worker: `python test_checkpoint_multihost.py WORKER_ID PORT DIR OUT`.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


def _worker(pid: int, port: int, directory: str, out: str):
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec

  from aepo_jax.train import Checkpointer
  from aepo_jax.checkpoint import _integrity as integrity

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
  sharding = NamedSharding(mesh, PartitionSpec("x"))

  def state(step):
    return {"w": jax.make_array_from_callback((8, 4), sharding, lambda idx: np.full((8, 4), step, np.float32)[idx])}

  ck = Checkpointer(directory, keep=3, async_save=False)
  for step in (1, 2):
    ck.save(step, state(step), {"step": step})
  ck.wait()
  if pid == 1:  # host 1 cannot read step 2's files; host 0 can
    real = integrity.file_problems
    integrity.file_problems = lambda d: ["state/: read error on this host"] if d.rstrip("/").endswith("/2") else real(d)
  abstract = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharding)}
  step, restored, meta = ck.restore_newest_intact(abstract)
  local = [float(np.asarray(s.data).mean()) for s in restored["w"].addressable_shards]
  with open(out, "w") as f:
    json.dump({"step": step, "meta_step": meta["step"], "values": local, "all_steps": ck.all_steps()}, f)
  ck.close()
  jax.distributed.shutdown()


@pytest.mark.slow
def test_a_step_damaged_on_one_host_is_skipped_by_all(tmp_path):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  directory = tmp_path / "ckpt"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])
  procs = [
    subprocess.Popen(
      [sys.executable, HERE, str(i), str(port), str(directory), str(tmp_path / f"out{i}.json")],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  logs = [p.communicate(timeout=120)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
  results = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
  for r in results:
    assert r["step"] == 1 and r["meta_step"] == 1 and r["values"] == [1.0], results
  # Both hosts name what host 1 found, in the same words.
  named = f"{directory}/2 is damaged: state/: read error on this host [host 1]."
  assert all(named in log for log in logs), logs[0][-2000:]
  assert (directory / "2.damaged").exists()  # moved aside once, by the chief, after both hosts checked


if __name__ == "__main__":
  _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
