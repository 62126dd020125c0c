"""A non-editable install runs from any directory (#36).

The slow tests build a wheel of this tree, install it with `pip install --target` into a folder of its own, and run
it with that folder as PYTHONPATH and a temporary directory as the working directory, so nothing can resolve against
the checkout: every module, config, launcher and kernel source ships; every subpackage imports from the installed
copy; the configs load by the README's names (`configs/aepo_gaia.py` through its common.py); the launchers answer
`--help` as `python -m aepo_jax.launch.NAME`; the CPU default passes `--dry_run`; the C++ kernels build from the
installed sources; and the ARPO data, which is not shipped, is reported with the variable that points to it.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

from aepo_jax.train import ConfigError, find_config, load_config, resolve_config_flag, to_json

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHIPPED = {"aepo_jax": "aepo_jax", "configs": "aepo_jax/configs", "launch": "aepo_jax/launch"}  # checkout -> wheel
LAUNCHERS = sorted(p.stem for p in (ROOT / "launch").glob("*.py") if p.stem != "__init__")


# ---------------------------------------------------------------------------------------------------------
# Config names: a `configs/X.py` that is not in the working directory is the shipped one (fast)
# ---------------------------------------------------------------------------------------------------------
def test_a_config_path_not_found_here_is_the_shipped_config(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  shipped = ROOT / "configs" / "aepo_gaia.py"  # a checkout ships its own configs/ folder
  assert find_config("configs/aepo_gaia.py") == str(shipped)
  assert find_config("./configs/aepo_gaia.py:released") == f"{shipped}:released"
  assert find_config("configs/testing/tiny_rl.py") == str(ROOT / "configs" / "testing" / "tiny_rl.py")
  assert resolve_config_flag(["prog", "--config", "configs/aepo_gaia.py", "--config.rollout.n=2"]) == [
    "prog",
    "--config",
    str(shipped),
    "--config.rollout.n=2",
  ]
  assert resolve_config_flag(["prog", "--config=configs/aepo_gaia.py:released"]) == [
    "prog",
    f"--config={shipped}:released",
  ]
  released = load_config("configs/aepo_gaia.py", "released")
  assert to_json(released) == to_json(load_config(str(shipped), "released")) != to_json(load_config(str(shipped)))


def test_a_config_file_in_the_working_directory_wins(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "cpu_default.py").write_text("")
  assert find_config("configs/cpu_default.py:x") == "configs/cpu_default.py:x"


def test_a_config_found_nowhere_names_the_closest_shipped_one(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ConfigError, match=r"'configs/aepo_gia.py' exists neither .* did you mean 'configs/aepo_gaia.py'"):
    resolve_config_flag(["prog", "--config=configs/aepo_gia.py:released"])
  with pytest.raises(ConfigError, match="/abs/cpu_default.py"):  # an absolute path is never looked up elsewhere
    load_config("/abs/cpu_default.py")
  proc = subprocess.run(
    [sys.executable, str(ROOT / "launch" / "tpu_pod.py"), "--config=configs/aepo_gia.py", "--dry_run"],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.startswith("error: config file 'configs/aepo_gia.py' exists neither here nor"), proc.stderr


# ---------------------------------------------------------------------------------------------------------
# The installed wheel, run from another directory (slow: builds and installs it once per module)
# ---------------------------------------------------------------------------------------------------------
def _check(cmd, **kw) -> str:
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
  assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
  return proc.stdout


def _copy_tree(src: pathlib.Path) -> pathlib.Path:
  """What setup.py packages, copied from this working tree."""
  src.mkdir()
  for name in ("setup.py", "pyproject.toml"):
    shutil.copy2(ROOT / name, src / name)
  for name in SHIPPED:
    shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
  return src


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  """The wheel of a copy of this tree (a build in the checkout would leave build/ there), installed with
  `pip install --target`: no venv, no index, no build isolation."""
  tmp = tmp_path_factory.mktemp("install")
  src = _copy_tree(tmp / "src")
  pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
  _check([*pip, "wheel", "--no-deps", "--no-index", "--no-build-isolation", "-q", "-w", str(tmp / "dist"), str(src)])
  (wheel,) = (tmp / "dist").glob("aepo_jax-*.whl")
  _check([*pip, "install", "--no-deps", "--no-index", "-q", "--target", str(tmp / "site"), str(wheel)])
  return tmp / "site"


def _run(site, cwd, *args, check=True):
  """`python ARGS` in `cwd` (not the checkout) with only the installed copy on the path; no ARPO data."""
  assert ROOT not in pathlib.Path(cwd).resolve().parents
  env = {k: v for k, v in os.environ.items() if k != "AEPO_ARPO_DATA"}
  env["PYTHONPATH"] = str(site)
  proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
  if check:
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
  return proc


def _python(site, cwd, code: str) -> str:
  return _run(site, cwd, "-c", textwrap.dedent(code)).stdout


@pytest.mark.slow
def test_the_wheel_ships_every_module_config_launcher_and_kernel_source(site):
  missing = [
    f"{name}/{p.relative_to(ROOT / name)}"
    for name, installed in SHIPPED.items()
    for p in (ROOT / name).rglob("*")
    if p.suffix in (".py", ".cc", ".h")
    and "__pycache__" not in p.parts
    and not (site / installed / p.relative_to(ROOT / name)).is_file()
  ]
  assert not missing, f"not in the wheel: {missing}"


@pytest.mark.slow
def test_every_subpackage_imports_from_the_installed_copy(site, tmp_path):
  packages = sorted(".".join(p.parent.relative_to(site).parts) for p in (site / "aepo_jax").rglob("__init__.py"))
  assert {"aepo_jax", "aepo_jax.launch", "aepo_jax.rollout.policies"} <= set(packages)
  out = _python(
    site,
    tmp_path,
    f"""
    import importlib
    for name in {packages!r}:
      print(name, importlib.import_module(name).__file__)
    """,
  )
  files = dict(line.split(" ", 1) for line in out.splitlines())
  assert sorted(files) == packages
  assert all(pathlib.Path(f).is_relative_to(site) for f in files.values()), out


@pytest.mark.slow
def test_shipped_configs_load_by_their_readme_names(site, tmp_path):
  out = _python(
    site,
    tmp_path,
    """
    from aepo_jax import train
    for path, arg in [("configs/cpu_default.py", None), ("configs/aepo_gaia.py", None),
                      ("configs/aepo_gaia.py", "released"), ("configs/testing/tiny_rl.py", None)]:
      config = train.load_config(path, arg)  # aepo_gaia: common.py; tiny_rl: tiny_sft.py (load_sibling)
      print(train.find_config(path), config.algo.loss, config.rollout.mode)
    """,
  )
  lines = out.splitlines()
  configs = site / "aepo_jax" / "configs"
  assert [line.split()[0] for line in lines] == [
    str(configs / "cpu_default.py"),
    str(configs / "aepo_gaia.py"),
    str(configs / "aepo_gaia.py"),
    str(configs / "testing" / "tiny_rl.py"),
  ]
  assert lines[1].split()[2] != lines[2].split()[2]  # the `:released` preset reached get_config


@pytest.mark.slow
@pytest.mark.parametrize("name", LAUNCHERS)
def test_every_launcher_answers_help_as_a_module(site, tmp_path, name):
  proc = _run(site, tmp_path, "-m", f"aepo_jax.launch.{name}", "--help", check=False)
  assert proc.returncode in (0, 1), proc.stderr[-3000:]  # absl exits 1 after printing --help
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  summary = (ROOT / "launch" / f"{name}.py").read_text().split('"""', 2)[1].strip().splitlines()[0]
  assert summary in proc.stdout


