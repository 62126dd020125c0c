"""The Engine's prefill: `add` (prompts into slots) and `extend` (tool results into paused slots), and how their
tokens are planned into jitted chunk calls (`_fill_ranges`); `Engine` inherits them from `_FillOps`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from aepo_jax.rollout import _pages
from aepo_jax.rollout._compiled import _bucket, _copy, _fill, _release, _start
from aepo_jax.rollout._sampling import SamplingParams, SlotSampling


class _FillOps:
  """Prefill methods of `Engine` (they use its config, max_len, page_size, prefill_chunk, prefill_rows, sampling,
  entropy_window, tail_width, `_fill_chunk`, the input checks and the page counts of `_SlotOps`)."""

  def _rows(self, slots, token_arrays, offsets):
    """[n, max_len] rows holding token_arrays[i] at offsets[i] (zeros elsewhere)."""
    rows = np.zeros((len(slots), self.max_len), np.int32)
    for i, (toks, off) in enumerate(zip(token_arrays, offsets)):
      rows[i, off : off + toks.size] = toks
    return rows

  # ------------------------------------------------------------------------------------------------
  # Prefill / extend
  # ------------------------------------------------------------------------------------------------
  def _fill_ranges(self, params, state, slots: np.ndarray, begin: np.ndarray, end: np.ndarray):
    """Writes KV of tokens[slot, begin:end] for each slot, one jitted call per chunk and group of rows.

    Padding is compute (a prefill chunk is bound by its FLOPs on a CPU), so: each round gives every unfinished row
    the chunk that fits what it has left (`_chunk_for`: a 10-token tool result is not padded to a 90-token prompt's
    chunk, and 90 tokens take 64 + 32, not 128), rows sharing a chunk go together, in calls of a power-of-two
    number of rows (`_row_calls`: 9 rows take 8 + 2, not 16). Chunks and row counts stay powers of two, so no
    more programs compile than with one chunk per call."""
    need = end - begin
    if not need.size or need.max() <= 0:
      return state
    span = self._fill_chunk(self.prefill_chunk)[1]
    pos = np.asarray(begin, np.int64)
    if self.page_size:  # whole pages: windows start on a page boundary and span whole pages (model.fill_cache_rows)
      pos = pos // self.page_size * self.page_size
    while True:
      todo = np.nonzero(pos < end)[0]
      if not todo.size:
        return state
      chunks = np.asarray([self._chunk_for(int(left)) for left in end[todo] - pos[todo]], np.int64)
      for chunk in sorted(set(chunks.tolist()), reverse=True):
        group = todo[chunks == chunk]
        lo = 0
        for n in self._row_calls(group.size):
          part = group[lo : lo + n]
          lo += n
          pad = n - part.size  # padding repeats the first row: identical writes
          rows = np.concatenate([part, np.repeat(part[:1], pad)])
          slots_n = slots[rows].astype(np.int32)
          start = pos[rows]
          # Clamp the window inside the cache: recomputing a few already-valid entries gives the same values,
          # while dynamic_update_slice would silently clamp a window that runs past max_len.
          starts_n = np.minimum(start, span - chunk).astype(np.int32)
          # The window any row reads, as a power of two (>= 128) only where it cuts the read at least 4x, else the
          # whole span: each window is one more program per chunk and row count (~2 s to compile for SmolLM2-135M
          # on 2 cores), and a window saves at most the attention term of a chunk (~15% of its FLOPs there at 512
          # entries, less for wider models). A 240-entry cache thus fills through one window, 240.
          attend = _bucket(int(starts_n.max()) + chunk, lo=128)
          attend = attend if 4 * attend <= span else span
          from_n = None  # paged: pages wholly before the unclamped start are not written (they may be shared)
          if self.page_size:
            # On TPU one window, the whole table: the paged prefill unrolls its layers (see _pages.py) and compiles
            # for minutes on a 14B model, so one variant per rows/chunk bucket instead of one per window bucket.
            attend = span if self.paged_kernel == "tpu" else max(attend, int(starts_n.max()) + chunk)
            from_n = jnp.asarray(start, jnp.int32)
          state = _fill(self.config, chunk, attend, params, state, jnp.asarray(slots_n), jnp.asarray(starts_n), from_n)
      pos[todo] += chunks

  def _chunk_for(self, left: int) -> int:
    """The prefill chunk for a row with `left` tokens to write: the power of two (>= 16) that holds them, capped at
    prefill_chunk; from 64 on, half of it when at most a quarter is left for a later round (90 tokens: 64, then 32).
    Paged: whole pages (`_fill_chunk`)."""
    chunk = min(self.prefill_chunk, _bucket(left, lo=16))
    if chunk == _bucket(left) and chunk >= 64 and 4 * left <= 3 * chunk:  # (below 64 the rest's chunk is 16)
      chunk //= 2
    return self._fill_chunk(chunk)[0]

  def _row_calls(self, n: int) -> list:
    """Rows per call for n rows of one chunk: powers of two of at most prefill_rows (bucketed), padded only where
    that costs at most a quarter of the call (7 -> 8; 9 -> 8 + 2; 5 -> 4 + 2). Dense layout: at least 2 rows, as
    XLA:CPU copies the whole KV cache in every layer of a one-row call."""
    cap = _bucket(min(self.prefill_rows, self.max_slots))
    if cap > self.prefill_rows:
      cap //= 2
    low = 1 if self.page_size or self.max_slots < 2 else 2
    calls = []
    while n > 0:
      b = max(low, min(cap, _bucket(n)))
      if b > n and (b - n) * 4 > b and b > low:
        b //= 2
      calls.append(b)
      n -= b
    return calls

  def add(self, params, state, slots, token_lists, seeds, max_new_tokens, sampling=None):
    """Prefills prompts into slots (overwriting them) and makes them active.

    seeds: one int per slot (its PRNG key). max_new_tokens: an int or one per slot.
    sampling: None (the engine's), one SamplingParams, or one per slot; settings other than the engine's need
    `per_slot_sampling=True`. `copy_slots` copies a slot's settings to its forks.
    """
    slots = self._check_slots(slots)
    per_slot = [sampling] * slots.size if sampling is None or isinstance(sampling, SamplingParams) else list(sampling)
    per_slot = [self.sampling if p is None else p for p in per_slot]
    if len(per_slot) != slots.size:
      raise ValueError(f"Engine.add: {len(per_slot)} sampling settings for {slots.size} slots.")
    if not self.per_slot_sampling and any(p != self.sampling for p in per_slot):
      raise ValueError("Engine.add: sampling settings other than the engine's need Engine(per_slot_sampling=True).")
    toks = self._check_tokens(token_lists, "token_lists")
    if len(toks) != slots.size or len(list(seeds)) != slots.size:
      raise ValueError(
        f"Engine.add: got {slots.size} slots, {len(toks)} token lists and {len(list(seeds))} "
        "seeds; pass one of each per slot."
      )
    for i, t in enumerate(toks):
      if t.size == 0:
        raise ValueError(f"Engine.add: token_lists[{i}] is empty; a prompt needs at least one token (e.g. BOS).")
      if t.size > self.max_len:
        raise ValueError(
          f"Engine.add: prompt {i} has {t.size} tokens but the cache holds max_len={self.max_len}; "
          "shorten it or build the Engine with a larger max_len."
        )
    budget = np.broadcast_to(np.asarray(max_new_tokens, np.int32), slots.shape).copy()
    lengths = np.asarray([t.size for t in toks], np.int32)
    keys = np.stack([np.asarray(jax.random.key_data(jax.random.PRNGKey(int(s))), np.uint32) for s in seeds])
    sampling_n = SlotSampling.of(per_slot)
    # A prompt given to several slots (a group's samples) is prefilled once and forked to the others.
    first = {}
    src = np.asarray([first.setdefault(t.tobytes(), i) for i, t in enumerate(toks)])
    own = src == np.arange(slots.size)
    if self.page_size:  # the slots' old pages go back first (add overwrites them), then the prompt's are counted
      state = _release(state, *self._padded(slots))
      forks = int(np.asarray(_pages.partly_filled(lengths[~own], self.page_size)).sum())
      self._need_pages(state, int(self.pages_held(lengths[own]).sum()) + forks, "add")
    for part, keep_from in ((own, 0), (~own, None)):
      if not part.any():
        continue
      n_slots = slots[part]
      if keep_from is None:  # the forks: the prompt's slot copied (KV included), then their own settings
        dst_n, src_n, keys_n = self._padded(n_slots, slots[src[part]], keys[part])
        state = _copy(state, src_n, dst_n, keys_n)
      slots_n, rows_nl, length_n, keep_from_n, rng_n2, budget_n, sampling_p = self._padded(
        n_slots,
        self._rows(n_slots, [toks[i] for i in np.flatnonzero(part)], [0] * len(n_slots)),
        lengths[part],
        np.zeros_like(lengths[part]) if keep_from == 0 else lengths[part],
        keys[part],
        budget[part],
        jax.tree.map(lambda x: np.asarray(x)[part], sampling_n),
      )
      state = _start(
        state,
        slots_n,
        tokens_nl=rows_nl,
        length_n=length_n,
        keep_from_n=keep_from_n,
        rng_n2=rng_n2,
        budget_n=budget_n,
        sampling_n=sampling_p,
        reset_generated=True,
        window=self.entropy_window,
        width=self.tail_width,
      )
      if keep_from == 0:
        state = self._fill_ranges(params, state, n_slots, np.zeros_like(lengths[part]), lengths[part] - 1)
    return state

  def extend(self, params, state, slots, token_lists, max_new_tokens=None):
    """Appends tokens (e.g. a tool result) to paused slots and resumes them. An empty list only resumes.
    Starts a new entropy segment. max_new_tokens None keeps each slot's remaining budget."""
    slots = self._check_slots(slots)
    toks = self._check_tokens(token_lists, "token_lists")
    if len(toks) != slots.size:
      raise ValueError(f"Engine.extend: {slots.size} slots but {len(toks)} token lists.")
    info = self.host_info(state)
    length, active = info["length"][slots], info["active"][slots]
    if active.any():
      raise ValueError(
        f"Engine.extend: slots {slots[active].tolist()} are still decoding; extend only paused "
        "slots (stopped on a stop sequence/EOS/budget, or truncated)."
      )
    if (length == 0).any():
      raise ValueError(f"Engine.extend: slots {slots[length == 0].tolist()} are empty; use add() first.")
    new_len = length + np.asarray([t.size for t in toks], np.int32)
    over = new_len > self.max_len
    if over.any():
      raise ValueError(
        f"Engine.extend: slots {slots[over].tolist()} would hold {new_len[over].tolist()} tokens, "
        f"more than max_len={self.max_len}; end those trajectories instead."
      )
    budget = None if max_new_tokens is None else np.broadcast_to(np.asarray(max_new_tokens, np.int32), slots.shape)
    if self.page_size:
      self._need_pages(state, int((self.pages_held(new_len) - self.pages_held(length)).sum()), "extend")
    slots_n, rows_nl, length_n, keep_from_n, budget_n = self._padded(
      slots, self._rows(slots, toks, length), new_len, length, budget
    )
    state = _start(
      state,
      slots_n,
      tokens_nl=rows_nl,
      length_n=length_n,
      keep_from_n=keep_from_n,
      budget_n=budget_n,
      reset_generated=False,
      window=self.entropy_window,
      width=self.tail_width,
    )
    return self._fill_ranges(params, state, slots, length - 1, new_len - 1)
