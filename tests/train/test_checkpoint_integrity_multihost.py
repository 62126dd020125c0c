"""Two CPU processes (gloo, 2 devices each) standing in for two hosts save a params tree sharded over all four
devices to one shared directory: each host hashes only the files it wrote (process 0 also the shared ones), the
one manifest covers every file of the step, and at restore each host hashes its share. A file written by process 1
with flipped bytes makes BOTH hosts stop with the same error naming it.

Run as a script, this file is one worker: `python test_checkpoint_integrity_multihost.py WORKER_ID PORT DIR OUT`.
"""

import json
import os
import re
import sys

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
_TMP = r"(?:\.orbax-checkpoint-tmp[^/]*)?"  # Orbax's names for a step or item being written
_STEP_FILE = re.compile(rf"/(\d+){_TMP}/(state|meta){_TMP}/(.*)$")


def _worker(pid: int, port: int, directory: str, out: str):
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding, PartitionSpec

  from aepo_jax.checkpoint import CheckpointCorruptError
  from aepo_jax.checkpoint import _integrity as integrity
  from aepo_jax.train import Checkpointer

  hashed, phase = [], ["save"]  # (phase, step, file relative to its step, bytes) of every file this host hashes
  real_sha256 = integrity._sha256

  def recording_sha256(path):
    step, item, rel = _STEP_FILE.search(path).groups()
    hashed.append((phase[0], int(step), f"{item}/{rel}", os.path.getsize(path)))
    return real_sha256(path)

  integrity._sha256 = recording_sha256

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))  # 4 devices, process-major
  sharded, replicated = NamedSharding(mesh, PartitionSpec("x")), NamedSharding(mesh, PartitionSpec())

  def state(step):
    w, b = np.arange(64 * 256, dtype=np.float32).reshape(64, 256) * step, np.full((256,), step, np.float32)
    return {
      "params": {
        "w": jax.make_array_from_callback((64, 256), sharded, lambda idx: w[idx]),
        "b": jax.make_array_from_callback((256,), replicated, lambda idx: b[idx]),
      }
    }

  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state(1))
  ck = Checkpointer(f"{directory}/async", keep=3)  # async saves: each host hashes in Orbax's save thread
  for step in (1, 2):
    ck.save(step, state(step), {"step": step})
  ck.wait()
  sync = Checkpointer(f"{directory}/sync", async_save=False)  # a sync save: hashed after the commit, then gathered
  phase[0] = "sync_save"
  sync.save(1, state(1), {"step": 1})
  sync.close()

  phase[0] = "restore"
  restored, _ = ck.restore(2, abstract)
  intact = all(float(np.asarray(s.data).mean()) > 0 for s in restored["params"]["w"].addressable_shards)
  phase[0] = "damaged"
  if pid == 1:  # flip bytes in the middle of the largest file process 1 wrote
    own = f"{directory}/async/2/state/ocdbt.process_1"
    victim = max((os.path.join(p, n) for p, _, ns in os.walk(own) for n in ns), key=os.path.getsize)
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 64])
    open(victim, "wb").write(bytes(data))
  multihost_utils.sync_global_devices("flipped")
  try:
    ck.restore(2, abstract)
    error = None
  except CheckpointCorruptError as e:
    error = str(e)
  phase[0] = "fallback"
  step, restored, meta = ck.restore_newest_intact(abstract)
  ck.close()
  with open(out, "w") as f:
    json.dump(
      {
        "hashed": hashed,
        "intact": intact,
        "error": error,
        "fallback_step": step,
        "fallback_b": float(np.asarray(restored["params"]["b"].addressable_data(0)).mean()),
        "jnp_ok": bool(jnp.isfinite(restored["params"]["w"]).all()),
      },
      f,
    )
  jax.distributed.shutdown()


def _files(step_dir) -> dict:
  return {
    os.path.relpath(os.path.join(p, n), step_dir): os.path.getsize(os.path.join(p, n))
    for item in ("state", "meta")
    for p, _, names in os.walk(os.path.join(step_dir, item))
    for n in names
  }


def _by(results, phase, step) -> list[dict]:
  """{file: bytes} each host hashed in `phase` for `step`."""
  return [{rel: size for ph, s, rel, size in r["hashed"] if ph == phase and s == step} for r in results]


