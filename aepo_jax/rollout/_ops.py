"""Device functions of the engine (pure, jitted by `Engine`): the decode scan, chunked KV filling, row edits.

All take and return a `DecodeState`; the engine donates it, so the KV cache is updated in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aepo_jax.model import fill_cache_rows
from aepo_jax.rollout import _pages
from aepo_jax.rollout import _state as st
from aepo_jax.model import decode_forward, decode_weights  # noqa: F401 (engine)
from aepo_jax.rollout._sampling import sample_step


# ----------------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------------
def decode_step(config, params, state: st.DecodeState, spec, weights_t=None):
  """One token for every active slot. `spec` is the engine's static `_StepSpec`; weights_t: see decode_forward."""
  s, max_len = state.tokens.shape
  rows = jnp.arange(s)
  # Dense: paused/free rows also write: the KV of their own last_token at length-1, which is the correct value.
  write_s = jnp.clip(state.length - 1, 0, max_len - 1)
  paged = {}
  act = state.active
  if state.paged:  # a page for rows starting one; a row that cannot get one stops before writing (out_of_pages)
    ps = state.page_size
    table, refs, stalled = _pages.step_pages(state.page_table, state.page_refs, act, state.length, ps)
    act = act & ~stalled
    write_page = jnp.where(act, table[rows, write_s // ps], _pages.NULL_PAGE)  # inactive rows write nowhere
    state = state.replace(page_table=table, page_refs=refs)
    paged = dict(page_table=table, write_page_s=write_page, paged_kernel=spec.paged_kernel)
  record = state.routes is not None  # the experts of the token fed at write_s (its KV entry's), per sparse layer
  out = decode_forward(
    config,
    params,
    state.last_token,
    write_s,
    state.cache,
    spec.attend_len,
    weights_t=weights_t,
    return_routes=record,
    **paged,
  )
  logits_sv, cache = out[:2]
  if record:
    state = state.replace(
      routes=state.routes.at[rows, jnp.where(act, write_s, max_len)].set(
        out[2].reshape(out[2].shape[0], -1).astype(st.ROUTES_DTYPE), mode="drop"
      )
    )
  # spec.sampling None: each slot samples with its own settings (the engine's per-slot mode).
  smp = sample_step(
    logits_sv,
    state.rng,
    state.sampling if spec.sampling is None else spec.sampling,
    with_entropy=spec.with_entropy,
    topk=spec.topk_entropy,
    tokens_sl=state.tokens,
    length_s=state.length,
    top_logprobs=spec.top_logprobs,
  )
  token_s, logprob_s, entropy_s, topk_s, rng = smp.token, smp.logprob, smp.entropy, smp.topk_entropy, smp.rng
  token_s = jnp.where(act, token_s, 0)
  put_s = jnp.where(act, state.length, max_len)  # out of range -> dropped
  length = state.length + act
  seg_count = state.seg_count + act
  in_window = act & (state.seg_count < spec.entropy_window)
  tail = jnp.where(act[:, None], jnp.concatenate([state.tail[:, 1:], token_s[:, None]], axis=1), state.tail)

  reason = jnp.zeros_like(state.stop_reason)
  reason = jnp.where(length >= max_len, st.STOP_CACHE_FULL, reason)
  budget = state.budget - act
  reason = jnp.where(budget <= 0, st.STOP_BUDGET, reason)
  if spec.stop_ids.shape[0]:
    ids_mw, len_m = jnp.asarray(spec.stop_ids), jnp.asarray(spec.stop_lens)
    w = ids_mw.shape[1]
    eq_smw = (tail[:, None, -w:] == ids_mw[None]) | (ids_mw[None] < 0)
    hit_s = jnp.any(jnp.all(eq_smw, axis=-1) & (seg_count[:, None] >= len_m[None]), axis=-1)
    reason = jnp.where(hit_s, st.STOP_SEQUENCE, reason)
  if spec.eos_ids and not (spec.sampling is not None and spec.sampling.ignore_eos):
    eos_s = jnp.isin(token_s, jnp.asarray(spec.eos_ids))
    if spec.sampling is None:
      eos_s &= ~state.sampling.ignore_eos
    reason = jnp.where(eos_s, st.STOP_EOS, reason)
  reason = jnp.where(act, reason, state.stop_reason)
  if state.paged:
    reason = jnp.where(stalled, st.STOP_NO_PAGES, reason)

  state = state.replace(
    cache=cache,
    tokens=state.tokens.at[rows, put_s].set(token_s, mode="drop"),
    generated=state.generated.at[rows, put_s].set(True, mode="drop"),
    entropy_buf=state.entropy_buf.at[rows, put_s].set(entropy_s, mode="drop"),
    topk_entropy_buf=state.topk_entropy_buf.at[rows, put_s].set(topk_s, mode="drop"),
    length=length,
    last_token=jnp.where(act, token_s, state.last_token),
    active=act & (reason == st.RUNNING),
    rng=jnp.where(act[:, None], rng, state.rng),
    budget=budget,
    n_generated=state.n_generated + act,
    stop_reason=reason,
    tail=tail,
    seg_count=seg_count,
    seg_entropy_sum=state.seg_entropy_sum + jnp.where(in_window, entropy_s, 0.0),
    seg_topk_entropy_sum=state.seg_topk_entropy_sum + jnp.where(in_window, topk_s, 0.0),
  )
  out = st.StepOutputs(
    token=token_s,
    logprob=jnp.where(act, logprob_s, 0.0),
    entropy=jnp.where(act, entropy_s, 0.0),
    topk_entropy=jnp.where(act, topk_s, 0.0),
    valid=act,
    top_ids=smp.top_ids,
    top_logprobs=smp.top_logprobs,
  )
  return state, out


def take_rows(state: st.DecodeState, rows) -> st.DecodeState:
  """The slots `rows` [R] of the state as an R-slot state (dense: cache rows included; paged: the whole pool and
  page counts, which the rows' page tables index)."""
  sub = jax.tree.map(lambda x: x[rows], state.slot_fields())
  if state.paged:
    return sub.replace(cache=state.cache, page_refs=state.page_refs)
  return sub.replace(cache=jax.tree.map(lambda c: c[:, rows], state.cache))


def put_rows(state: st.DecodeState, rows, sub: st.DecodeState) -> st.DecodeState:
  """Writes the R-slot state `sub` back into slots `rows` of `state`."""
  out = jax.tree.map(lambda x, y: x.at[rows].set(y), state.slot_fields(), sub.slot_fields())
  if state.paged:
    return out.replace(cache=sub.cache, page_refs=sub.page_refs)
  return out.replace(cache=jax.tree.map(lambda c, u: c.at[:, rows].set(u), state.cache, sub.cache))


def decode(config, spec, num_steps: int, params, state, weights_t=None, rows=None):
  """num_steps decode steps; a step in which no slot is active any more (all stopped at a tool call, EOS or
  budget within the chunk) is skipped: it would change nothing (see decode_step) and costs a full forward.

  rows: None (decode all S slots) or distinct slot indices [R] holding every active slot: only those R rows are
  gathered (cache rows included), decoded and written back, so a step costs R rows instead of S. The outputs are
  [S, num_steps] either way (valid=False outside `rows`)."""
  if rows is not None:
    sub, out = decode(config, spec, num_steps, params, take_rows(state, rows), weights_t)
    s = state.active.shape[0]
    full = jax.tree.map(lambda o: jnp.zeros((s,) + o.shape[1:], o.dtype).at[rows].set(o), out)
    return put_rows(state, rows, sub), full

  def idle(carry):
    s, n = carry.active.shape[0], spec.top_logprobs
    zeros = jnp.zeros((s,), jnp.float32)
    return carry, st.StepOutputs(
      token=jnp.zeros((s,), carry.last_token.dtype),
      logprob=zeros,
      entropy=zeros,
      topk_entropy=zeros,
      valid=jnp.zeros((s,), bool),
      top_ids=jnp.zeros((s, n), jnp.int32),
      top_logprobs=jnp.zeros((s, n), jnp.float32),
    )

  if state.paged and num_steps == 1:  # the paged engine's one step per call: no loop around the pool, whose
    # page-axis writes XLA:TPU does in place only outside one (aepo_jax/rollout/_pages.py); idle: skipped
    state, out = jax.lax.cond(
      jnp.any(state.active), lambda c: decode_step(config, params, c, spec, weights_t), idle, state
    )
    return state, jax.tree.map(lambda x: x[:, None], out)

  def body(carry, _):
    return jax.lax.cond(jnp.any(carry.active), lambda c: decode_step(config, params, c, spec, weights_t), idle, carry)

  state, out = jax.lax.scan(body, state, None, length=num_steps)
  return state, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), out)


