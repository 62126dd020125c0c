"""Memory-map accounting: the count matches /proc, and the caches are cleared past the threshold only."""

import ctypes
import gc
import mmap
import sys

import jax
import jax.numpy as jnp
import pytest

from aepo_jax.parallel import _memory_maps

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")


def test_counts_entries_and_clears_caches_only_past_the_threshold():
  gc.collect()  # a collection inside the window would unmap the programs it frees (CI once saw 174 of 200 new)
  gc.disable()
  try:
    _counts_entries()
  finally:
    gc.enable()
  _clears_caches_only_past_the_threshold()


def _counts_entries():
  used, limit = _memory_maps.memory_maps()
  assert 0 < used < limit
  libc = ctypes.CDLL(None)
  libc.mmap.restype = ctypes.c_void_p
  libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
  libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
  libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
  pages = 400
  # One reservation split page by page with alternating protections: 400 entries that cannot merge with each other
  # (only its two ends could merge with a neighbour; separate mmaps could each land beside one and merge).
  base = libc.mmap(
    None, pages * mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
  )
  assert base not in (None, ctypes.c_void_p(-1).value)
  try:
    for i in range(1, pages, 2):
      assert libc.mprotect(base + i * mmap.PAGESIZE, mmap.PAGESIZE, mmap.PROT_READ) == 0
    grown = _memory_maps.memory_maps()[0]
    assert grown >= used + 300  # 398-400 new; other threads may map or unmap some meanwhile
  finally:
    libc.munmap(base, pages * mmap.PAGESIZE)


def _clears_caches_only_past_the_threshold():
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