@pytest.mark.slow
def test_the_cpu_default_dry_run_passes_from_another_directory(site, tmp_path):
  """The README's main command with --dry_run: the bundled model, tokenizer, task suite and tools, no device."""
  args = ["-m", "aepo_jax.launch.tpu_pod", "--config=configs/cpu_default.py", "--dry_run"]
  out = _run(site, tmp_path, *args, f"--config.workdir={tmp_path / 'run'}").stdout
  assert f"dry run of {site / 'aepo_jax' / 'configs' / 'cpu_default.py'}:" in out
  assert "verdict: ready to run" in out


@pytest.mark.slow
def test_a_pod_config_dry_run_names_the_variable_for_the_arpo_data(site, tmp_path):
  """The ARPO data is not shipped: the dry run of a paper config says which variable points to it."""
  args = ["-m", "aepo_jax.launch.tpu_pod", "--config=configs/aepo_gaia.py", "--dry_run"]
  proc = _run(site, tmp_path, *args, check=False)
  assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert f"dry run of {site / 'aepo_jax' / 'configs' / 'aepo_gaia.py'}:" in proc.stdout
  assert "data.train='hard_search_1k'" in proc.stderr and "set $AEPO_ARPO_DATA" in proc.stderr, proc.stderr
  # an installed package looks in its cache folder, not beside site-packages
  cache = os.environ.get("AEPO_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "aepo_jax")
  assert os.path.join(cache, "arpo", "train", "hard_search_1k.parquet") in proc.stderr, proc.stderr


@pytest.mark.slow
def test_the_cpu_kernels_build_from_the_installed_sources(site, tmp_path):
  """Sources and header are read from the installed copy (the kernel cache is keyed by their bytes, so a kernel
  built earlier from the checkout's equal sources is reused)."""
  out = _python(
    site,
    tmp_path,
    """
    from aepo_jax.model import _cpu_attention, _cpu_decode
    for lib in (_cpu_decode, _cpu_attention):
      print(lib._SRC, lib.available(), lib.reason() or "-")
    """,
  )
  for line in out.splitlines():
    src, ok, reason = line.split(" ", 2)
    assert pathlib.Path(src).is_relative_to(site / "aepo_jax" / "model" / "csrc"), line
    # a machine without the instructions the kernels need falls back to XLA; a missing source is a failure
    assert ok == "True" or "x86-64" in reason or "lacks" in reason, line


@pytest.mark.slow
def test_an_editable_install_runs_the_launchers_as_modules_too(tmp_path):
  """`pip install -e .` maps aepo_jax.launch to launch/ (it has an __init__.py for this) and finds the configs in
  the tree it points to."""
  src, venv, cwd = _copy_tree(tmp_path / "src"), tmp_path / "venv", tmp_path / "cwd"
  cwd.mkdir()
  _check([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)])
  python = str(venv / "bin" / "python")
  _check([python, "-m", "pip", "install", "--no-deps", "--no-index", "--no-build-isolation", "-q", "-e", str(src)])
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  code = "import aepo_jax.launch as l, aepo_jax.train as t; print(l.__file__, t.find_config('configs/grpo_gaia.py'))"
  out = _check([python, "-c", code], cwd=cwd, env=env)
  assert out.split() == [str(src / "launch" / "__init__.py"), str(src / "configs" / "grpo_gaia.py")]


