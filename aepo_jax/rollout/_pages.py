"""The paged KV cache's bookkeeping, on device: a page table per slot and a reference count per page.

Layout (engine `kv_layout='paged'`): the cache is a pool {'k', 'v'}, one array [kv_heads, pages, page_size,
head_dim] per layer (the layout of JAX's Pallas paged-attention kernel), `DecodeState.page_table` [S, P] maps a
slot's position p to page `page_table[s, p // page_size]`, offset `p % page_size` (P = ceil(max_len / page_size)),
and `DecodeState.page_refs` [pages] counts the slots whose table holds each page.

One array per layer, and the layers unrolled where the pool is written (decode step, prefill chunk), because with
one stacked [layers, ...] array in a layer scan's carry, or in the carry of a scan over decode steps, XLA:TPU
copies the whole pool (its scatter into the page axis is not done in place there: measured with
`memory_analysis()`, a temp the size of the pool); unrolled over per-layer arrays, in a call that the engine
repeats per step, every write is in place and the kernel reads each layer's pool where it lies.

Page 0 is the null page: never handed out (its count is pinned), an unassigned table entry is 0, and a write that
must not land anywhere (an inactive row, a position beyond a row's pages) goes there. Nothing reads it unmasked.

Invariant (with `_state.py`'s): a slot with `length` tokens holds exactly the pages covering its cached positions
[0, length - 1), i.e. entries 0 .. ceil((length - 1) / page_size) - 1 of its table, and every page it may still write
(the one holding position length - 1, if already assigned) has count 1. A fork (`fork`) therefore shares the
parent's full pages by count and copies only the partly filled last page; truncation (`shrink`) returns the pages
past the new length and copies the boundary page first if another slot shares it. Every allocation is all or
nothing: an operation that cannot get its pages leaves the state unchanged and reports it (the engine raises
`OutOfPages`); a decode step that cannot get a page stops that slot (`stop_reason` 'out_of_pages') before it
writes anything, and `Engine.resume(state, slots)` lets it go on in the same segment once pages are free.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NULL_PAGE = 0
_PINNED = 1 << 30  # the null page's count: never 0, so never free


def init(num_slots: int, pages_per_slot: int, num_pages: int):
  """(page_table [S, P] of zeros, page_refs [num_pages] with the null page pinned)."""
  return jnp.zeros((num_slots, pages_per_slot), jnp.int32), jnp.zeros((num_pages,), jnp.int32).at[NULL_PAGE].set(
    _PINNED
  )


def named(page_table, slots_n):
  """[n] bool: the rows that name a slot. A row edit padded to a power of two of rows (`Engine._padded`) names slot
  S, past the table, in its padding rows: their gathers clamp and their scatters are dropped, and every count and
  allocation below is masked with this, so they change nothing."""
  return slots_n < page_table.shape[0]


def free_count(refs):
  return jnp.sum(refs == 0).astype(jnp.int32)


def held(length_n, page_size: int):
  """Pages a slot with `length_n` tokens holds: ceil((length - 1) / page_size) (0 for an empty slot)."""
  return -(-jnp.maximum(length_n - 1, 0) // page_size)


def partly_filled(length_n, page_size: int):
  """Whether the last page a slot with `length_n` tokens holds is only partly filled (a fork copies it)."""
  return jnp.maximum(length_n - 1, 0) % page_size > 0


def allocate(refs, need):
  """Fresh pages for the True entries of `need` (any shape), in order: (ids, refs, enough). ids are 0 where not
  needed; when there are fewer free pages than needed, `enough` is False and the entries past the free ones get 0
  (callers that need all or nothing check `enough`; the decode step gives a page to the first slots and stops the
  rest)."""
  flat = need.reshape(-1)
  rank = jnp.cumsum(flat) - 1
  free_ids = jnp.nonzero(refs == 0, size=flat.size, fill_value=NULL_PAGE)[0]
  got = jnp.where(flat, free_ids[jnp.clip(rank, 0, flat.size - 1)], NULL_PAGE).astype(jnp.int32)
  refs = refs.at[got].add((got != NULL_PAGE).astype(jnp.int32))
  enough = jnp.sum(flat) <= free_count(refs) + jnp.sum(got != NULL_PAGE)
  return got.reshape(need.shape), refs, enough


def drop(table_nj, refs, drop_nj):
  """Returns the pages of `table_nj` where `drop_nj` (decrements their counts; the null page is left alone):
  (table with those entries 0, refs)."""
  ids = jnp.where(drop_nj, table_nj, NULL_PAGE)
  refs = refs.at[ids].add(-(ids != NULL_PAGE).astype(jnp.int32))
  return jnp.where(drop_nj, NULL_PAGE, table_nj), refs


def copy_pages(cache, src_m, dst_m, ok=True):
  """Copies pages src_m -> dst_m (every layer and head) when `ok` (a scalar); otherwise, and for dst entries 0,
  the copy lands on the null page: a failed all-or-nothing operation never touches a live page, and never selects
  over the whole pool."""
  dst_m = jnp.where(ok, dst_m, NULL_PAGE)
  return jax.tree.map(lambda c: c.at[:, dst_m].set(c[:, src_m]), cache)


def extend(page_table, refs, slots_n, old_len_n, new_len_n, page_size: int):
  """Pages for rows growing from old_len to new_len tokens (old_len 0: a fresh row, whose old pages must already
  be dropped): (page_table, refs, enough). All or nothing is the caller's (`enough`)."""
  p = page_table.shape[1]
  j = jnp.arange(p)[None, :]
  need = (j >= held(old_len_n, page_size)[:, None]) & (j < held(new_len_n, page_size)[:, None])
  need &= named(page_table, slots_n)[:, None]
  got, refs, enough = allocate(refs, need)
  rows = page_table[slots_n]
  return page_table.at[slots_n].set(jnp.where(need, got, rows)), refs, enough


