"""The process's memory-map entries against Linux's per-process limit, and freeing compiled XLA:CPU programs near it.

XLA:CPU loads every compiled program's machine code through LLVM's JIT, which maps each object file's sections as
separate regions (code, read-only data, data): a tiny model's forward and backward holds about 46 map entries, and
they stay mapped while JAX's caches hold the executable. Linux caps the entries per process (`vm.max_map_count`,
65530 by default). A process that compiles thousands of programs (a test worker: up to ~190 new entries a second)
reaches it, and the next compile fails: LLVM logs "Cannot allocate memory" and XLA then segfaults, in the compile or
in the persistent-cache write after it (reproduced by taking the entries up to the limit; docs/benchmarks.md). A
training or serving process compiles a bounded set of programs (the embedded default's main job, SFT, RL and both
evaluations: at most 8,014 entries, 2026-12-07).

`release_compiled_programs(fraction)` clears JAX's caches when the entries pass `fraction` of the limit, which
unmaps every program nothing else holds (tests/conftest.py calls it after each test).
"""

from __future__ import annotations

import gc
import logging
from typing import Optional, Tuple

log = logging.getLogger(__name__)


def memory_maps() -> Optional[Tuple[int, int]]:
  """(map entries this process holds, vm.max_map_count), or None where /proc does not say (not Linux)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      used = f.read().count(b"\n")
    with open("/proc/sys/vm/max_map_count") as f:
      limit = int(f.read())
  except (OSError, ValueError):
    return None
  return used, limit


def release_compiled_programs(fraction: float = 0.5) -> bool:
  """Clears JAX's compilation caches (and collects garbage) when this process holds more than `fraction` of its
  memory-map limit; returns whether it did. Programs compile again on their next call (from the persistent
  compilation cache when one is set)."""
  if not 0.0 < fraction <= 1.0:
    raise ValueError(f"fraction={fraction!r} must be in (0, 1]")
  maps = memory_maps()
  if maps is None or maps[0] <= fraction * maps[1]:
    return False
  import jax

  jax.clear_caches()
  gc.collect()
  after = memory_maps()
  log.info(
    "memory maps %d of %d (vm.max_map_count): cleared JAX's caches, %s left",
    maps[0],
    maps[1],
    after[0] if after else "?",
  )
  return True
