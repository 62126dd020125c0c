"""Functional surface of the policy model: plain functions of (config, params, arrays).

Params are an unboxed nested dict (`{'embed_tokens': ..., 'layers': ..., 'norm': ..., ['lm_head']}`), layer
parameters stacked on a leading `layers` axis. All functions are jit-able with `config` static.
"""

from __future__ import annotations

import functools
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from aepo_jax.model import _layers, _moe, _splash
from aepo_jax.model._config import ModelConfig
from aepo_jax.model._decoder import Block, Decoder


def _module(config: ModelConfig, return_routes: bool = False) -> Decoder:
  return Decoder(config, return_routes)


def default_positions(attention_mask_bt):
  """Positions that skip left padding: the i-th valid token of a row gets position i."""
  return jnp.maximum(jnp.cumsum(attention_mask_bt.astype(jnp.int32), axis=-1) - 1, 0)


def segment_positions(segment_ids_bt):
  """Positions of packed rows: each segment (a run of equal non-zero ids) counts from 0; padding (id 0) gets 0."""
  seg = jnp.asarray(segment_ids_bt)
  t = seg.shape[1]
  idx = jnp.broadcast_to(jnp.arange(t), seg.shape)
  starts = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
  return jnp.where(seg > 0, idx - start_idx, 0)


def _causal_mask(attention_mask_bt, segment_ids_bt=None):
  t = attention_mask_bt.shape[1]
  causal_ts = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  mask = causal_ts[None] & attention_mask_bt.astype(bool)[:, None, :]
  if segment_ids_bt is not None:  # packed rows: a token attends only to its own segment
    mask = mask & (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])
  return mask


def _full_mask(config: ModelConfig, attention_mask_bt, segment_ids_bt=None):
  """The decoder's mask argument for a full-sequence call: [B, T, S] bool, or the [B, T] segment ids splash
  attention takes (it builds the causal mask block by block)."""
  if config.attention_impl == "splash":
    return _splash.segment_ids(attention_mask_bt, segment_ids_bt)
  return _causal_mask(attention_mask_bt, segment_ids_bt)


def init_params(config: ModelConfig, rng, *, boxed: bool = False):
  """Random parameters: kernels and embeddings normal(0.02), norm scales 1, biases 0 (the initializers the
  modules declare). `boxed=True` keeps flax's logical-axis boxes.

  One compiled program that draws every normal value with a single `jax.random.normal` and splits it into the
  leaves: flax's own init draws per leaf and compiles in ~8 s on a 2-core CPU even for a 2-layer model (~2.5 s of
  that from the partitionable threefry of each draw), which every random-init test and trainer run paid."""
  return _init_jit(config, rng, bool(boxed))


def _leaf_init(path) -> str:
  """'ones' | 'zeros' | 'normal' for a parameter path (tests/model check it against flax's own init)."""
  name = getattr(path[-1], "key", str(path[-1]))
  return {"scale": "ones", "bias": "zeros"}.get(name, "normal")


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_jit(config: ModelConfig, rng, boxed: bool):
  shapes = param_shapes(config)
  flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  sizes = [int(np.prod(s.shape)) for p, s in flat if _leaf_init(p) == "normal"]
  draws = jax.random.normal(rng, (sum(sizes),), jnp.float32) * 0.02
  offsets = np.cumsum([0] + sizes)
  leaves, k = [], 0
  for path, s in flat:
    kind = _leaf_init(path)
    if kind == "normal":
      leaves.append(draws[offsets[k] : offsets[k + 1]].reshape(s.shape).astype(s.dtype))
      k += 1
    else:
      leaves.append((jnp.ones if kind == "ones" else jnp.zeros)(s.shape, s.dtype))
  params = jax.tree_util.tree_unflatten(treedef, leaves)
  if not boxed:
    return params
  return jax.tree.map(
    lambda box, value: box.replace_boxed(value),
    _abstract_params(config, True),
    params,
    is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
  )


