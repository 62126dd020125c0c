"""Every notebook in colabs/ runs top to bottom on CPU at the CI size, and is committed without outputs.

The notebooks read AEPO_COLAB_SIZE=ci from the environment and shrink every size. They run in a fresh Jupyter
kernel (nbclient) on one CPU device, as on a user's machine: the 8 fake devices of tests/conftest.py are removed.
AEPO_COLAB_TEST_SIZE=cpu runs them at the size a CPU user gets instead (the quickstart's `cpu` size must finish in
10 minutes on 2 cores too):
  AEPO_COLAB_TEST_SIZE=cpu python -m pytest tests/colabs/test_notebooks.py -k "runs and quickstart" -s
Executed copies go to pytest's tmp_path (kept for debugging), never back into colabs/.
"""

import os
import pathlib
import re
import time

import nbformat
import pytest

from aepo_jax.parallel._xla_flags import FAST_COMPILE_ENV, without_cpu_fast_compile

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "colabs").glob("*.ipynb"))
EXPECTED = {"aepo_objective.ipynb", "quickstart.ipynb", "evaluate_checkpoint.ipynb"}
# The quickstart's CPU run finishes in under 10 minutes on 2 cores (CI size here; `cpu` size measured
# with AEPO_COLAB_TEST_SIZE=cpu).
WALL_BUDGET_S = {"quickstart.ipynb": float(os.environ.get("AEPO_QUICKSTART_BUDGET_S", 600))}
CELL_TIMEOUT_S = 900
# Figures each notebook must draw from its own run (curves, trees, gradient weights), not stored images.
MIN_FIGURES = {"aepo_objective.ipynb": 3, "quickstart.ipynb": 3}


def test_every_expected_notebook_exists():
  assert EXPECTED <= {p.name for p in NOTEBOOKS}, f"colabs/ holds {[p.name for p in NOTEBOOKS]}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_as_source_only(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  for i, cell in enumerate(nb.cells):
    if cell.cell_type == "code":
      assert not cell.outputs, f"{path.name} cell {i} has outputs: clear them before committing"
      assert cell.execution_count is None, f"{path.name} cell {i} has an execution count: clear outputs"
  first = nb.cells[0]
  assert first.cell_type == "markdown", f"{path.name} must open with a markdown cell"
  for word in ("**Needs:**", "**Shows:**"):
    assert word in first.source, f"{path.name}: the opening cell must say {word} (runtime, time, memory; result)"
  sources = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
  assert "AEPO_COLAB_SIZE" in sources, f"{path.name} must read AEPO_COLAB_SIZE (the CI size switch)"
  assert "'google.colab' in sys.modules" in sources.replace('"', "'"), f"{path.name}: guard the install for Colab"


def _kernel_env(monkeypatch):
  monkeypatch.setenv("AEPO_COLAB_SIZE", os.environ.get("AEPO_COLAB_TEST_SIZE", "ci"))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
  monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
  env = without_cpu_fast_compile(dict(os.environ))  # a notebook runs as a user's: compiled for speed
  flags = " ".join(
    f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")
  )
  monkeypatch.setenv("XLA_FLAGS", flags)
  monkeypatch.setenv(FAST_COMPILE_ENV, env[FAST_COMPILE_ENV])


@pytest.fixture(scope="module")
def evaluation_cache(tmp_path_factory):
  """A JAX compilation cache shared by this module's two runs of evaluate_checkpoint.ipynb: they build the same
  engine (same model, slots and lengths), so the second takes its programs from the first's compile. The other
  notebooks compile for themselves (the quickstart's wall-time budget is measured as a user's first run)."""
  return tmp_path_factory.mktemp("jax_cache")


def _share_compiles(monkeypatch, cache_dir):
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(cache_dir))
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom_on_cpu(path, tmp_path, monkeypatch, evaluation_cache):
  from nbclient import NotebookClient
  from nbclient.exceptions import CellExecutionError

  _kernel_env(monkeypatch)
  if path.name == "evaluate_checkpoint.ipynb":
    _share_compiles(monkeypatch, evaluation_cache)
  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(
    nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
  )
  t0 = time.perf_counter()
  try:
    client.execute()
  except CellExecutionError as e:
    plain = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # the kernel's traceback comes with terminal colours
    pytest.fail(f"{path.name} failed (executed copy: {tmp_path / path.name}):\n{plain}", pytrace=False)
  finally:
    nbformat.write(nb, tmp_path / path.name)
  wall_s = time.perf_counter() - t0
  print(f"{path.name}: {wall_s:.0f} s at the {os.environ['AEPO_COLAB_SIZE']!r} size")
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
  assert not errors, f"{path.name}: {errors[0]['ename']}: {errors[0]['evalue']}"
  images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
  assert images >= MIN_FIGURES.get(path.name, 0), f"{path.name} drew {images} figures"
  budget = WALL_BUDGET_S.get(path.name)
  if budget is not None:
    assert wall_s < budget, (
      f"{path.name} took {wall_s:.0f} s at the {os.environ['AEPO_COLAB_SIZE']!r} size, over its {budget:.0f} s budget"
    )


@pytest.mark.slow
def test_evaluation_notebook_runs_without_the_arpo_data(tmp_path, monkeypatch, evaluation_cache):
  """A Colab clone has no ARPO evaluation sets: the notebook says so and evaluates generated questions instead."""
  from nbclient import NotebookClient

  _kernel_env(monkeypatch)
  _share_compiles(monkeypatch, evaluation_cache)
  monkeypatch.setenv("AEPO_ARPO_DATA", str(tmp_path / "no_arpo_data"))
  path = ROOT / "colabs" / "evaluate_checkpoint.ipynb"
  nb = nbformat.read(path, as_version=4)
  NotebookClient(
    nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
  ).execute()
  text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
  assert "ARPO data not found" in text and "generated arithmetic questions" in text, text[-2000:]
  tables = "\n".join(str(o.get("data", {})) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
  assert "| aepo_generated_math |" in tables, tables[-2000:]  # the per-benchmark table has its row