@pytest.mark.slow
def test_the_installed_main_job_trains_and_its_checkpoint_evaluates_from_another_directory(site, tmp_path):
  """The main job (the tiny config, shrunk: SFT, one RL step with the sandboxed Python and local search) and then
  `aepo_jax.launch.evaluate` on its checkpoint, both from the installed copy in a folder outside the checkout."""
  tok = tmp_path / "tok"
  _python(site, tmp_path, f"from aepo_jax.testing import tiny_tokenizer; tiny_tokenizer({str(tok)!r})")
  workdir = tmp_path / "run"
  overrides = ("sft.steps=1", "train.steps=1", "eval.before_rl=False", "data.suite.n_heldout=2", "eval.batch_size=2")
  out = _run(
    site,
    tmp_path,
    "-m",
    "aepo_jax.launch.tpu_pod",
    "--config=configs/testing/tiny_rl.py",
    f"--config.workdir={workdir}",
    f"--config.model.tokenizer={tok}",
    *(f"--config.{o}" for o in overrides),
  )
  assert "'rl/steps': 1" in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
  assert (workdir / "checkpoints" / "rl" / "1").is_dir()
  data = tmp_path / "qa.jsonl"
  data.write_text('{"question": "What is 6 + 12?", "answer": "18"}\n{"question": "Name a colour.", "answer": "red"}\n')
  args = [f"--checkpoint={workdir}", f"--benchmarks={data}", "--data_family=qa", "--n=1", "--k=1"]
  args += ["--temperature=0", "--max_response_len=16", "--batch_size=2", "--protocol=project", "--noprogress"]
  _run(site, tmp_path, "-m", "aepo_jax.launch.evaluate", *args, f"--output={tmp_path / 'eval'}")
  import json

  summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
  assert summary["benchmarks"]["qa"]["num_answers"] == 2, summary
