"""A one-token-per-row decoder forward specialised for the engine's decode step.

Same math as `aepo_jax.model.forward_cached` with T = 1 (tested equal), arranged for memory traffic, which is
what bounds decode at small batch:
  * the KV cache rides in the carry of the layer scan and each layer writes its new entries with a scatter, so
    XLA updates the (donated) cache in place instead of stacking a new cache per step;
  * attention reads only the first `attend_len` cache entries (a static bucket >= every active row's length),
    not the whole max_len.
The mask depends only on the positions, so it is built once per step, outside the layer loop.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from aepo_jax.model._decoder import apply_rope, rope_inv_freq  # TODO(model): export these publicly

_NEG_INF = -1e30


def _rms(x, scale, eps, dt):
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(dt)


def _dense(x, kernel, dt, spec):
  return jnp.einsum(spec, x, kernel.astype(dt))


def decode_forward(config, params, token_s, pos_s, cache, attend_len: int, *, return_hidden: bool = False):
  """token_s [S] at positions pos_s [S] (also their cache index). Returns (logits [S,V] float32, new cache)."""
  cfg = config
  dt = jnp.dtype(cfg.dtype)
  s = token_s.shape[0]
  h_heads, k_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  g = h_heads // k_heads
  rows = jnp.arange(s)
  inv_freq = rope_inv_freq(cfg)
  mask_sa = jnp.arange(attend_len)[None, :] <= pos_s[:, None]
  pos_s1 = pos_s[:, None]

  x_sd = params["embed_tokens"]["embedding"][token_s].astype(dt)

  def layer(carry, xs):
    x_sd, cache = carry
    p, li = xs
    a = p["self_attn"]
    hn = _rms(x_sd, p["input_layernorm"]["scale"], cfg.rms_norm_eps, dt)[:, None]  # [S,1,D]
    q = _dense(hn, a["q_proj"]["kernel"], dt, "btd,dnh->btnh")
    k = _dense(hn, a["k_proj"]["kernel"], dt, "btd,dnh->btnh")
    v = _dense(hn, a["v_proj"]["kernel"], dt, "btd,dnh->btnh")
    if cfg.attention_bias:
      q, k, v = (t + a[n]["bias"].astype(dt) for t, n in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")))
    if cfg.qk_norm:
      q = _rms(q, a["q_norm"]["scale"], cfg.rms_norm_eps, dt)
      k = _rms(k, a["k_norm"]["scale"], cfg.rms_norm_eps, dt)
    q = apply_rope(q, pos_s1, inv_freq)[:, 0]  # [S,H,D]
    k = apply_rope(k, pos_s1, inv_freq)[:, 0]  # [S,K,D]
    v = v[:, 0]
    ck = cache["k"].at[li, rows, pos_s].set(k.astype(cache["k"].dtype))
    cv = cache["v"].at[li, rows, pos_s].set(v.astype(cache["v"].dtype))
    keys = jax.lax.dynamic_slice_in_dim(ck[li], 0, attend_len, axis=1).astype(dt)  # [S,A,K,D]
    vals = jax.lax.dynamic_slice_in_dim(cv[li], 0, attend_len, axis=1).astype(dt)
    q_skgd = q.reshape(s, k_heads, g, d)
    logits = jnp.einsum("skgd,sakd->skga", q_skgd, keys).astype(jnp.float32) / math.sqrt(d)
    logits = jnp.where(mask_sa[:, None, None, :], logits, _NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1).astype(dt)
    out = jnp.einsum("skga,sakd->skgd", probs, vals).reshape(s, h_heads, d)
    x_sd = x_sd + jnp.einsum("snh,nhd->sd", out, a["o_proj"]["kernel"].astype(dt))
    m = p["mlp"]
    hn = _rms(x_sd, p["post_attention_layernorm"]["scale"], cfg.rms_norm_eps, dt)
    gate = hn @ m["gate_proj"]["kernel"].astype(dt)
    up = hn @ m["up_proj"]["kernel"].astype(dt)
    x_sd = x_sd + (jax.nn.silu(gate) * up) @ m["down_proj"]["kernel"].astype(dt)
    return (x_sd, {"k": ck, "v": cv}), None

  (x_sd, cache), _ = jax.lax.scan(layer, (x_sd, cache), (params["layers"], jnp.arange(cfg.num_layers)))
  h_sd = _rms(x_sd, params["norm"]["scale"], cfg.rms_norm_eps, dt)
  if return_hidden:
    return h_sd, cache
  if cfg.tie_word_embeddings:
    logits = h_sd @ params["embed_tokens"]["embedding"].astype(dt).T
  else:
    logits = h_sd @ params["lm_head"]["kernel"].astype(dt)
  return logits.astype(jnp.float32), cache
