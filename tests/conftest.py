"""Test-wide settings: 8 fake CPU devices for mesh tests, float32 matmuls, offline hubs."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from aepo_jax.parallel import use_cpu_xla_flags  # noqa: E402  (imports jax; its backend starts later)

use_cpu_xla_flags()  # the XLA:CPU flags the launchers use, so tests compile what users run

import jax  # noqa: E402

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