def _flax_init(config: ModelConfig, rng, boxed: bool = True):
  """Flax's own init of the modules (the source of the tree's structure, shapes and logical axes)."""
  tokens = jnp.zeros((1, 4), jnp.int32)
  mask = jnp.ones((1, 4), jnp.int32)
  module = _module(config.replace(attention_impl="xla"))  # parameters do not depend on the attention kernel
  variables = module.init(rng, tokens, default_positions(mask), _causal_mask(mask), method=Decoder.init_all)
  params = variables["params"]
  return params if boxed else nn.unbox(params)


@functools.lru_cache(maxsize=32)
def _abstract_params(config: ModelConfig, boxed: bool):
  # Tracing flax's init takes ~1 s per call; shardings, checkpoint restores, the optimizer state and init_params
  # all ask for the same shapes, so they are traced once per config (ShapeDtypeStructs and specs are immutable).
  return jax.eval_shape(lambda: _flax_init(config, jax.random.PRNGKey(0), boxed))


def param_shapes(config: ModelConfig):
  """ShapeDtypeStructs of the parameter tree (no memory allocated; cached per config)."""
  return _abstract_params(config, False)


def param_logical_axes(config: ModelConfig):
  """Pytree (same structure as params) of `PartitionSpec`s of logical axis names."""
  return nn.get_partition_spec(_abstract_params(config, True))


def forward_hidden(
  config: ModelConfig,
  params,
  tokens_bt,
  positions_bt=None,
  attention_mask_bt=None,
  segment_ids_bt=None,
  *,
  routes_btsk=None,
  return_routes: bool = False,
  router_stats: bool = False,
):
  """Final-norm hidden states [B, T, D] (compute dtype) of a full (uncached) forward.

  `segment_ids_bt` (optional) packs several sequences into a row: tokens with equal non-zero ids form one
  sequence, attend only within it and (by default) take positions from its start, so each sequence gets the
  hidden states it would get alone; id 0 is padding.

  Routing replay (a model with experts; R3, arXiv 2510.11370): `routes_btsk` [B, T, L_sparse, k] int, the experts
  each token goes to in each sparse layer (in layer order; `_moe.route`: a token whose row holds a negative index
  routes itself); `return_routes=True` returns (hidden, routes [B, T, L_sparse, k] int32), the experts used.
  `router_stats=True` (a model with experts) also returns, last, the router's balance statistics of the sparse
  layers over the valid tokens [L_sparse, 2, E] (`_balance.router_stats`; `_balance.balance_loss` makes them the
  load-balancing loss)."""
  if (routes_btsk is not None or return_routes or router_stats) and not config.has_experts:
    raise ValueError(f"forward_hidden: routes are the experts of a sparse layer; {config.family!r} has none.")
  if attention_mask_bt is None:
    attention_mask_bt = jnp.ones(tokens_bt.shape, jnp.int32)
  if segment_ids_bt is not None:
    attention_mask_bt = attention_mask_bt * (segment_ids_bt > 0)
  if positions_bt is None:
    positions_bt = default_positions(attention_mask_bt) if segment_ids_bt is None else segment_positions(segment_ids_bt)
  out = _module(config, return_routes).apply(
    {"params": params},
    tokens_bt,
    positions_bt,
    _full_mask(config, attention_mask_bt, segment_ids_bt),
    routes_btsk=routes_btsk,
    token_weights_bt=attention_mask_bt.astype(jnp.float32) if router_stats else None,
  )
  return (out[0], *out[2:]) if len(out) > 2 else out[0]


def unembed(config: ModelConfig, params, h_btd):
  """Logits (float32) from hidden states; tied or untied head as the config says (`_layers.unembed`)."""
  return _layers.unembed(config, params, h_btd)


def unembed_matrix(config: ModelConfig, params):
  """(W, layout): the unembedding as stored, the tied embedding [V, D] ('vd') or the lm_head kernel [D, V] ('dv'),
  for `objectives.token_logprobs_and_entropy(h, W, ..., layout=layout)` (same logits as `unembed`)."""
  if config.tie_word_embeddings:
    return params["embed_tokens"]["embedding"], "vd"
  return params["lm_head"]["kernel"], "dv"