# ----------------------------------------------------------------------------------------------------
# KV filling (prefill and extend): write KV of tokens[start : start + T] for a few rows
# ----------------------------------------------------------------------------------------------------
def fill_chunk(config, chunk: int, attend_len: int, params, state, slots_n, start_n, from_n=None):
  """Computes and writes the KV entries of tokens[slot, start : start + chunk] (start + chunk <= attend_len <=
  max_len) through `model.fill_cache_rows`: each layer reads only the rows' first attend_len entries and writes
  only the chunk's window (no logits are needed, see the invariant in _state.py). Duplicate rows (padding) write
  identical values. from_n (paged layout): the first index each row writes (the window may start earlier)."""
  rows_tok = state.tokens[slots_n]
  if state.paged:  # a window of whole pages may run past max_len (up to pages x page size): zeros there
    span = state.page_table.shape[1] * state.page_size
    rows_tok = jnp.pad(rows_tok, ((0, 0), (0, span - rows_tok.shape[1])))
  tok_nt = jax.vmap(lambda r, s: jax.lax.dynamic_slice(r, (s,), (chunk,)))(rows_tok, start_n)
  pos_nt = start_n[:, None] + jnp.arange(chunk)[None, :]
  paged = dict(page_table=state.page_table, write_from_n=from_n) if state.paged else {}
  record = state.routes is not None
  out = fill_cache_rows(
    config, params, tok_nt, pos_nt, state.cache, slots_n, start_n, attend_len, return_routes=record, **paged
  )
  if not record:
    return state.replace(cache=out)
  # The chunk's experts where its KV entries are written: paged, from the page holding from_n on; below max_len.
  max_len = state.tokens.shape[1]
  first_n = start_n if from_n is None else jnp.maximum(start_n, from_n // state.page_size * state.page_size)
  put_nt = jnp.where(pos_nt >= first_n[:, None], pos_nt, max_len)
  flat = out[1].reshape(out[1].shape[:2] + (-1,)).astype(st.ROUTES_DTYPE)  # [n, t, L_sparse * k]: see DecodeState
  routes = state.routes.at[slots_n[:, None], put_nt].set(flat, mode="drop")
  return state.replace(cache=out[0], routes=routes)


# ----------------------------------------------------------------------------------------------------
# Row edits
# ----------------------------------------------------------------------------------------------------
def start_rows(
  state,
  slots_n,
  *,
  tokens_nl,
  length_n,
  keep_from_n,
  rng_n2=None,
  budget_n=None,
  sampling_n=None,
  reset_generated: bool,
  window: int,
  width: int,
):
  """Writes tokens[slot, keep_from:length] from tokens_nl (the rest of the row is kept), sets length,
  last_token, budget, a new segment starting at `length`, and the run/stop flags. Used by add and extend.
  rng_n2 / budget_n / sampling_n (a SlotSampling of [n] arrays) None keep the slot's own.

  Paged layout: the rows' pages from keep_from on are returned and the pages for `length_n` tokens taken, all or
  nothing (the engine checks free pages first; were they short, the state would be left as it was)."""
  max_len = state.tokens.shape[1]
  old = state
  ok = jnp.bool_(True)
  if state.paged:
    ps = state.page_size
    j = jnp.arange(state.page_table.shape[1])[None, :]
    gone = (j >= _pages.held(keep_from_n, ps)[:, None]) & _pages.named(state.page_table, slots_n)[:, None]
    rows, refs = _pages.drop(state.page_table[slots_n], state.page_refs, gone)
    table, refs, ok = _pages.extend(state.page_table.at[slots_n].set(rows), refs, slots_n, keep_from_n, length_n, ps)
    state = state.replace(page_table=table, page_refs=refs)
  pos_l = jnp.arange(max_len)[None, :]
  new_nl = pos_l >= keep_from_n[:, None]
  old_tok = state.tokens[slots_n]
  row_tok = jnp.where(new_nl, tokens_nl, old_tok)
  row_gen = jnp.where(new_nl, False, state.generated[slots_n])
  row_gen = jnp.where(reset_generated, False, row_gen)
  zero_n = jnp.zeros_like(length_n)
  rng_n2 = state.rng[slots_n] if rng_n2 is None else rng_n2
  budget_n = state.budget[slots_n] if budget_n is None else budget_n
  reason_n = jnp.where(budget_n <= 0, st.STOP_BUDGET, st.RUNNING)
  reason_n = jnp.where(length_n >= max_len, st.STOP_CACHE_FULL, reason_n)
  last_n = jnp.take_along_axis(row_tok, jnp.maximum(length_n - 1, 0)[:, None], axis=1)[:, 0]
  n_gen = jnp.sum(row_gen & (pos_l < length_n[:, None]), axis=1).astype(jnp.int32)
  new = state.replace(
    tokens=state.tokens.at[slots_n].set(row_tok),
    generated=state.generated.at[slots_n].set(row_gen),
    length=state.length.at[slots_n].set(length_n),
    last_token=state.last_token.at[slots_n].set(last_n),
    active=state.active.at[slots_n].set(reason_n == st.RUNNING),
    rng=state.rng.at[slots_n].set(rng_n2),
    budget=state.budget.at[slots_n].set(budget_n),
    n_generated=state.n_generated.at[slots_n].set(n_gen),
    stop_reason=state.stop_reason.at[slots_n].set(reason_n),
    tail=state.tail.at[slots_n].set(st.tail_from_tokens(row_tok, length_n, width)),
    seg_start=state.seg_start.at[slots_n].set(length_n),
    seg_count=state.seg_count.at[slots_n].set(zero_n),
    seg_entropy_sum=state.seg_entropy_sum.at[slots_n].set(0.0),
    seg_topk_entropy_sum=state.seg_topk_entropy_sum.at[slots_n].set(0.0),
    sampling=state.sampling
    if sampling_n is None
    else jax.tree.map(lambda x, y: x.at[slots_n].set(y), state.sampling, sampling_n),
  )
  return _all_or_nothing(ok, new, old)


def _all_or_nothing(ok, new, old):
  """`new` if ok else `old`, selecting every field but the cache (the callers never write a live page unless ok).
  A guard: the engine checks the free pages before each call (`Engine._need_pages`), so ok is True in practice."""
  if not new.paged:
    return new
  return _pages.when(ok, new.replace(cache=None), old.replace(cache=None)).replace(cache=new.cache)


def copy_rows(state, src_n, dst_n, rng_n2):
  """Fork: every per-slot field of src (KV rows included) copied to dst, with the given keys.

  Paged layout: dst's own pages are returned, then dst shares src's full pages and gets a copy of the partly
  filled last one (one page per fork at most); all or nothing."""

  def cp(x):
    return x.at[dst_n].set(x[src_n])

  copied = jax.tree.map(cp, state.slot_fields())  # every per-slot field (leading slot axis)
  if not state.paged:
    cache = jax.tree.map(lambda c: c.at[:, dst_n].set(c[:, src_n]), state.cache)  # [layers, slots, ...]
    return copied.replace(cache=cache, rng=state.rng.at[dst_n].set(rng_n2))
  ps = state.page_size
  table, refs = _pages.release(state.page_table, state.page_refs, dst_n)
  table, refs, ok, (src_m, dst_m) = _pages.fork(table, refs, src_n, dst_n, state.length[src_n], ps)
  cache = _pages.copy_pages(state.cache, src_m, dst_m, ok)
  new = copied.replace(cache=cache, rng=state.rng.at[dst_n].set(rng_n2), page_table=table, page_refs=refs)
  return _all_or_nothing(ok, new, state)


def truncate_rows(state, slots_n, length_n, window: int, width: int):
  """Rewinds rows to `length_n` tokens (KV beyond is simply ignored); the slot is left paused. Counters and
  segment sums are recomputed from the per-position buffers; the segment start moves back if needed.
  Paged layout: the pages past the new length are returned, and a shared last page is copied first (one page per
  row at most; all or nothing)."""
  max_len = state.tokens.shape[1]
  old, ok = state, jnp.bool_(True)
  if state.paged:
    ps = state.page_size
    table, refs, ok, (src_m, dst_m) = _pages.shrink(state.page_table, state.page_refs, slots_n, length_n, ps)
    state = state.replace(cache=_pages.copy_pages(state.cache, src_m, dst_m, ok), page_table=table, page_refs=refs)
  pos_l = jnp.arange(max_len)[None, :]
  tok = state.tokens[slots_n]
  keep = pos_l < length_n[:, None]
  gen = state.generated[slots_n] & keep
  n_gen = jnp.sum(gen, axis=1).astype(jnp.int32)
  removed = state.n_generated[slots_n] - n_gen
  seg_start = jnp.minimum(state.seg_start[slots_n], length_n)
  seg_count = jnp.sum(gen & (pos_l >= seg_start[:, None]), axis=1).astype(jnp.int32)
  ent, topk = state.entropy_buf[slots_n], state.topk_entropy_buf[slots_n]
  new = state.replace(
    generated=state.generated.at[slots_n].set(gen),
    length=state.length.at[slots_n].set(length_n),
    last_token=state.last_token.at[slots_n].set(
      jnp.take_along_axis(tok, jnp.maximum(length_n - 1, 0)[:, None], axis=1)[:, 0]
    ),
    active=state.active.at[slots_n].set(False),
    budget=state.budget.at[slots_n].add(removed),
    n_generated=state.n_generated.at[slots_n].set(n_gen),
    stop_reason=state.stop_reason.at[slots_n].set(st.RUNNING),
    tail=state.tail.at[slots_n].set(st.tail_from_tokens(tok, length_n, width)),
    seg_start=state.seg_start.at[slots_n].set(seg_start),
    seg_count=state.seg_count.at[slots_n].set(seg_count),
    seg_entropy_sum=state.seg_entropy_sum.at[slots_n].set(st.segment_sums(ent, seg_start, seg_count, window)),
    seg_topk_entropy_sum=state.seg_topk_entropy_sum.at[slots_n].set(
      st.segment_sums(topk, seg_start, seg_count, window)
    ),
  )
  return _all_or_nothing(ok, new, old)


def release_rows(state, slots_n):
  zero = jnp.zeros_like(slots_n)
  if state.paged:
    table, refs = _pages.release(state.page_table, state.page_refs, slots_n)
    state = state.replace(page_table=table, page_refs=refs)
  return state.replace(
    length=state.length.at[slots_n].set(zero),
    active=state.active.at[slots_n].set(False),
    stop_reason=state.stop_reason.at[slots_n].set(zero),
    budget=state.budget.at[slots_n].set(zero),
  )


def page_needs(state, slots_n, lengths_n):
  """(free pages after the cut returns its pages, pages `truncate_rows(state, slots_n, lengths_n)` copies (shared
  last pages), whether they are enough)."""
  _, refs, enough, (src_m, dst_m) = _pages.shrink(
    state.page_table, state.page_refs, slots_n, lengths_n, state.page_size
  )
  return _pages.free_count(refs) + jnp.sum(dst_m != _pages.NULL_PAGE), jnp.sum(src_m != _pages.NULL_PAGE), enough


def resume_rows(state, slots_n):
  """Slots stopped for want of a page ('out_of_pages') decode again from where they stopped (same segment)."""
  stalled = state.stop_reason[slots_n] == st.STOP_NO_PAGES
  return state.replace(
    active=state.active.at[slots_n].set(state.active[slots_n] | stalled),
    stop_reason=state.stop_reason.at[slots_n].set(jnp.where(stalled, st.RUNNING, state.stop_reason[slots_n])),
  )


def set_segment(state, slots_n, start_n, generated_nl, entropy_nl, topk_nl, window: int):
  """Restores the open segment of rows re-prefilled mid-segment (a preempted trajectory): the per-position buffers
  from `start_n` up to the row's length (generated flags, exact and top-k entropies), then the segment's start,
  count, sums and `n_generated` recomputed from them as `truncate_rows` does."""
  max_len = state.tokens.shape[1]
  pos_l = jnp.arange(max_len)[None, :]
  length = state.length[slots_n]
  seg = (pos_l >= start_n[:, None]) & (pos_l < length[:, None])
  gen = jnp.where(seg, generated_nl, state.generated[slots_n])
  ent = jnp.where(seg, entropy_nl, state.entropy_buf[slots_n])
  topk = jnp.where(seg, topk_nl, state.topk_entropy_buf[slots_n])
  count = jnp.sum(gen & seg, axis=1).astype(jnp.int32)
  return state.replace(
    generated=state.generated.at[slots_n].set(gen),
    entropy_buf=state.entropy_buf.at[slots_n].set(ent),
    topk_entropy_buf=state.topk_entropy_buf.at[slots_n].set(topk),
    n_generated=state.n_generated.at[slots_n].set(jnp.sum(gen & (pos_l < length[:, None]), axis=1).astype(jnp.int32)),
    seg_start=state.seg_start.at[slots_n].set(start_n),
    seg_count=state.seg_count.at[slots_n].set(count),
    seg_entropy_sum=state.seg_entropy_sum.at[slots_n].set(st.segment_sums(ent, start_n, count, window)),
    seg_topk_entropy_sum=state.seg_topk_entropy_sum.at[slots_n].set(st.segment_sums(topk, start_n, count, window)),
  )
