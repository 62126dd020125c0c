"""tests/xdist_crash_safe.py: an inner `pytest -n 2 --dist loadfile` whose workers die in the middle of a file (a
segfault that happens once, an abort that happens every time, a worker that sends itself SIGINT the way execnet
ends an orphaned worker) finishes, reruns only what did not finish, and fails only the test
that crashed twice. With xdist's own LoadFileScheduling the same session runs the crashed tests again after failing them and then waits
forever (checked by hand: killed at 120 s)."""

import os
import subprocess
import sys
import textwrap

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

CONFTEST = f"""
import sys
sys.path.insert(0, {TESTS_DIR!r})
import pytest

@pytest.hookimpl(trylast=True)
def pytest_configure(config):
  from xdist_crash_safe import register
  register(config)
"""

# Every test appends its name to runs.log, so the test below counts how often each ran.
HELPERS = """
import ctypes, os, pathlib, signal, time
LOG = pathlib.Path(__file__).with_name("runs.log")
def ran(name):
  with open(LOG, "a") as f:
    f.write(name + " " + os.environ["PYTEST_XDIST_WORKER"] + "\\n")
def segfault():
  ctypes.string_at(0)
"""

FILES = {
  # The first to start (alphabetical order within -n 2): its crash-once test dies on the first try only.
  "test_a.py": """
from helpers import ran, segfault, LOG
import pathlib
def test_a1(): ran("a1")
def test_a_crash_once():
  ran("a_crash_once")
  flag = pathlib.Path(LOG).with_name("crashed_once")
  if not flag.exists():
    flag.write_text("x")
    segfault()
def test_a3(): ran("a3")
def test_a4(): ran("a4")
""",
  "test_b.py": """
from helpers import ran
import os
def test_b1(): ran("b1")
def test_b_crash_always():
  ran("b_crash_always")
  os.abort()
def test_b3(): ran("b3")
""",
  "test_c.py": """
from helpers import ran
import os, pathlib, signal, time, ctypes
from helpers import LOG
def test_c1(): ran("c1")
def test_c_sigint_once():
  # execnet's way of ending a worker whose input pipe ended: SIGINT to itself (os._exit(1) 10 s later). As a
  # KeyboardInterrupt it would end the whole session.
  ran("c_sigint_once")
  flag = pathlib.Path(LOG).with_name("sigint_once")
  if not flag.exists():
    flag.write_text("x")
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(10)
def test_c3(): ran("c3")
""",
  "test_d.py": "\n".join(["from helpers import ran"] + [f"def test_d{i}(): ran('d{i}')" for i in range(8)]),
}


@pytest.mark.skipif(sys.platform != "linux", reason="the crashes are Linux signals")
def test_crashed_workers_rerun_once_and_nothing_else_reruns(tmp_path):
  (tmp_path / "conftest.py").write_text(CONFTEST)
  (tmp_path / "helpers.py").write_text(HELPERS)
  for name, text in FILES.items():
    (tmp_path / name).write_text(textwrap.dedent(text))
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_"))}
  proc = subprocess.run(
    [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider", "-q", "-rA",
     "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path)],
    cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  out = proc.stdout + proc.stderr
  runs = [line.split() for line in (tmp_path / "runs.log").read_text().splitlines()]
  names = [name for name, _ in runs]
  counts = {name: names.count(name) for name in set(names)}
  # Each rerun ran on a worker started after the crash (gw0 and gw1 are the first two).
  for name in ("a_crash_once", "b_crash_always", "c_sigint_once"):
    first, again = [int(worker[2:]) for n, worker in runs if n == name]
    assert again >= 2 and again != first, (name, runs)
  # The crashed tests ran twice; the always-crashing one failed; every other test ran exactly once.
  assert counts.pop("a_crash_once") == 2 and counts.pop("b_crash_always") == 2, out
  assert counts.pop("c_sigint_once") == 2, out
  assert set(counts.values()) == {1} and len(counts) == 3 + 2 + 2 + 8, (counts, out)
  assert proc.returncode == 1, out
  assert "1 failed, 17 passed" in out, out
  assert "FAILED test_b.py::test_b_crash_always" in out, out
  assert "died while running test_a.py::test_a_crash_once: running it once more on a fresh worker" in out, out
  assert "test_b.py::test_b_crash_always: worker" in out and "died while running it; reported failed" in out, out
  assert "got SIGINT: exiting" in out and "in test_c_sigint_once" in out, out  # the stacks at the SIGINT
  assert "workers that died (tests/xdist_crash_safe.py)" in out, out
