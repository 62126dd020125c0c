"""Test-wide settings: 8 fake CPU devices for mesh tests, float32 matmuls, offline hubs."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One persistent XLA compilation cache for the whole test session: the pytest process (or xdist's controller) makes
# a fresh folder before any worker starts, and the workers and every subprocess a test launches (main jobs, hosts of
# the multi-process tests) inherit it through the environment. Many tests compile the same tiny-model programs, often
# in separate processes; this compiles each once per session. The cache is keyed by the program, the XLA flags and
# the devices, so a hit is the executable a compile would give. A fresh folder per session: results never depend on
# an earlier run. Set JAX_COMPILATION_CACHE_DIR to choose the folder (kept); JAX_ENABLE_COMPILATION_CACHE=false
# switches the cache off (as tests/train/test_resume.py does for its bit-identity runs).
if "PYTEST_XDIST_WORKER" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile

  _cache_dir = tempfile.mkdtemp(prefix="aepo_jax_test_xla_cache.")
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# Tiny models: compiling dominates most tests, so XLA:CPU compiles without LLVM optimisation (docs/performance.md,
# "Compile time against run time"); inherited by every process a test starts. Tests that time or run real workloads
# as users do (the notebooks, the newcomer's run) take it out: aepo_jax.parallel._xla_flags.without_cpu_fast_compile.
os.environ.setdefault("AEPO_JAX_CPU_FAST_COMPILE", "1")

from aepo_jax.parallel import use_cpu_xla_flags  # noqa: E402  (imports jax; its backend starts later)

use_cpu_xla_flags()  # the XLA:CPU flags the launchers use, so tests compile what users run

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
  """Longest files first (seconds per file in tests/durations.json, refreshed with tests/update_durations.py):
  with `-n 2 --dist loadfile` each worker takes whole files in this order, so the long ones start early instead
  of running alone at the end. The order within a file is kept."""
  import json
  import pathlib

  path = pathlib.Path(__file__).with_name("durations.json")
  seconds = json.loads(path.read_text()) if path.exists() else {}
  items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))


@pytest.hookimpl(trylast=True)  # after pytest's faulthandler plugin has made its stderr copy
def pytest_configure(config):
  if not config.pluginmanager.hasplugin("xdist"):
    return  # no xdist in this run
  from xdist_crash_safe import register

  register(config)  # `--dist loadfile` that survives a crashed worker; a worker's SIGINT dumps its stacks


def pytest_runtest_teardown(item, nextitem):
  """A test process compiles thousands of programs, and XLA:CPU keeps each one's machine code mapped while JAX
  caches it; near Linux's per-process limit on memory maps a compile segfaults (aepo_jax/parallel/_memory_maps.py).
  JAX's caches are cleared between two files once half the limit is passed (a file's tests may count the compiles
  they share), within a file only past 80% (~16 ms to count the maps at 30,000 entries)."""
  from aepo_jax.parallel._memory_maps import release_compiled_programs

  same_file = nextitem is not None and nextitem.path == item.path
  release_compiled_programs(0.8 if same_file else 0.5)
