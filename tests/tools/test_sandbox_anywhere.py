"""The sandbox works wherever Python lives: a venv under /tmp (symlinked or `--copies`), run from a copy of the project
under /tmp, starts both isolations with the venv's own interpreter; the start-up check names the real cause."""

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOSTILE = os.path.join(ROOT, "tests", "tools", "test_sandbox_hostile.py")


def _copy_project(dst: str) -> None:
  ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".pytest_cache")
  shutil.copytree(os.path.join(ROOT, "aepo_jax"), os.path.join(dst, "aepo_jax"), ignore=ignore)
  shutil.copytree(os.path.join(ROOT, "tests", "tools"), os.path.join(dst, "tests", "tools"), ignore=ignore)
  for name in ("tests/conftest.py", "tests/xdist_crash_safe.py", "pytest.ini", "setup.py"):
    if os.path.exists(os.path.join(ROOT, name)):
      shutil.copy(os.path.join(ROOT, name), os.path.join(dst, name))


def _make_venv(path: str, copies: bool) -> str:
  subprocess.run(
    [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", *(["--copies"] if copies else []), path],
    check=True,
    timeout=120,
  )
  # This process may itself run in a venv whose packages the base interpreter lacks: make them visible too.
  site = subprocess.run(
    [os.path.join(path, "bin", "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()
  with open(os.path.join(site, "outer_env.pth"), "w") as f:
    f.write("\n".join(sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})) + "\n")
  return os.path.join(path, "bin", "python")


@pytest.fixture(scope="module")
def tmp_project():
  """A copy of the project under /tmp with two venvs beside it, both under /tmp."""
  base = tempfile.mkdtemp(prefix="aepo_anywhere_", dir="/tmp")  # 0700, like any mkdtemp
  project = os.path.join(base, "clone")
  _copy_project(project)
  pythons = {
    "symlinks": _make_venv(os.path.join(base, "venv"), copies=False),
    "copies": _make_venv(os.path.join(base, "venv_copies"), copies=True),
  }
  yield project, pythons
  shutil.rmtree(base, ignore_errors=True)


def _run_in(project: str, python: str, code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=project, **(env_extra or {}))
  return subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=project, env=env, timeout=120)


@pytest.mark.parametrize("venv", ["symlinks", "copies"])
@pytest.mark.parametrize("isolation", ["bwrap", "unshare"])
def test_venv_under_tmp_runs_sandboxed(tmp_project, venv, isolation):
  project, pythons = tmp_project
  venv_dir = os.path.dirname(os.path.dirname(pythons[venv]))
  code = (
    "import aepo_jax, sys\nfrom aepo_jax.tools import check_sandbox, run_python\n"
    "print(aepo_jax.__file__)\n"
    f"print(check_sandbox(isolation={isolation!r}))\n"
    f"r = run_python('import sys, os; print(sys.prefix); print(os.getcwd())', timeout_s=30, "
    f"isolation={isolation!r})\n"
    "print(r.exit_code, r.text.replace(chr(10), ' '))"
  )
  out = _run_in(project, pythons[venv], code)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.splitlines()
  assert lines[0].startswith(os.path.join(project, "aepo_jax")), lines  # the copy under /tmp, not the original
  assert lines[1] == isolation
  # The sandboxed program runs the venv's own interpreter (its packages) in the sandbox's private /tmp.
  assert lines[2] == f"0 {os.path.realpath(venv_dir)} /tmp", lines


@pytest.mark.slow
def test_hostile_suite_from_a_copy_under_tmp(tmp_project):
  """The whole hostile suite, both isolations, from the copy with the `--copies` venv: nothing may be skipped."""
  project, pythons = tmp_project
  with open(HOSTILE) as f:
    n_tests = sum(line.startswith("def test_") for line in f)
  cmd = [
    pythons["copies"],
    "-m",
    "pytest",
    "tests/tools/test_sandbox_hostile.py",
    "-q",
    "-n",
    "0",
    "-rs",
    "-p",
    "no:cacheprovider",
  ]
  out = subprocess.run(
    cmd, capture_output=True, text=True, cwd=project, timeout=900, env=dict(os.environ, PYTHONPATH=project)
  )
  tail = out.stdout[-3000:] + out.stderr[-2000:]
  assert out.returncode == 0, tail
  assert f"{2 * n_tests} passed" in out.stdout and "skipped" not in out.stdout, tail


def _check_with_path(path_dirs: list[str], tmp_path) -> subprocess.CompletedProcess:
  code = (
    "import sys\nfrom aepo_jax.tools import check_sandbox, SandboxUnavailableError\n"
    "try:\n    print(check_sandbox())\nexcept SandboxUnavailableError as e:\n    print('ERROR', e)"
  )
  env = dict(os.environ, PATH=os.pathsep.join(path_dirs), PYTHONPATH=ROOT)
  return subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=120
  )


def test_check_falls_back_to_unshare_without_bwrap(tmp_path):
  only_unshare = tmp_path / "bin"
  only_unshare.mkdir()
  os.symlink(shutil.which("unshare"), only_unshare / "unshare")
  out = _check_with_path([str(only_unshare)], tmp_path)
  assert out.stdout.strip() == "unshare", out.stdout + out.stderr[-2000:]


def test_check_names_the_cause_and_the_fix(tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  out = _check_with_path([str(empty)], tmp_path)
  msg = out.stdout.strip()
  assert msg.startswith("ERROR cannot sandbox the Python tool"), out.stdout + out.stderr[-2000:]
  assert "bubblewrap is not installed" in msg and "`unshare` (util-linux) is not on PATH" in msg
  assert "apt-get install bubblewrap" in msg and "tools.allow_unsandboxed=True" in msg
  assert "\n" not in msg  # one paragraph


def test_check_reports_a_failing_sandbox_by_its_own_error(tmp_path):
  # A `bwrap` that starts but fails (as on a host whose kernel refuses namespaces): its own message is shown.
  fake = tmp_path / "fake"
  fake.mkdir()
  (fake / "bwrap").write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
  (fake / "bwrap").chmod(0o755)
  out = _check_with_path([str(fake)], tmp_path)
  msg = out.stdout.strip()
  assert "setting up uid map: Permission denied" in msg and "could not create namespaces" in msg, msg
  assert "bubblewrap is not installed" not in msg
