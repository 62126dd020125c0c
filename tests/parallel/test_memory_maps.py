"""Memory-map accounting: the count matches /proc, and the caches are cleared past the threshold only."""

import ctypes
import mmap
import sys

import jax
import jax.numpy as jnp
import pytest

from aepo_jax.parallel import _memory_maps

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")


def test_counts_entries_and_clears_caches_only_past_the_threshold():
  used, limit = _memory_maps.memory_maps()
  assert 0 < used < limit
  libc = ctypes.CDLL(None)
  libc.mmap.restype = ctypes.c_void_p
  libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
  libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
  regions = []
  try:
    for i in range(200):  # alternating protections: neighbouring regions cannot merge into one entry
      prot = mmap.PROT_READ if i % 2 else mmap.PROT_READ | mmap.PROT_WRITE
      regions.append(libc.mmap(None, mmap.PAGESIZE, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0))
    grown = _memory_maps.memory_maps()[0]
    assert grown >= used + 190  # other threads may map or unmap a few meanwhile
  finally:
    for a in regions:
      libc.munmap(a, mmap.PAGESIZE)

  f = jax.jit(lambda x: x * 3 + 1)
  f(jnp.ones(5))
  assert f._cache_size() == 1
  assert not _memory_maps.release_compiled_programs(1.0)  # below the limit: nothing cleared
  assert f._cache_size() == 1
  assert _memory_maps.release_compiled_programs(1e-9)  # past it: JAX's caches cleared
  assert f._cache_size() == 0
  assert f(jnp.ones(5)).tolist() == [4.0] * 5  # compiles again
  with pytest.raises(ValueError, match="fraction"):
    _memory_maps.release_compiled_programs(0.0)