def release(page_table, refs, slots_n):
  """Drops every page of the rows (their table entries become 0)."""
  rows = page_table[slots_n]
  rows, refs = drop(rows, refs, jnp.broadcast_to(named(page_table, slots_n)[:, None], rows.shape))
  return page_table.at[slots_n].set(rows), refs


def fork(page_table, refs, src_n, dst_n, length_n, page_size: int):
  """dst rows take src rows' pages: full pages shared (count + 1), the partly filled last page copied into a fresh
  one. dst rows must hold no pages. -> (page_table, refs, enough, (copy_src, copy_dst)) for `copy_pages`."""
  p = page_table.shape[1]
  j = jnp.arange(p)[None, :]
  n_held = held(length_n, page_size)
  src_rows = page_table[src_n]
  real = named(page_table, dst_n)
  partial = partly_filled(length_n, page_size) & real
  last = jnp.maximum(n_held - 1, 0)
  share = (j < n_held[:, None]) & ~(partial[:, None] & (j == last[:, None])) & real[:, None]
  refs = refs.at[jnp.where(share, src_rows, NULL_PAGE)].add(share.astype(jnp.int32))
  new_n, refs, enough = allocate(refs, partial)
  src_last = jnp.take_along_axis(src_rows, last[:, None], axis=1)[:, 0]
  rows = jnp.where(share, src_rows, NULL_PAGE)
  rows = jnp.where(partial[:, None] & (j == last[:, None]), new_n[:, None], rows)
  return page_table.at[dst_n].set(rows), refs, enough, (jnp.where(partial, src_last, NULL_PAGE), new_n)


def shrink_copies(page_table, refs, slots_n, new_len_n, page_size: int):
  """[n] bool: the rows whose kept last page `shrink` must copy (partly filled and shared)."""
  n_held = held(new_len_n, page_size)
  last = jnp.maximum(n_held - 1, 0)
  last_id = jnp.take_along_axis(page_table[slots_n], last[:, None], axis=1)[:, 0]
  return partly_filled(new_len_n, page_size) & (refs[last_id] > 1) & named(page_table, slots_n)


def shrink(page_table, refs, slots_n, new_len_n, page_size: int):
  """Rows cut back to new_len tokens: pages past held(new_len) dropped, and the (partly filled) last kept page
  copied into a private page when another slot shares it. -> (page_table, refs, enough, (copy_src, copy_dst))."""
  p = page_table.shape[1]
  j = jnp.arange(p)[None, :]
  n_held = held(new_len_n, page_size)
  cow = shrink_copies(page_table, refs, slots_n, new_len_n, page_size)  # before dropping: drops never touch it
  rows, refs = drop(page_table[slots_n], refs, (j >= n_held[:, None]) & named(page_table, slots_n)[:, None])
  last = jnp.maximum(n_held - 1, 0)
  last_id = jnp.take_along_axis(rows, last[:, None], axis=1)[:, 0]
  new_n, refs, enough = allocate(refs, cow)
  refs = refs.at[jnp.where(cow, last_id, NULL_PAGE)].add(-cow.astype(jnp.int32))
  rows = jnp.where(cow[:, None] & (j == last[:, None]), new_n[:, None], rows)
  return page_table.at[slots_n].set(rows), refs, enough, (jnp.where(cow, last_id, NULL_PAGE), new_n)


def step_pages(page_table, refs, active_s, length_s, page_size: int):
  """Before a decode step: a page for every active row whose write position (length - 1) starts a new page.
  Rows that cannot get one are returned as `stalled` (they must not write). -> (page_table, refs, stalled_s)."""
  s, p = page_table.shape
  rows = jnp.arange(s)
  j_s = jnp.clip(jnp.maximum(length_s - 1, 0) // page_size, 0, p - 1)
  need = active_s & (page_table[rows, j_s] == NULL_PAGE)
  got, refs, _ = allocate(refs, need)
  stalled = need & (got == NULL_PAGE)
  page_table = page_table.at[rows, j_s].set(jnp.where(need & ~stalled, got, page_table[rows, j_s]))
  return page_table, refs, stalled


def when(ok, new, old):
  """`new` if the scalar `ok` else `old` (pytrees of equal structure, small: tables and counts, never the pool)."""
  return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