def test_each_host_hashes_the_files_it_wrote_and_all_stop_on_one_damaged_file(tmp_path):
  from aepo_jax.checkpoint._integrity import MANIFEST, writer

  from aepo_jax.testing import free_port, run_processes

  port = free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])
  cmds = [[sys.executable, HERE, str(i), str(port), str(tmp_path), str(tmp_path / f"out{i}.json")] for i in range(2)]
  run_processes(cmds, env=env, timeout=300)
  results = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]

  for phase, step_dir, step in [
    ("save", tmp_path / "async" / "1", 1),
    ("save", tmp_path / "async" / "2.damaged", 2),
    ("sync_save", tmp_path / "sync" / "1", 1),
  ]:
    files = _files(step_dir)
    manifest = json.loads((step_dir / MANIFEST).read_text())["files"]
    assert set(manifest) == set(files) and all(manifest[k]["sha256"] for k in files), (phase, step)
    assert not [n for n in os.listdir(step_dir) if n.startswith("integrity.p")]  # parts merged and removed
    h0, h1 = _by(results, phase, step)
    assert set(h1) == {k for k in files if writer(k) == 1}, (phase, step, sorted(h1))  # its own, nothing else
    assert set(h0) == set(files) - set(h1), (phase, step, sorted(h0))  # its own and the shared files
    assert set(h1) and {writer(k) for k in h0} == {0, None}
    print(f"{phase} step {step}: {sum(files.values())} bytes, hashed {sum(h0.values())} + {sum(h1.values())}")

  step2 = _files(tmp_path / "async" / "2.damaged")
  h0, h1 = _by(results, "restore", 2)  # an intact restore: every file hashed once, each by one host
  assert not set(h0) & set(h1) and set(h0) | set(h1) == set(step2)
  assert {k for k in step2 if writer(k) == 1} <= set(h1) and {k for k in step2 if writer(k) == 0} <= set(h0)
  print(f"restore step 2: hashed {sum(h0.values())} + {sum(h1.values())}")
  assert all(r["intact"] for r in results)

  own = tmp_path / "async" / "2.damaged" / "state" / "ocdbt.process_1"
  victim = max((os.path.join(p, n) for p, _, ns in os.walk(own) for n in ns), key=os.path.getsize)
  rel = os.path.relpath(victim, tmp_path / "async" / "2.damaged")
  errors = [r["error"] for r in results]
  assert errors[0] == errors[1], errors  # the same error on both hosts, though only host 1 hashed the file
  named = f"{rel} differs from the sha256 recorded at save (its bytes changed) [host 1]"
  assert f"{tmp_path}/async/2 is damaged: {named}" in errors[0], errors[0]
  for r in results:  # both fall back to step 1 together; the damaged step is moved aside once
    assert r["fallback_step"] == 1 and r["fallback_b"] == 1.0 and r["jnp_ok"]
  assert sorted(os.listdir(tmp_path / "async")) == ["1", "2.damaged"]


def test_restore_shares_split_every_hashed_file_once():
  """Each host its own files, the rest spread by bytes; a checkpoint written by more hosts than read it, too."""
  from aepo_jax.checkpoint._integrity import _share

  recorded = {
    f"state/ocdbt.process_{p}/d/{i}": {"size": 100 * (p + 1), "sha256": "x"} for p in range(4) for i in (0, 1)
  }
  recorded |= {"state/_METADATA": {"size": 50, "sha256": "x"}, "state/manifest.ocdbt": {"size": 10, "sha256": "x"}}
  recorded |= {"state/array_metadatas/process_3": {"size": 5, "sha256": "x"}, "meta/metadata": {"size": 7}}
  for hosts in (1, 2, 3, 4, 5):
    shares = [_share(recorded, h, hosts) for h in range(hosts)]
    assert sorted(f for s in shares for f in s) == sorted(k for k, r in recorded.items() if r.get("sha256"))
    for p in range(min(hosts, 4)):
      assert {k for k in recorded if f"process_{p}" in k} <= shares[p]
  two = [_share(recorded, h, 2) for h in range(2)]
  loads = [sum(recorded[k]["size"] for k in s) for s in two]
  assert abs(loads[0] - loads[1]) <= 400, loads  # process 2's and 3's files shared out by size


def test_hosts_agree_on_problems_and_name_who_found_them(tmp_path):
  """Two hosts' shares checked in one process: together they find what one host checking everything finds."""
  import jax.numpy as jnp

  from aepo_jax.checkpoint._integrity import file_problems, merge_problems
  from aepo_jax.train import Checkpointer

  ck = Checkpointer(str(tmp_path), async_save=False)
  ck.save(1, {"w": jnp.arange(4096.0).reshape(64, 64), "b": jnp.ones(8)}, {"step": 1})
  ck.close()
  step_dir = str(tmp_path / "1")
  assert merge_problems([file_problems(step_dir, 0, 2), file_problems(step_dir, 1, 2)]) == []
  victim = max(_files(step_dir).items(), key=lambda kv: kv[1])[0]
  data = bytearray(open(os.path.join(step_dir, victim), "rb").read())
  data[10:20] = bytes(b ^ 0xFF for b in data[10:20])
  open(os.path.join(step_dir, victim), "wb").write(bytes(data))
  alone = file_problems(step_dir, 0, 1)
  assert alone == [f"{victim} differs from the sha256 recorded at save (its bytes changed)"]
  per_host = [file_problems(step_dir, h, 2) for h in range(2)]
  finder = next(h for h, p in enumerate(per_host) if p)
  assert merge_problems(per_host) == [f"{alone[0]} [host {finder}]"]
  assert merge_problems([["state/ is missing"], ["state/ is missing"]]) == ["state/ is missing"]  # all found it


if __name__ == "__main__":
  _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
