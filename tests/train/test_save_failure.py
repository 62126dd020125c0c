"""A checkpoint save that fails (permission denied, disk full) ends the run: one `error:` line naming the step that
failed, its path and the fix, raised at the next step (not the next save), and the process exits non-zero in a
bounded time although Orbax's signalling threads of the failed save would wait minutes; the newest intact
checkpoint stays as it was."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from aepo_jax.checkpoint import _integrity as integrity
from aepo_jax.checkpoint._storage import _EXIT_GRACE_S, save_failure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The root user of a CI container writes through chmod 0o555, so the failure is injected where the file system
# would refuse it: the creation of the temporary directory of every step from FAIL_FROM on (in Orbax's thread).
DRIVER = textwrap.dedent("""
    import os, re, runpy, sys
    fail_from = int(os.environ["FAIL_FROM"])
    real_mkdir = os.mkdir
    def mkdir(path, *a, **k):
      m = re.search(r"/checkpoints/sft/(\\d+)\\.orbax-checkpoint-tmp", os.fspath(path))
      if m and int(m.group(1)) >= fail_from:
        raise PermissionError(13, "Permission denied", os.fspath(path))
      return real_mkdir(path, *a, **k)
    os.mkdir = mkdir
    sys.argv = ["launch/tpu_pod.py", "--config=configs/testing/tiny_sft.py", "--config.workdir=" + sys.argv[1]]
    sys.path.insert(0, os.getcwd())
    runpy.run_path("launch/tpu_pod.py", run_name="__main__")
""")


def _run_until_exit(cmd, env, deadline_s):
  """(returncode, stderr, seconds from the `error:` line to the exit); kills the process at the deadline."""
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  lines, seen = [], {}

  def read():
    for line in proc.stderr:
      lines.append(line)
      if line.startswith("error:") and "t" not in seen:
        seen["t"] = time.monotonic()

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  try:
    proc.wait(timeout=deadline_s)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
    pytest.fail("the trainer did not exit after a failed save:\n" + "".join(lines)[-3000:])
  reader.join(30)
  return proc.returncode, "".join(lines), time.monotonic() - seen.get("t", time.monotonic())


def test_a_failed_save_names_its_step_and_the_process_exits(tmp_path):
  workdir = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu", FAIL_FROM="6", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  # Orbax's threads wait 300 s for a failed save's signals: a process still alive then is the hang.
  rc, err, after_error_s = _run_until_exit([sys.executable, "-c", DRIVER, str(workdir)], env, deadline_s=280)
  assert rc != 0
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, err[-3000:]
  ckpt_dir = str(workdir / "checkpoints" / "sft")
  assert f"saving step 6 to '{ckpt_dir}' failed: permission denied on {ckpt_dir}/6.orbax-checkpoint-tmp" in errors[0]
  assert f"make {ckpt_dir} writable" in errors[0] and "(step 3) is untouched" in errors[0]
  assert after_error_s < 10 * (_EXIT_GRACE_S + 5), after_error_s  # the watchdog's grace; 10x for a loaded machine
  # Raised before step 7 started: the save of step 9 was never attempted.
  assert "9.orbax-checkpoint-tmp" not in err
  # The newest intact checkpoint is untouched and verifies.
  steps = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
  assert steps == [3]
  assert integrity.file_problems(f"{ckpt_dir}/3") == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a read-only mode")
def test_a_read_only_checkpoint_directory_fails_the_first_save_and_exits(tmp_path):
  workdir = tmp_path / "run"
  (workdir / "checkpoints" / "sft").mkdir(parents=True)
  os.chmod(workdir / "checkpoints" / "sft", 0o555)
  try:
    env = dict(os.environ, JAX_PLATFORMS="cpu", FAIL_FROM="1000000")
    rc, err, _ = _run_until_exit([sys.executable, "-c", DRIVER, str(workdir)], env, deadline_s=280)
  finally:
    os.chmod(workdir / "checkpoints" / "sft", 0o755)
  assert rc != 0 and "error: saving step 3 to" in err and "permission denied" in err, err[-3000:]


def test_disk_full_reads_as_one_line_with_the_fix():
  e = ValueError("RESOURCE_EXHAUSTED: Error writing local file \"/w/ckpt/6.orbax-checkpoint-tmp/x\": No space left")
  msg = save_failure("/w/ckpt", 6, e, intact=3)
  assert "\n" not in msg
  assert msg.startswith("saving step 6 to '/w/ckpt' failed: the disk holding /w/ckpt is full")
  assert "free space there" in msg and "(step 3) is untouched" in msg
  e = OSError(28, "No space left on device", "/w/ckpt/6.orbax-checkpoint-tmp")
  assert "is full" in save_failure("/w/ckpt", 6, e)
  assert "a rerun starts afresh" in save_failure("/w/ckpt", 6, e)
