"""gs:// checkpoints, metrics and the compilation cache against `gcp-storage-emulator` on loopback (recipe:
docs/environment.md).

The `gcs_emulator` fixture starts the emulator itself and yields the environment that points tensorstore
(array data) and gcsfs (metadata, JSONL) at it; test_resume.py uses it for the gs:// resume test.
"""

import os
import shutil
import socket
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aepo_jax.checkpoint import CheckpointError

BUCKET = "test-bucket"


def _free_port():
  s = socket.socket()
  s.bind(("127.0.0.1", 0))
  port = s.getsockname()[1]
  s.close()
  return port


@pytest.fixture(scope="module")
def gcs_emulator(tmp_path_factory):
  exe = shutil.which("gcp-storage-emulator")
  if exe is None:
    pytest.fail("gcp-storage-emulator is not installed (pip install gcp-storage-emulator; it is in the [test] extra)")
  port = _free_port()
  data = tmp_path_factory.mktemp("gcs")
  proc = subprocess.Popen(
    [exe, "-d", str(data), "start", "--host", "127.0.0.1", "--port", str(port), "--default-bucket", BUCKET],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  url = f"http://127.0.0.1:{port}"
  env = {
    "TENSORSTORE_GCS_HTTP_URL": url,
    "STORAGE_EMULATOR_HOST": url,
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    "NO_GCE_CHECK": "true",
    "GCE_METADATA_HOST": "127.0.0.1:9",
    "GCE_METADATA_IP": "127.0.0.1:9",
    "GCE_METADATA_ROOT": "127.0.0.1:9",
  }
  try:
    for _ in range(200):
      try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        break
      except OSError:
        time.sleep(0.05)
    else:
      pytest.fail("gcp-storage-emulator did not start listening")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
  finally:
    proc.terminate()
    proc.wait(timeout=30)
    for k, v in locals().get("old", {}).items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


# The single-threaded emulator intermittently answers tensorstore's conditional OCDBT manifest write with an
# error tensorstore reports as "Malformed StorageGeneration" (about 1 run in 40 here, twice in CI: raised by the save
# itself or, from the async save's thread, as the CheckpointError that names it). It is the
# emulator, not the checkpointer: the OCDBT variant retries a whole round trip, into a fresh directory, on
# exactly that message and on nothing else; the zarr-per-leaf variant (checkpoint.ocdbt=False) never retries.
EMULATOR_FLAKE = "Malformed StorageGeneration"


def _round_trip(workdir, ocdbt):
  from aepo_jax.train import Checkpointer, check_writable

  check_writable(workdir)
  ck = Checkpointer(f"{workdir}/checkpoints/rl", keep=2, best_metric="eval/accuracy", ocdbt=ocdbt)
  state = {"params": {"w": jnp.arange(12.0).reshape(3, 4)}, "rng": np.array([1, 2], np.uint32)}
  try:
    for step, acc in ((1, 0.5), (2, None), (3, None)):
      ck.save(
        step, state, {"data_state": {"next_index": step}}, metrics=None if acc is None else {"eval/accuracy": acc}
      )
    ck.wait()
    assert ck.all_steps() == [1, 2, 3]  # last 2 + best
    restored, meta = ck.restore(None, state)
    assert np.array_equal(np.asarray(restored["params"]["w"]), np.arange(12.0).reshape(3, 4))
    assert meta["data_state"] == {"next_index": 3}
  finally:
    try:
      ck.close()
    except Exception:  # noqa: BLE001 - the save's own error is the one to report
      pass


@pytest.mark.parametrize("ocdbt", [False, True], ids=["zarr", "ocdbt"])
def test_checkpoint_round_trip_on_gcs(gcs_emulator, ocdbt):
  attempts = 3 if ocdbt else 1
  for attempt in range(attempts):
    try:
      _round_trip(f"gs://{BUCKET}/roundtrip-{'ocdbt' if ocdbt else 'zarr'}-{attempt}", ocdbt)
      return
    except (ValueError, CheckpointError) as e:  # tensorstore's error, or the async save's CheckpointError naming it
      if EMULATOR_FLAKE not in str(e) or attempt == attempts - 1:
        raise


def test_metrics_jsonl_on_gcs(gcs_emulator):
  from aepo_jax.train import JsonlWriter, read_metrics

  w = JsonlWriter(f"gs://{BUCKET}/metrics")
  w.scalars(1, {"reward/mean": 0.1})
  w.flush()
  w.scalars(2, {"reward/mean": float("inf")})
  w.flush()
  assert [(r["step"], r["reward/mean"]) for r in read_metrics(f"gs://{BUCKET}/metrics")] == [(1, 0.1), (2, None)]


def _largest_object(step_dir):
  """The largest data object of a step, found through its manifest (gs:// has no recursive glob)."""
  import json

  from etils import epath

  from aepo_jax.checkpoint._integrity import MANIFEST

  files = json.loads((epath.Path(step_dir) / MANIFEST).read_text())["files"]
  return epath.Path(step_dir) / max((k for k in files if k.startswith("state/")), key=lambda k: files[k]["size"])


def test_damaged_checkpoint_on_gcs_is_named_and_moved_aside(gcs_emulator):
  """An object replaced by one with 64 inverted bytes: named by the manifest (size + the object's crc32c from the
  listing) or, failing that, by the array checksums; the run falls back and the damaged step is renamed on gs://."""
  from etils import epath

  from aepo_jax.train import Checkpointer
  from aepo_jax.checkpoint import CheckpointCorruptError
  from aepo_jax.checkpoint._integrity import MANIFEST

  d = f"gs://{BUCKET}/integrity/checkpoints/sft"
  ck = Checkpointer(d, keep=2, ocdbt=False)  # zarr: see EMULATOR_FLAKE
  state = {"params": {"w": jnp.arange(4096.0).reshape(64, 64)}, "rng": np.array([1, 2], np.uint32)}
  for step in (1, 2):
    ck.save(step, jax.tree.map(lambda x: x * step, state), {"step": step})
  ck.wait()
  assert (epath.Path(d) / "2" / MANIFEST).exists()
  victim = _largest_object(f"{d}/2")
  data = bytearray(victim.read_bytes())
  data[100:164] = bytes(b ^ 0xFF for b in data[100:164])
  victim.write_bytes(bytes(data))
  with pytest.raises(CheckpointCorruptError) as e:
    ck.restore(2, state)
  assert e.value.step == 2 and f"{d}/2 is damaged" in str(e.value)
  step, restored, meta = ck.restore_newest_intact(state)
  assert step == 1 and meta == {"step": 1}
  assert np.array_equal(np.asarray(restored["params"]["w"]), np.asarray(state["params"]["w"]))
  assert ck.all_steps() == [1] and (epath.Path(d) / "2.damaged" / "state").exists()
  ck.close()


def test_unreachable_storage_fails_in_seconds_naming_the_settings(monkeypatch):
  """No network (or a dead emulator) used to cost gcsfs 60-90 s of retries before any error."""
  import time

  from aepo_jax.train import CheckpointError, check_writable
  from aepo_jax.checkpoint import check_remote

  closed = f"http://127.0.0.1:{_free_port()}"
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", closed)
  monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", closed)
  t0 = time.monotonic()
  with pytest.raises(CheckpointError) as e:
    check_writable("gs://bucket/run")
  assert time.monotonic() - t0 < 10
  for needle in (
    f"the storage service at {closed} does not answer",
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_APPLICATION_CREDENTIALS",
  ):
    assert needle in str(e.value)
  silent = socket.socket()  # accepts connections, never answers
  silent.bind(("127.0.0.1", 0))
  silent.listen(8)
  url = f"http://127.0.0.1:{silent.getsockname()[1]}"
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
  monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", url)
  t0 = time.monotonic()
  with pytest.raises(CheckpointError, match="does not answer \\(no answer within 1 s\\)"):
    check_remote("gs://bucket/run", timeout_s=1.0)
  assert time.monotonic() - t0 < 10  # a 1 s deadline; 10x for a loaded 2-core machine
  silent.close()
  monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL")
  with pytest.raises(CheckpointError, match="TENSORSTORE_GCS_HTTP_URL is not"):
    check_remote("gs://bucket/run")


@pytest.mark.parametrize("which", ["socket", "join"])
def test_unanswered_probe_reads_the_same_whichever_timer_fires_first(monkeypatch, which):
  """The socket's time-out and the thread's deadline race; the user reads one message either way."""
  import socket
  import threading
  import urllib.error
  import urllib.request

  from aepo_jax.checkpoint._storage import _no_answer

  release = threading.Event()

  def urlopen(url, timeout):
    if which == "socket":  # the socket's own time-out fires first
      raise urllib.error.URLError(socket.timeout("timed out"))
    release.wait(30)  # the join's deadline fires first
    raise urllib.error.URLError("never reached")

  monkeypatch.setattr(urllib.request, "urlopen", urlopen)
  try:
    assert _no_answer("http://127.0.0.1:9", 0.2) == "no answer within 0.2 s"
  finally:
    release.set()


def test_refused_probe_says_refused(monkeypatch):
  import urllib.error
  import urllib.request

  from aepo_jax.checkpoint._storage import _no_answer

  def urlopen(url, timeout):
    raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))

  monkeypatch.setattr(urllib.request, "urlopen", urlopen)
  assert "Connection refused" in _no_answer("http://127.0.0.1:9", 5)


COMPILE = """
import json, sys
import jax, jax.numpy as jnp
from aepo_jax.parallel import compile_cache_stats, use_compile_cache
print(json.dumps(dict(folder=use_compile_cache(sys.argv[1], "unused"))))
jax.jit(lambda x: jnp.tanh(x @ x.T).sum() * 3.0)(jnp.ones((29, 7))).block_until_ready()
print(json.dumps(compile_cache_stats()))
"""


def test_compilation_cache_on_gcs(gcs_emulator):
  """train.compile_cache=gs://...: the first process writes the program there, the second reads it back."""
  import json
  import sys

  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  folder = f"gs://{BUCKET}/compile_cache"
  runs = []
  for _ in range(2):
    out = subprocess.run([sys.executable, "-c", COMPILE, folder], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert json.loads(lines[0]) == {"folder": folder}
    runs.append(json.loads(lines[-1]))
  assert runs[0]["requests"] >= 1 and runs[0]["hits"] == 0, runs  # the jit, and jnp.ones' own programs
  assert runs[1]["requests"] == runs[1]["hits"] == runs[0]["requests"], runs
