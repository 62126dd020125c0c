"""What every engine of the process shares: the decode step's static spec, the jitted state operations (static:
config, spec, sizes, so engines of the same model share compilations) and the prepared decode weights."""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from typing import Optional

import jax
import numpy as np

from aepo_jax.rollout import _ops
from aepo_jax.rollout import _pages
from aepo_jax.rollout._sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class _StepSpec:
  """Static settings of the decode step (hashable)."""

  sampling: Optional[SamplingParams]  # None: each slot's own settings (DecodeState.sampling)
  with_entropy: bool
  topk_entropy: int
  entropy_window: int
  eos_ids: tuple
  stop_ids_key: tuple  # the stop sequences as a tuple of tuples (hash/eq); arrays below are derived
  attend_len: int  # cache entries read by attention (a bucket >= every row's length during the call)
  top_logprobs: int = 0  # StepOutputs.top_ids / top_logprobs width
  paged_kernel: str = ""  # paged layout: '' XLA's attention over gathered pages, 'tpu' / 'interpret' the Pallas kernel

  @property
  def stop_ids(self) -> np.ndarray:
    return _stop_matrix(self.stop_ids_key)[0]

  @property
  def stop_lens(self) -> np.ndarray:
    return _stop_matrix(self.stop_ids_key)[1]


@functools.lru_cache(maxsize=None)
def _stop_matrix(seqs: tuple):
  """Right-aligned [M, W] matrix of stop sequences (-1 = wildcard on the left) and their lengths [M]."""
  width = max([len(s) for s in seqs], default=1)
  ids = np.full((len(seqs), width), -1, np.int32)
  for i, seq in enumerate(seqs):
    ids[i, width - len(seq) :] = seq
  return ids, np.asarray([len(s) for s in seqs], np.int32)


# Module-level jitted functions (static: config, spec, sizes), so engines of the same model share compilations.
# The state argument is donated: the KV cache is updated in place.
_decode = jax.jit(_ops.decode, static_argnums=(0, 1, 2), donate_argnums=(4,))
# The paged decode step on TPU. XLA:TPU's memory-space assignment prefetches a buffer into VMEM when it fits, and a
# layer's KV pool on a chip fits once the pool is small (Qwen3-30B-A3B at rollout.kv_tokens=98304: 25 MB for K and
# for V): the whole pool is then copied into VMEM and back around the new token's scatter, every layer and step,
# although the paged kernel reads only the pages it needs (compiled for v6e at 2 layers: 2.90 -> 2.12 GB of HBM per
# step, the pool's copies gone; docs/performance.md, "Paged KV cache"). This option makes it refuse copies whose
# use moves fewer bytes than the copy itself.
TPU_DECODE_OPTIONS = {"xla_tpu_msa_inefficient_use_to_copy_ratio": 1.0}
_decode_tpu = jax.jit(_ops.decode, static_argnums=(0, 1, 2), donate_argnums=(4,), compiler_options=TPU_DECODE_OPTIONS)
_decode_weights = jax.jit(_ops.decode_weights, static_argnums=(0,))
_fill = jax.jit(_ops.fill_chunk, static_argnums=(0, 1, 2), donate_argnums=(4,))
_page_needs = jax.jit(_ops.page_needs)
_free_pages = jax.jit(_pages.free_count)
_start = jax.jit(_ops.start_rows, static_argnames=("reset_generated", "window", "width"), donate_argnums=(0,))
_copy = jax.jit(_ops.copy_rows, donate_argnums=(0,))
_truncate = jax.jit(_ops.truncate_rows, static_argnums=(3, 4), donate_argnums=(0,))
_release = jax.jit(_ops.release_rows, donate_argnums=(0,))
_resume = jax.jit(_ops.resume_rows, donate_argnums=(0,))
_set_segment = jax.jit(_ops.set_segment, static_argnums=(6,), donate_argnums=(0,))


class _PreparedWeights:
  """One cached `decode_weights` copy, for the parameter version it was made from (matched by identity of
  every leaf, held weakly: the copy is dropped as soon as those parameters are freed). Shared by all engines
  of the process, so a training loop that rolls out with the same parameters many times prepares them once."""

  def __init__(self):
    self._lock = threading.Lock()
    self._entry = None  # (config, [weakref to leaf], weights)

  def get(self, config, params):
    leaves = jax.tree.leaves(params)
    with self._lock:
      e = self._entry
      if e is not None and e[0] == config and len(e[1]) == len(leaves) and all(r() is x for r, x in zip(e[1], leaves)):
        return e[2]
      self._entry = None  # release the previous copy before making a new one
    weights = _decode_weights(config, params)
    refs = [weakref.ref(x) for x in leaves]
    with self._lock:
      self._entry = (config, refs, weights)
    weakref.finalize(leaves[0], self._drop, refs[0])
    return weights

  def _drop(self, ref):
    with self._lock:
      if self._entry is not None and self._entry[1][0] is ref:
        self._entry = None

  def clear(self):
    with self._lock:
      self._entry = None


prepared_weights = _PreparedWeights()


def _bucket(n: int, lo: int = 1) -> int:
  return max(lo, 1 << max(0, int(n) - 1).bit_length())
