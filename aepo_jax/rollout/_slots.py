"""The Engine's slot operations after a slot has started (fork, cut, resume, restore a segment, release) and its
reads of the paged KV pool; `Engine` inherits them from `_SlotOps`."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from aepo_jax.rollout import _pages
from aepo_jax.rollout._state import DecodeState
from aepo_jax.rollout._compiled import (
  _bucket,
  _copy,
  _free_pages,
  _page_needs,
  _release,
  _resume,
  _set_segment,
  _truncate,
)


class OutOfPages(RuntimeError):
  """A paged engine has fewer free KV pages than an operation needs. Nothing was changed: the state passed in is
  still valid (returned in `.state`). Free pages (release or truncate slots) and retry, or size the pool larger
  (`Engine(num_pages=...)`, config `rollout.kv_tokens`)."""

  def __init__(self, message: str, state, needed: int, free: int):
    super().__init__(message)
    self.state, self.needed, self.free = state, needed, free


def num_pages_for(kv_tokens: int, page_size: int) -> int:
  """`Engine(num_pages=)` for a pool of `kv_tokens` tokens (+ the null page); 0 (every slot at max_len) for 0."""
  return -(-int(kv_tokens) // int(page_size)) + 1 if kv_tokens else 0


class _SlotOps:
  """Slot and page methods of `Engine` (they use its max_len, page_size, num_pages, entropy_window, tail_width,
  and `_check_slots`); its host-side reads of a state (`host_info`, `slot_tokens`, `slot_routes`)."""

  def _padded(self, slots: np.ndarray, *per_slot):
    """A row edit's slots and per-slot arrays (or pytrees of them) padded to a power of two of rows, so each edit
    compiles once per bucket instead of once per slot count: partial rollouts fork, cut, start and release every
    count up to S over a run, each a new program (0.2-1 s to compile on the CPU at 32 slots). Padding rows name slot
    S, out of range: their scatters are dropped (jnp's default) and their gathers clamp, and the paged layout's page
    counts and allocations leave them out (`_pages.named`), so they change nothing; their per-slot values repeat the
    first row's."""
    n = int(slots.size)
    pad = 0 if n == 0 else _bucket(n) - n
    slots = np.concatenate([np.asarray(slots, np.int32), np.full(pad, self.max_slots, np.int32)])

    def rows(x):  # a per-slot array (or pytree of them: SlotSampling), its first row repeated
      x = np.asarray(x)
      return jnp.asarray(np.concatenate([x, np.repeat(x[:1], pad, axis=0)]) if pad else x)

    return (jnp.asarray(slots),) + tuple(None if a is None else jax.tree.map(rows, a) for a in per_slot)

  def host_info(self, state: DecodeState) -> dict:
    """Per-slot summaries as numpy arrays (one small device-to-host transfer)."""
    names = (
      "length",
      "active",
      "stop_reason",
      "n_generated",
      "budget",
      "seg_start",
      "seg_count",
      "seg_entropy_sum",
      "seg_topk_entropy_sum",
    )
    return dict(zip(names, jax.device_get([getattr(state, n) for n in names])))

  def slot_tokens(self, state: DecodeState, slot: int) -> np.ndarray:
    """The tokens of one slot (prompt, generated and inserted), as numpy."""
    self._check_slots([slot], "slot")
    length = int(jax.device_get(state.length[slot]))
    return np.asarray(jax.device_get(state.tokens[slot, :length]))

  def slot_routes(self, state: DecodeState, slot: int) -> np.ndarray:
    """The experts each token of a slot went to, [length, L_sparse, k] int32 (sparse layers in order), aligned with
    `slot_tokens`: those its KV entry was computed with; the last token's row is -1 (not run yet: a replay routes
    it itself). Ready for `model.forward_hidden(..., routes_btsk=...)`. Needs `record_routes=True`."""
    if state.routes is None:
      raise ValueError("Engine.slot_routes: the engine does not record routes; build it with record_routes=True.")
    self._check_slots([slot], "slot")
    length, row = jax.device_get((state.length[slot], state.routes[slot]))  # the whole row: one program, any length
    routes = np.asarray(row[: int(length)], np.int32).reshape(int(length), -1, self.config.num_experts_per_tok)
    routes[int(length) - 1 :] = -1
    return routes

  def copy_slots(self, state, src, dst, seeds=None):
    """Forks src slots into dst slots on device. seeds: one int per child for a fresh key, or None (or a
    None entry) to give the child its parent's key (it then reproduces the parent's continuation)."""
    src = self._check_slots(src, "src", unique=False)
    dst = self._check_slots(dst, "dst")
    if src.size != dst.size:
      raise ValueError(f"Engine.copy_slots: {src.size} src but {dst.size} dst slots.")
    if set(src.tolist()) & set(dst.tolist()):
      raise ValueError(f"Engine.copy_slots: src {src.tolist()} and dst {dst.tolist()} overlap.")
    seeds = [None] * src.size if seeds is None else list(seeds)
    if len(seeds) != src.size:
      raise ValueError(f"Engine.copy_slots: {len(seeds)} seeds for {src.size} forks.")
    parent = np.asarray(jax.device_get(state.rng))[src]
    if self.page_size:  # dst's pages go back first; each fork copies at most its parent's partly filled page
      state = _release(state, *self._padded(dst))
      partial = np.asarray(_pages.partly_filled(self.host_info(state)["length"][src], self.page_size))
      self._need_pages(state, int(partial.sum()), "copy_slots")
    keys = np.stack(
      [
        parent[i] if s is None else np.asarray(jax.random.key_data(jax.random.PRNGKey(int(s))))
        for i, s in enumerate(seeds)
      ]
    ).astype(np.uint32)
    dst, src, keys = self._padded(dst, src, keys)
    return _copy(state, src, dst, keys)

  def truncate(self, state, slots, lengths):
    """Rewinds slots to `lengths` tokens (1 <= length <= current) and pauses them; resume with extend."""
    slots = self._check_slots(slots)
    lengths = np.asarray(lengths, np.int32).reshape(-1)
    cur = self.host_info(state)["length"][slots]
    if lengths.size != slots.size or (lengths < 1).any() or (lengths > cur).any():
      raise ValueError(
        f"Engine.truncate: lengths {lengths.tolist()} must be one per slot within 1..current length {cur.tolist()}."
      )
    if self.page_size:
      free, need, enough = jax.device_get(_page_needs(state, *self._padded(slots, lengths)))
      if not enough:
        self._need_pages(state, int(need), "truncate", free=int(free))
    return _truncate(state, *self._padded(slots, lengths), self.entropy_window, self.tail_width)

  # ------------------------------------------------------------------------------------------------
  # Pages (paged layout)
  # ------------------------------------------------------------------------------------------------
  def pages_held(self, lengths) -> np.ndarray:
    """Pages a slot of `lengths` tokens holds (paged layout; _pages.held on the host)."""
    return np.asarray(_pages.held(np.asarray(lengths, np.int64), self.page_size))

  def pages_free(self, state) -> int:
    """Free pages of the pool (0 for the dense layout). One small device read."""
    return int(jax.device_get(_free_pages(state.page_refs))) if self.page_size else 0

  def page_stats(self, state) -> dict:
    """{'pages': usable pages, 'pages_free', 'pages_shared': pages held by more than one slot, 'page_size'}."""
    if not self.page_size:
      return {}
    refs = np.asarray(jax.device_get(state.page_refs))[1:]
    return {
      "pages": refs.size,
      "pages_free": int((refs == 0).sum()),
      "pages_shared": int((refs > 1).sum()),
      "page_size": self.page_size,
    }

  def _need_pages(self, state, needed: int, what: str, free: Optional[int] = None):
    """Raises OutOfPages (with the unchanged state) when the pool has fewer than `needed` free pages."""
    if needed <= 0:
      return
    free = self.pages_free(state) if free is None else free
    if needed > free:
      raise OutOfPages(
        f"Engine.{what}: needs {needed} KV pages of {self.page_size} tokens but {free} of {self.num_pages - 1} are "
        "free. No slot was started, forked or cut (the target slots of add/copy_slots were released); the state is "
        "in this error's .state (the one passed in was donated). Release or truncate slots and retry, or build the "
        "engine with more pages (num_pages; config rollout.kv_tokens).",
        state,
        needed,
        free,
      )

  def resume(self, state, slots):
    """Slots that stopped with 'out_of_pages' (paged layout) decode again, in the same segment, from where they
    stopped; other slots are left as they are. Call it once pages are free (`pages_free`)."""
    return _resume(state, *self._padded(self._check_slots(slots)))

  def segment_snapshot(self, state, slot: int) -> dict:
    """The open segment of a slot as numpy: its start and, from there to the slot's length, the per-position
    generated flags and exact / top-k entropies (what `set_segment` restores after a re-prefill)."""
    self._check_slots([slot], "slot")
    start, length = (int(x) for x in jax.device_get((state.seg_start[slot], state.length[slot])))
    gen, ent, topk = jax.device_get(
      (
        state.generated[slot, start:length],
        state.entropy_buf[slot, start:length],
        state.topk_entropy_buf[slot, start:length],
      )
    )
    return {"start": start, "generated": np.asarray(gen), "entropy": np.asarray(ent), "topk_entropy": np.asarray(topk)}

  def set_segment(self, state, slots, snapshots):
    """Restores `segment_snapshot`s into slots re-prefilled by `add` with the same tokens (a trajectory preempted
    mid-segment): the segment continues as if never interrupted (its count, window sums, and what `truncate`
    recomputes)."""
    slots = self._check_slots(slots)
    n = slots.size
    gen = np.zeros((n, self.max_len), bool)
    ent, topk = np.zeros((n, self.max_len), np.float32), np.zeros((n, self.max_len), np.float32)
    for i, snap in enumerate(snapshots):
      a, b = snap["start"], snap["start"] + len(snap["generated"])
      gen[i, a:b], ent[i, a:b], topk[i, a:b] = snap["generated"], snap["entropy"], snap["topk_entropy"]
    starts = np.asarray([snap["start"] for snap in snapshots], np.int32)
    return _set_segment(state, *self._padded(slots, starts, gen, ent, topk), self.entropy_window)

  def release(self, state, slots):
    """Frees slots (inactive, empty)."""
    return _release(state, *self._padded(self._check_slots(slots)))
