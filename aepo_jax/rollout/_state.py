"""The engine's device state (`DecodeState`) and the per-step outputs (`StepOutputs`).

Invariant (one for every operation): a slot holds `length` tokens in `tokens[:length]`; the KV entries of
the first `length - 1` tokens are in the cache; `last_token == tokens[length - 1]` is not in the cache yet.
A decode step feeds `last_token` at position `length - 1` (writing its KV), samples the next token and
appends it. So prefill and extend never need logits: they only write KV up to index `length - 2`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from aepo_jax.model import init_cache
from aepo_jax.rollout import _pages
from aepo_jax.rollout._sampling import SlotSampling

ROUTES_DTYPE = jnp.int16  # expert indices (< 32768 experts), half the bytes of int32

# stop_reason codes (contract: docs/rollout_contract.md)
RUNNING, STOP_EOS, STOP_SEQUENCE, STOP_BUDGET, STOP_CACHE_FULL, STOP_NO_PAGES = 0, 1, 2, 3, 4, 5
STOP_REASON_NAMES = {
  RUNNING: "running",
  STOP_EOS: "eos",
  STOP_SEQUENCE: "stop_sequence",
  STOP_BUDGET: "length",
  STOP_CACHE_FULL: "cache_full",
  STOP_NO_PAGES: "out_of_pages",  # paged cache: paused before writing; `Engine.resume` continues it
}


@flax.struct.dataclass
class DecodeState:
  """All fields are device arrays with a leading slot axis S, except the cache (dense: [layers, S, max_len, kv_heads,
  head_dim]; paged: per layer a pool [kv_heads, pages, page_size, head_dim]) and `page_refs` (see _pages.py)."""

  cache: dict  # {'k', 'v'} KV rows (dense) or pages (paged)
  tokens: jax.Array  # [S, max_len] int32, tokens of each row (prompt, generated, tool results)
  generated: jax.Array  # [S, max_len] bool, True where the token was sampled by the engine
  entropy_buf: jax.Array  # [S, max_len] float32, exact entropy at each sampled position (0 elsewhere)
  topk_entropy_buf: jax.Array  # [S, max_len] float32, official top-k entropy at each sampled position
  length: jax.Array  # [S] int32 tokens in the row
  last_token: jax.Array  # [S] int32 == tokens[length - 1], KV not yet cached
  active: jax.Array  # [S] bool decoding
  rng: jax.Array  # [S, 2] uint32 raw PRNG key per slot
  budget: jax.Array  # [S] int32 new tokens left
  n_generated: jax.Array  # [S] int32 tokens sampled since `add` (tool tokens excluded)
  stop_reason: jax.Array  # [S] int32 see the codes above
  tail: jax.Array  # [S, W] int32 last W tokens (-1 before the row start), for stop sequences
  seg_start: jax.Array  # [S] int32 length at the start of the current segment (set by add/extend)
  seg_count: jax.Array  # [S] int32 tokens generated in the current segment
  seg_entropy_sum: jax.Array  # [S] float32 exact entropy summed over the first `entropy_window` segment tokens
  seg_topk_entropy_sum: jax.Array  # [S] float32 official top-k entropy summed over the same window
  sampling: SlotSampling  # [S] each: the slot's own sampling settings (set by add; read in per-slot mode)
  page_table: jax.Array = None  # [S, ceil(max_len / page_size)] int32 page ids (paged layout; None when dense)
  page_refs: jax.Array = None  # [pages] int32 slots holding each page (paged layout; None when dense)
  # [S, max_len, L_sparse * k] int16: the experts the token at each position went to in each sparse layer, written
  # where its KV entry is written (prefill, extend, decode), so routes[:length - 1] are those of the cached tokens
  # (routing replay, `Engine(record_routes=True)`; None otherwise). The (layer, expert) axes are one: a 4-D buffer
  # with a minor axis of k made XLA:TPU relayout the whole buffer twice per decode call (0.6 GB each at Qwen3-30B-A3B's
  # 96 slots x 8,192 tokens); flat, its scatter is in place (`Engine.slot_routes` gives [length, L_sparse, k]).
  routes: jax.Array = None

  @property
  def paged(self) -> bool:
    return self.page_table is not None

  @property
  def page_size(self) -> int:
    return self.cache["k"][0].shape[2]

  def slot_fields(self) -> "DecodeState":
    """The state without the fields that have no slot axis (cache, page_refs): for per-slot tree maps."""
    return self.replace(cache=None, page_refs=None)


@flax.struct.dataclass
class StepOutputs:
  """Outputs of `Engine.decode`, each [S, num_steps]; entries with valid=False are padding."""

  token: jax.Array
  logprob: jax.Array
  entropy: jax.Array
  topk_entropy: jax.Array
  valid: jax.Array
  top_ids: jax.Array  # [S, num_steps, N] int32 the N most likely tokens (N = 0 unless requested)
  top_logprobs: jax.Array  # [S, num_steps, N] their log-probs (same distribution as `logprob`)


def empty_state(
  config,
  max_slots: int,
  max_len: int,
  tail_width: int,
  cache_dtype=None,
  page_size: int = 0,
  num_pages: int = 0,
  record_routes: bool = False,
) -> DecodeState:
  """page_size 0: the dense layout; else a pool of `num_pages` pages (page 0 the null page, see _pages.py).
  record_routes (a model with experts): the `routes` buffer."""
  s = max_slots

  def zi():  # a fresh buffer per field: the state is donated, and a buffer may not be donated twice
    return jnp.zeros((s,), jnp.int32)

  def zf():
    return jnp.zeros((s,), jnp.float32)

  table = refs = None
  if page_size:
    # One array per layer (see _pages.py: stacked, XLA:TPU copied the pool each step), fresh buffers (donated).
    shape = (config.num_kv_heads, num_pages, page_size, config.head_dim)
    dt = jnp.dtype(cache_dtype or config.dtype)
    cache = {n: tuple(jnp.zeros(shape, dt) for _ in range(config.num_layers)) for n in ("k", "v")}
    table, refs = _pages.init(s, -(-max_len // page_size), num_pages)
  else:
    cache = init_cache(config, s, max_len, cache_dtype)
  return DecodeState(
    cache=cache,
    tokens=jnp.zeros((s, max_len), jnp.int32),
    generated=jnp.zeros((s, max_len), bool),
    entropy_buf=jnp.zeros((s, max_len), jnp.float32),
    topk_entropy_buf=jnp.zeros((s, max_len), jnp.float32),
    length=zi(),
    last_token=zi(),
    active=jnp.zeros((s,), bool),
    rng=jnp.zeros((s, 2), jnp.uint32),
    budget=zi(),
    n_generated=zi(),
    stop_reason=zi(),
    tail=jnp.full((s, tail_width), -1, jnp.int32),
    seg_start=zi(),
    seg_count=zi(),
    seg_entropy_sum=zf(),
    seg_topk_entropy_sum=zf(),
    sampling=SlotSampling.filled(s),
    page_table=table,
    page_refs=refs,
    routes=jnp.zeros((s, max_len, sum(config.moe_layers) * config.num_experts_per_tok), ROUTES_DTYPE)
    if record_routes
    else None,
  )


def tail_from_tokens(tokens_sl, length_s, width: int):
  """The last `width` tokens of each row (-1 where the index would be negative)."""
  idx_sw = length_s[:, None] - width + jnp.arange(width)[None, :]
  got = jnp.take_along_axis(tokens_sl, jnp.maximum(idx_sw, 0), axis=1)
  return jnp.where(idx_sw >= 0, got, -1)


def segment_sums(buf_sl, seg_start_s, seg_count_s, window: int):
  """Sum of buf over [seg_start, seg_start + min(seg_count, window)) per row."""
  pos_l = jnp.arange(buf_sl.shape[1])[None, :]
  in_win = (pos_l >= seg_start_s[:, None]) & (pos_l < (seg_start_s + jnp.minimum(seg_count_s, window))[:, None])
  return jnp.sum(jnp.where(in_win, buf_sl, 0.0), axis=1)
