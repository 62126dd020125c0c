"""The model's decode step: a one-token-per-row decoder forward over the KV cache, for the engine.

It runs the layer definition the Flax modules run (`_layers.layer`: norms, projections with their biases, q/k norms,
RoPE, grouped-query attention, SwiGLU or the expert block, the head), so it is `aepo_jax.model.forward_cached` with
T = 1 (tested equal, and equal to `forward` token by token: tests/model/test_decode_parity.py). What is its own is
arranged for memory traffic, which is what bounds decode at small batch:
  * the KV cache rides in the carry of the layer scan and each layer writes its new entries with a scatter, so
    XLA updates the (donated) cache in place instead of stacking a new cache per step;
  * attention reads only the first `attend_len` cache entries (a static bucket >= every active row's length),
    not the whole max_len.
The mask depends only on the positions, so it is built once per step, outside the layer loop.

On CPU the engine passes `weights_t = decode_weights(config, params)` (prepared once per parameter version) and
the projections run through the small-M kernel of `_cpu_decode` instead of XLA dots, and attention (float32 cache)
through its decode-attention kernel, which reads each row's entries [0, pos] in place instead of copying the
layer's first `attend_len` entries of every row (docs/performance.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aepo_jax.model import _cpu_decode, _layers, _moe


def decode_weights(config, params) -> dict:
  """The projection weights re-laid out for `aepo_jax.model._cpu_decode` (one row per output column), float32:
  qkv [L, (H + 2K) * hd, D] (q, k, v fused), o [L, D, H * hd], gate_up [L, 2F, D] (gate, up fused),
  down [L, D, F] (where some layer has the dense MLP), and head [V, D] when the embeddings are untied (a tied head
  is the embedding itself)."""
  lay = params["layers"]
  a, m = lay["self_attn"], lay["mlp"]
  f32 = jnp.float32

  def in_heads(kernel):  # [L, D, N, hd] -> [L, N*hd, D]
    l, d = kernel.shape[:2]
    return jnp.swapaxes(kernel.reshape(l, d, -1), 1, 2).astype(f32)

  o = a["o_proj"]["kernel"]  # [L, H, hd, D]
  out = {
    "qkv": jnp.concatenate([in_heads(a[n]["kernel"]) for n in ("q_proj", "k_proj", "v_proj")], axis=1),
    "o": jnp.swapaxes(o.reshape(o.shape[0], -1, o.shape[-1]), 1, 2).astype(f32),
  }
  if config.has_dense_mlp:  # the expert block of a sparse layer stays on XLA ops (`_layers.feed_forward`)
    out["gate_up"] = jnp.concatenate(
      [jnp.swapaxes(m[n]["kernel"], 1, 2).astype(f32) for n in ("gate_proj", "up_proj")], axis=1
    )
    out["down"] = jnp.swapaxes(m["down_proj"]["kernel"], 1, 2).astype(f32)
  if not config.tie_word_embeddings:
    out["head"] = params["lm_head"]["kernel"].T.astype(f32)
  return out


def _paged_attention(cache, q_shd, k_skd, v_skd, pos_s, page_table, write_page_s, attend_len, kernel):
  """One layer's decode-step cache write and attention over its paged pool ({'k', 'v'}: [K, pages, page_size, D])
  -> (k pool, v pool, out [S, H * D])."""
  s, h, d = q_shd.shape
  kh, ps = cache["k"].shape[0], cache["k"].shape[2]
  off_s = pos_s % ps
  # Every dim but head_dim indexed (heads too), so XLA:TPU scatters head_dim rows into the pool in its own layout;
  # `pool.at[:, page_s, off_s]` (heads as a window) made it relayout the whole pool and copy it back, per layer and
  # step (tests/model/test_paged_tpu.py reads the compiled program).
  heads_ks = jnp.broadcast_to(jnp.arange(kh)[:, None], (kh, s))
  page_ks = jnp.broadcast_to(write_page_s[None, :], (kh, s))
  off_ks = jnp.broadcast_to(off_s[None, :], (kh, s))
  ck = cache["k"].at[heads_ks, page_ks, off_ks].set(jnp.swapaxes(k_skd, 0, 1).astype(cache["k"].dtype))
  cv = cache["v"].at[heads_ks, page_ks, off_ks].set(jnp.swapaxes(v_skd, 0, 1).astype(cache["v"].dtype))
  n = -(-attend_len // ps)
  table = page_table[:, :n]
  if kernel:
    from aepo_jax import parallel
    from aepo_jax.model import _paged_tpu

    # Rows that write nowhere (inactive) read nothing: length 0 (their outputs are not used).
    lengths = jnp.where(write_page_s > 0, pos_s + 1, 0)
    out = _paged_tpu.paged_decode_attention(
      q_shd, ck, cv, lengths, table, mesh=parallel.current_mesh(), interpret=kernel == "interpret"
    )
    return ck, cv, out.reshape(s, h * d)
  # Gathered pages as [S, A, K, D] keys for the shared grouped-query attention (one query per row).
  keys, vals = (jnp.moveaxis(c[:, table].reshape(kh, s, n * ps, d), 0, 2).astype(q_shd.dtype) for c in (ck, cv))
  mask_sa = jnp.arange(n * ps)[None, :] <= pos_s[:, None]
  out = _layers.attend(_layers.grouped(q_shd, kh), keys, vals, mask_sa)
  return ck, cv, out.reshape(s, h * d)


class _KernelDots:
  """The weight products through `_cpu_decode.matmul_t` on the stacked `decode_weights` with the layer index (no
  per-layer weight slices); the same products as `_layers.Dots` on the stored parameters (the `p` arguments)."""

  def __init__(self, config, weights_t, li):
    self.cfg, self.w, self.li = config, weights_t, li

  def qkv(self, p, x):
    cfg = self.cfg
    n_q, n_kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    y = _cpu_decode.matmul_t(x, self.w["qkv"], self.li)
    s = x.shape[0]
    q, k, v = y[:, :n_q], y[:, n_q : n_q + n_kv], y[:, n_q + n_kv :]
    return q.reshape(s, cfg.num_heads, -1), k.reshape(s, cfg.num_kv_heads, -1), v.reshape(s, cfg.num_kv_heads, -1)

  def out(self, p, o):
    return _cpu_decode.matmul_t(o.reshape(o.shape[0], -1), self.w["o"], self.li)

  def gate_up(self, p, x):
    y = _cpu_decode.matmul_t(x, self.w["gate_up"], self.li)
    f = self.cfg.intermediate_size
    return y[:, :f], y[:, f:]

  def down(self, p, h):
    return _cpu_decode.matmul_t(h, self.w["down"], self.li)


def decode_forward(
  config,
  params,
  token_s,
  pos_s,
  cache,
  attend_len: int,
  *,
  return_hidden: bool = False,
  weights_t: dict = None,
  page_table=None,
  write_page_s=None,
  paged_kernel: str = "",
  routes_ssk=None,
  return_routes: bool = False,
):
  """token_s [S] at positions pos_s [S] (also their cache index). Returns (logits [S,V] float32, new cache), and
  with `return_routes` (a model with experts) the experts each row's token went to [S, L_sparse, k] int32 third;
  routes_ssk [S, L_sparse, k]: experts to replay (`_moe.route`).

  weights_t: `decode_weights(config, params)`; when given, the projections run through the CPU small-M kernel
  (`_cpu_decode.matmul_t`) on the stacked weights with the layer index (no per-layer weight slices), and with a
  float32 cache attention runs through `_cpu_decode.attention`; otherwise both are XLA dots on `params`.

  Paged cache (`page_table` [S, P] given; per layer a pool [K, pages, page_size, D], aepo_jax/rollout/_pages.py):
  row s writes its new entries at page `write_page_s[s]`, offset pos % page_size (page 0, the null page, for a row
  that must not write), and attends to the pages of its table up to `attend_len`: gathered for XLA's attention, or
  read in place by JAX's Pallas paged-attention kernel when `paged_kernel` is 'tpu' ('interpret': the same kernel
  in Pallas's interpret mode, for tests on CPU).
  """
  cfg = config
  if (routes_ssk is not None or return_routes) and not cfg.has_experts:
    raise ValueError(f"decode_forward: routes are the experts of a sparse layer; {cfg.family!r} has none.")
  dt = jnp.dtype(cfg.dtype)
  s = token_s.shape[0]
  h_heads, k_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  rows = jnp.arange(s)
  mask_sa = jnp.arange(attend_len)[None, :] <= pos_s[:, None]
  lay = params["layers"]

  kernel_attention = False
  if weights_t is None:
    layer_xs = lay
  else:
    kernel_attention = page_table is None and _cpu_decode.attention_applies(cfg, cache["k"].dtype) and dt == jnp.float32
    # Only the small per-layer parameters ride in the scan; the projections stay stacked in weights_t.
    layer_xs = {
      "input_layernorm": lay["input_layernorm"],
      "post_attention_layernorm": lay["post_attention_layernorm"],
      "self_attn": {n: v for n, v in lay["self_attn"].items() if n in ("q_norm", "k_norm")},
      # the expert block (router and experts) rides in the scan: it runs on XLA ops
      "mlp": {n: v for n, v in lay["mlp"].items() if n in ("gate", "experts")},
    }
    if cfg.attention_bias:
      for n in ("q_proj", "k_proj", "v_proj"):
        layer_xs["self_attn"][n] = {"bias": lay["self_attn"][n]["bias"]}

  x_sd = _layers.embed(params["embed_tokens"]["embedding"], token_s, dt)

  def layer(carry, xs):
    x_sd, cache = carry
    p, li, routes_sk = xs

    def attention(q_shd, k_skd, v_skd):  # this step's KV entries into the cache, attention over it
      if page_table is not None:  # cache: this layer's pools (the layers are unrolled)
        ck, cv, out = _paged_attention(
          cache, q_shd, k_skd, v_skd, pos_s, page_table, write_page_s, attend_len, paged_kernel
        )
        return out.reshape(s, h_heads, d), {"k": ck, "v": cv}
      ck = cache["k"].at[li, rows, pos_s].set(k_skd.astype(cache["k"].dtype))
      cv = cache["v"].at[li, rows, pos_s].set(v_skd.astype(cache["v"].dtype))
      if kernel_attention:  # reads each row's entries [0, pos] in place
        out = _cpu_decode.attention(q_shd.reshape(s, h_heads * d), ck, cv, li, pos_s)
      else:  # the layer's first attend_len entries
        keys = jax.lax.dynamic_slice_in_dim(ck[li], 0, attend_len, axis=1).astype(dt)  # [S,A,K,D]
        vals = jax.lax.dynamic_slice_in_dim(cv[li], 0, attend_len, axis=1).astype(dt)
        out = _layers.attend(_layers.grouped(q_shd, k_heads), keys, vals, mask_sa)
      return out.reshape(s, h_heads, d), {"k": ck, "v": cv}

    mm = _layers.Dots(dt) if weights_t is None else _KernelDots(cfg, weights_t, li)
    out = _layers.layer(
      cfg, p, x_sd, pos_s, attention, mm, layer_index=li, routes=routes_sk, return_routes=return_routes
    )
    return out[:2], (out[2] if return_routes else None)

  routes_lsk = None if routes_ssk is None else _moe.routes_per_layer(cfg, routes_ssk)
  if page_table is None:
    xs = (layer_xs, jnp.arange(cfg.num_layers, dtype=jnp.int32), routes_lsk)
    (x_sd, cache), experts_lsk = jax.lax.scan(layer, (x_sd, cache), xs)
  else:  # per-layer pools, layers unrolled: every write in place (aepo_jax/rollout/_pages.py)
    new, experts = {"k": [], "v": []}, []
    for li in range(cfg.num_layers):
      xs = (jax.tree.map(lambda x: x[li], layer_xs), jnp.int32(li), None if routes_lsk is None else routes_lsk[li])
      (x_sd, c), e = layer((x_sd, {"k": cache["k"][li], "v": cache["v"][li]}), xs)
      new["k"].append(c["k"])
      new["v"].append(c["v"])
      experts.append(e)
    cache = {n: tuple(c) for n, c in new.items()}
    experts_lsk = jnp.stack(experts) if return_routes else None
  h_sd = _layers.rms_norm(x_sd, params["norm"]["scale"], cfg.rms_norm_eps, dt)
  if return_hidden:
    out = h_sd
  elif weights_t is not None:
    head = weights_t["head"] if "head" in weights_t else params["embed_tokens"]["embedding"]
    out = _cpu_decode.matmul_t(h_sd, head.astype(jnp.float32), jnp.int32(0))
  else:
    out = _layers.unembed(cfg, params, h_sd)
  return (out, cache, _moe.sparse_routes(cfg, experts_lsk)) if return_routes else (out, cache)