def forward(
  config: ModelConfig, params, tokens, positions=None, attention_mask=None, *, routes=None, return_routes=False
):
  """Float32 logits [B, T, V]. `attention_mask` [B, T] marks valid tokens (left or right padding);
  `positions` default to the running count of valid tokens in each row. routes / return_routes: routing replay
  and the experts used, as in `forward_hidden` ((logits, routes) with return_routes)."""
  out = forward_hidden(
    config, params, tokens, positions, attention_mask, routes_btsk=routes, return_routes=return_routes
  )
  if return_routes:
    return unembed(config, params, out[0]), out[1]
  return unembed(config, params, out)


# ----------------------------------------------------------------------------------------------------
# KV cache (used by the rollout engine)
# ----------------------------------------------------------------------------------------------------
def init_cache(config: ModelConfig, num_slots: int, max_len: int, dtype: Optional[str] = None):
  """Zeroed K/V cache {'k','v'}: [layers, slots, max_len, kv_heads, head_dim]."""
  shape = (config.num_layers, num_slots, max_len, config.num_kv_heads, config.head_dim)
  dt = jnp.dtype(dtype or config.dtype)
  return {"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)}


CACHE_LOGICAL_AXES = ("layers", "cache_batch", "cache_length", "cache_kv_heads", "head_dim")
# The engine's paged pool, per layer [kv_heads, pages, page_size, head_dim] (aepo_jax/rollout/_pages.py).
PAGED_CACHE_LOGICAL_AXES = ("cache_kv_heads", "cache_pages", "cache_length", "head_dim")


def forward_cached(
  config: ModelConfig, params, tokens_bt, positions_bt, cache, write_index_b, *, return_hidden: bool = False
):
  """One chunk of T tokens per row against the cache.

  Row b's tokens are written at cache[:, b, write_index_b[b] : write_index_b[b] + T] and token t attends to
  every cache entry j <= write_index_b[b] + t. Entries at or beyond a row's true length must never be
  needed: the caller keeps rows contiguous from index 0 and guarantees write_index_b + T <= max_len.
  Right padding inside the chunk is harmless (written past the row's length, overwritten later).
  Returns (logits [B,T,V] float32 or hidden [B,T,D], new_cache).
  """
  t = tokens_bt.shape[1]
  s = cache["k"].shape[2]
  query_index_bt = write_index_b[:, None] + jnp.arange(t)[None, :]
  mask_bts = jnp.arange(s)[None, None, :] <= query_index_bt[:, :, None]
  module = _module(config)
  h_btd, new_cache = module.apply({"params": params}, tokens_bt, positions_bt, mask_bts, cache, write_index_b)
  if return_hidden:
    return h_btd, new_cache
  return _layers.unembed(config, params, h_btd), new_cache


def fill_cache_rows(
  config: ModelConfig,
  params,
  tokens_nt,
  positions_nt,
  cache,
  rows_n,
  start_n,
  attend_len: int,
  *,
  page_table=None,
  write_from_n=None,
  return_routes: bool = False,
):
  """Writes the KV entries of a chunk of T tokens for n cache rows and returns the new cache; nothing else (with
  `return_routes`, a model with experts: (cache, the experts the chunk's tokens went to [n, T, L_sparse, k])).

  Row i's tokens_nt[i] sit at cache indices start_n[i] .. start_n[i] + T - 1 of cache row rows_n[i] and attend to
  that row's entries j <= their index (entries below start_n[i] must already be valid). The layers are scanned
  with the whole cache in the carry: each layer reads only its own [n, attend_len] window of the rows (attend_len
  static, >= every start_n + T) and writes only the chunk's [n, T] entries back, so no step holds more than one
  layer's window of n rows, and the (donated) cache is updated in place. Rows may repeat (identical writes).
  The same layer code as `forward_cached` (tested equal).

  Paged cache (`page_table` [S, P] given; per layer a pool [K, pages, page_size, D], aepo_jax/rollout/_pages.py): the
  window is gathered from the row's pages and written back as whole pages: start_n must be a multiple of the page
  size and T too. The entries of the page holding write_from_n[i] before it are rewritten with recomputed values
  (that page is the row's own, _pages.py's invariant); a page that ends before write_from_n[i] (the window was moved
  back to fit) is not written, it may be shared; pages not assigned take the writes on the null page."""
  if return_routes and not config.has_experts:
    raise ValueError(f"fill_cache_rows: routes are the experts of a sparse layer; {config.family!r} has none.")
  t = tokens_nt.shape[1]
  paged = page_table is not None
  if paged:
    ps = cache["k"][0].shape[2]
    n_pages = -(-attend_len // ps)
    attend_len = n_pages * ps
    table_np = page_table[rows_n, :n_pages]
    full_np = page_table[rows_n]
  query_nt = start_n[:, None] + jnp.arange(t)[None, :]
  mask_nts = jnp.arange(attend_len)[None, None, :] <= query_nt[:, :, None]
  h_ntd = _layers.embed(params["embed_tokens"]["embedding"], tokens_nt, jnp.dtype(config.dtype))
  block = Block(config, return_routes)
  window = jax.vmap(lambda c, i: jax.lax.dynamic_slice_in_dim(c, i, t, axis=0))  # [n, A, K, D] -> [n, T, K, D]
  idx_nt = query_nt
  if paged:  # whole pages: the window starts on a page and spans T / ps of them (the engine aligns it)
    p, jn = page_table.shape[1], t // ps
    j_nj = start_n[:, None] // ps + jnp.arange(jn)[None, :]
    page_nj = jnp.take_along_axis(full_np, jnp.clip(j_nj, 0, p - 1), axis=1)
    # A page that ends before write_from (the window was moved back to fit) is not written: it may be shared.
    keep = ((j_nj + 1) * ps > (start_n if write_from_n is None else write_from_n)[:, None]) & (j_nj < p)
    page_nj = jnp.where(keep, page_nj, 0)

  def gather(c, li):
    if not paged:
      return jax.lax.dynamic_index_in_dim(c, li, 0, keepdims=False)[rows_n, :attend_len]
    g = c[:, table_np]  # this layer's pool [K, pages, ps, D] -> [K, n, pages, ps, D]
    kh, n = g.shape[0], g.shape[1]
    return jnp.moveaxis(g.reshape(kh, n, attend_len, g.shape[-1]), 0, 2)  # [n, A, K, D]

  def scatter(c, li, new_ntkd):
    if not paged:
      return c.at[li, rows_n[:, None], idx_nt].set(new_ntkd.astype(c.dtype))
    n, _, kh, d = new_ntkd.shape
    pages = jnp.moveaxis(new_ntkd.reshape(n, jn, ps, kh, d), 3, 0)  # [K, n, T / ps, ps, D]
    # Whole pages, indexed on the page axis only: XLA:TPU writes them in place (a scatter of ~1,000 single tokens
    # made it copy the layer's pool to another layout and back).
    return c.at[:, page_nj].set(pages.astype(c.dtype))

  def layer(carry, xs):
    h_ntd, cache = carry
    layer_params, li = xs
    rows = {name: gather(c, li) for name, c in cache.items()}
    h_ntd, ys = block.apply({"params": layer_params}, h_ntd, rows, positions_nt, mask_nts, start_n, li)
    new_rows, experts_ntk = ys if return_routes else (ys, None)
    cache = {name: scatter(c, li, window(new_rows[name], start_n)) for name, c in cache.items()}
    return (h_ntd, cache), experts_ntk

  if not paged:
    (_, cache), experts_lntk = jax.lax.scan(
      layer, (h_ntd, cache), (params["layers"], jnp.arange(config.num_layers, dtype=jnp.int32))
    )
  else:
    new, experts = {"k": [], "v": []}, []  # per-layer pools, layers unrolled: every write in place (_pages.py)
    for li in range(config.num_layers):
      xs = (jax.tree.map(lambda x: x[li], params["layers"]), jnp.int32(li))
      (h_ntd, c), e = layer((h_ntd, {"k": cache["k"][li], "v": cache["v"][li]}), xs)
      new["k"].append(c["k"])
      new["v"].append(c["v"])
      experts.append(e)
    cache = {n: tuple(c) for n, c in new.items()}
    experts_lntk = jnp.stack(experts) if return_routes else None
  return (cache, _moe.sparse_routes(config, experts_lntk)) if return_routes else cache
