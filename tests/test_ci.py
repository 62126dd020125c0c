"""CI runs the README's test command in a fresh virtual environment, so every program that command calls must be
installed by the command's own installs (the project's extras), never by hand: a machine where ruff was installed
earlier once hid a missing `ruff` in the `test` extra."""

import ast
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Programs every fresh venv has before anything is installed.
_VENV_PROGRAMS = {"pip", "python", "python3"}


def _readme_blocks() -> list[str]:
  with open(os.path.join(ROOT, "README.md")) as f:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)\n```", f.read(), flags=re.S)]


def _extras() -> dict[str, list[str]]:
  """setup.py's extras_require, read statically (an installed package's metadata may be stale)."""
  with open(os.path.join(ROOT, "setup.py")) as f:
    tree = ast.parse(f.read())
  consts = {
    node.targets[0].id: ast.literal_eval(node.value)
    for node in tree.body
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Constant)
  }
  for node in ast.walk(tree):
    if isinstance(node, ast.keyword) and node.arg == "extras_require":
      out = {}
      for key, value in zip(node.value.keys, node.value.values):
        out[ast.literal_eval(key)] = [
          consts[e.id] if isinstance(e, ast.Name) else ast.literal_eval(e) for e in value.elts
        ]
      return out
  raise AssertionError("setup.py has no extras_require")


def _requirement_name(req: str) -> str:
  return re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_every_program_of_the_readme_test_command_comes_from_its_extras():
  command = _readme_blocks()[1]
  parts = [shlex.split(p)[0] for p in command.split("&&")]
  installs = [shlex.split(p) for p in command.split("&&") if shlex.split(p)[:2] == ["pip", "install"]]
  extras = _extras()
  installed = set()
  for args in installs:
    rest = iter(args[2:])
    for arg in rest:
      if arg in ("-c", "--constraint", "-r", "--requirement"):
        next(rest)  # the option's file
      elif arg.startswith("-"):
        continue
      elif re.fullmatch(r"\.\[[\w,]+\]", arg):  # the project with extras
        for extra in arg[2:-1].split(","):
          installed |= {_requirement_name(r) for r in extras[extra]}
      elif arg != ".":
        installed.add(_requirement_name(arg))
  # A program is provided by the distribution of the same name (ruff, pytest, ...): each one the command calls
  # beyond the venv's own must be installed by the command itself.
  missing = sorted({p for p in parts if p not in _VENV_PROGRAMS and p.replace("_", "-") not in installed})
  assert not missing, f"the README's test command calls {missing}, which its installs do not bring: add to an extra"
  assert "ruff" in parts  # the check is about something


def test_ci_runs_the_readme_test_command_in_a_fresh_venv():
  with open(os.path.join(ROOT, ".ci", "run")) as f:
    script = f.read()
  assert "python3 -m venv" in script and 'source "$venv_root/venv/bin/activate"' in script
  assert "rm -rf" in script  # the venv is removed afterwards
  assert 'blocks[1]' in script  # the README's own second command, read at run time


def _python_floor() -> str:
  with open(os.path.join(ROOT, "setup.py")) as f:
    match = re.search(r'python_requires=">=(\d+\.\d+)"', f.read())
  assert match, "setup.py states no python_requires floor"
  return match.group(1)


@pytest.mark.slow
def test_the_pinned_tpu_stack_resolves_for_the_lowest_declared_python(tmp_path):
  """A TPU VM may bring an older Python than this machine: the [tpu,gcs] extras, pinned by .ci/constraints.txt,
  must resolve (wheels only, as on a TPU VM) for setup.py's python_requires floor, or a drifting pin fails here,
  not on a pod. Asks the package index, installs nothing."""
  floor = _python_floor()
  report = tmp_path / "report.json"
  out = subprocess.run(
    [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    + ["--python-version", floor, "--only-binary=:all:", "--target", str(tmp_path / "target")]
    + ["--report", str(report), "-c", os.path.join(ROOT, ".ci", "constraints.txt"), f"{ROOT}[tpu,gcs]"],
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert out.returncode == 0, f"[tpu,gcs] does not resolve for Python {floor}:\n{out.stderr[-3000:]}"
  install = json.loads(report.read_text())["install"]
  resolved = {_requirement_name(i["metadata"]["name"]): i["metadata"]["version"] for i in install}
  with open(os.path.join(ROOT, ".ci", "constraints.txt")) as f:
    pins = dict(line.strip().split("==") for line in f if "==" in line and not line.startswith("#"))
  pins = {_requirement_name(k): v for k, v in pins.items()}
  for name in ("jax", "jaxlib", "libtpu", "flax", "orbax-checkpoint", "numpy"):
    assert resolved.get(name) == pins[name], (name, resolved.get(name), pins[name])
