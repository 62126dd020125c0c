"""The decoder's layer definition (Llama / Qwen2 / Qwen3 / Qwen3-MoE): its parameter layout and its math as pure
functions.

One definition serves every caller: the Flax modules of `_decoder` (training, scoring, prefill into the KV cache)
declare their parameters from `layer_spec` and run `layer`, and the engine's decode step (`_decode`) runs the same
`layer` on the same parameters. What differs between callers is passed in, not copied:
  * the attention over keys and values (`layer`'s `attention(q, k, v) -> (out, aux)`): full-sequence attention
    (XLA, the CPU or splash kernel) with an optional per-row cache write, or the decode step's scatter into the
    (dense or paged) KV cache and attention over its first `attend_len` entries;
  * the weight products (a matmul backend: `Dots`, XLA dots on the stored parameters, or `_decode`'s kernel
    backend, the CPU small-M kernel on `decode_weights`): `qkv(p_attn, x)`, `out(p_attn, o)`,
    `gate_up(p_mlp, x)`, `down(p_mlp, h)`.
Activations have any leading axes ([B, T, ...] in the modules, [S, ...] in decode); heads are the axis before the
last. Parameters are the stored nested dicts (`self_attn`, `mlp`, the norms), stacked layers sliced to one.

Qwen3-MoE: a sparse layer's `mlp` is the expert block of `_moe` (router `gate`, stacked `experts`), run on XLA ops
whatever the matmul backend. Layers are stacked, so a model with both kinds (`mlp_only_layers`,
`decoder_sparse_step`) stores both blocks in every layer (what a checkpoint lacks is read as zeros) and `layer`
runs the one its index names.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from aepo_jax.model import _moe
from aepo_jax.model._config import ModelConfig
from aepo_jax.parallel import constrain

# Logical axes of activations (mapped to the mesh by the rules table while a step is traced in
# `parallel.sharding_context`): rows over the batch axes, heads and the MLP's hidden units over 'tensor'.
BTD = ("activation_batch", "activation_length", "activation_embed")
BTHD = ("activation_batch", "activation_length", "activation_heads", None)
BTKD = ("activation_batch", "activation_length", "activation_kv_heads", None)
NF = ("activation_batch", "activation_mlp")

NEG_INF = -1e30  # finite, so a query row with no valid key gives a uniform softmax, never NaN


# ----------------------------------------------------------------------------------------------------
# Parameter layout
# ----------------------------------------------------------------------------------------------------
def layer_spec(config: ModelConfig) -> tuple:
  """One layer's parameters: a tuple of entries `(name, shape, logical axes, init)` (init 'normal' (0.02),
  'ones' or 'zeros') for a parameter and `(name, entries)` for a group. The names are the HF checkpoint's."""
  d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim

  def proj(heads, axis):
    entries = (("kernel", (d, heads, hd), ("embed", axis, "head_dim"), "normal"),)
    if config.attention_bias:  # Qwen2
      entries += (("bias", (heads, hd), (axis, "head_dim"), "zeros"),)
    return entries

  def norm(n, axis):
    return (("scale", (n,), (axis,), "ones"),)

  attn = (
    ("q_proj", proj(config.num_heads, "heads")),
    ("k_proj", proj(config.num_kv_heads, "kv_heads")),
    ("v_proj", proj(config.num_kv_heads, "kv_heads")),
    ("o_proj", (("kernel", (config.num_heads, hd, d), ("heads", "head_dim", "embed"), "normal"),)),
  )
  if config.qk_norm:  # Qwen3
    attn += (("q_norm", norm(hd, "head_dim")), ("k_norm", norm(hd, "head_dim")))
  mlp = ()
  if config.has_dense_mlp:
    mlp += (
      ("gate_proj", (("kernel", (d, f), ("embed", "mlp"), "normal"),)),
      ("up_proj", (("kernel", (d, f), ("embed", "mlp"), "normal"),)),
      ("down_proj", (("kernel", (f, d), ("mlp", "embed"), "normal"),)),
    )
  if config.has_experts:  # Qwen3-MoE
    mlp += _moe.moe_spec(config)
  return (
    ("input_layernorm", norm(d, "embed")),
    ("self_attn", attn),
    ("post_attention_layernorm", norm(d, "embed")),
    ("mlp", mlp),
  )


# ----------------------------------------------------------------------------------------------------
# Pieces
# ----------------------------------------------------------------------------------------------------
def rms_norm(x, scale, eps: float, dtype):
  """RMSNorm over the last axis, in float32, cast to `dtype`."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(dtype)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
  """Inverse frequencies [head_dim/2] with the checkpoint's rope_theta and rope scaling (HF semantics)."""
  d = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
  scaling = config.rope_scaling_dict
  if not scaling:
    return inv_freq.astype(np.float32)
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return inv_freq.astype(np.float32)
  if kind == "linear":
    return (inv_freq / scaling["factor"]).astype(np.float32)
  if kind == "llama3":  # transformers' _compute_llama3_parameters
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    out = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, out).astype(np.float32)
  raise NotImplementedError(
    f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3). "
    "Remove rope_scaling from config.json or add the type to aepo_jax/model/_layers.py:rope_inv_freq."
  )


def apply_rope(x, positions, inv_freq):
  """HF 'rotate_half' RoPE (non-interleaved halves) of x [..., N, hd] at positions [...]; cos/sin in float32."""
  freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  cos = jnp.cos(emb)[..., None, :].astype(x.dtype)
  sin = jnp.sin(emb)[..., None, :].astype(x.dtype)
  x1, x2 = jnp.split(x, 2, axis=-1)
  return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def scores(q_btkgd, k_bskd, mask_bts):
  """Masked float32 attention logits [B, K, G, T, S] of grouped query heads q [B, T, K, G, D] against k [B, S, K, D]
  (mask [B, T, S]); without the query axis (one query per row: q [B, K, G, D], mask [B, S]) [B, K, G, S]."""
  t = "t" if q_btkgd.ndim == 5 else ""
  logits = jnp.einsum(f"b{t}kgd,bskd->bkg{t}s", q_btkgd, k_bskd).astype(jnp.float32) / math.sqrt(q_btkgd.shape[-1])
  return jnp.where(mask_bts[:, None, None], logits, NEG_INF)


def attend(q_btkgd, k_bskd, v_bskd, mask_bts):
  """softmax(q·k / sqrt(d), masked) · v with grouped query heads: [B,T,K,G,D] x [B,S,K,D] -> [B,T,K,G,D] (or without
  the query axis, as in `scores`: XLA:CPU lays a unit query axis out with transposes around the dots)."""
  t = "t" if q_btkgd.ndim == 5 else ""
  probs = jax.nn.softmax(scores(q_btkgd, k_bskd, mask_bts), axis=-1).astype(q_btkgd.dtype)
  return jnp.einsum(f"bkg{t}s,bskd->b{t}kgd", probs, v_bskd)


def grouped(q_bthd, kv_heads: int):
  """q [..., H, D] -> [..., K, H / K, D]: query head h reads KV head h // (H / K)."""
  *lead, h, d = q_bthd.shape
  return q_bthd.reshape(*lead, kv_heads, h // kv_heads, d)


def swiglu(gate, up):
  """The SwiGLU activation of the MLP's hidden units."""
  return jax.nn.silu(gate) * up


class Dots:
  """The weight products as XLA dots on the stored parameters, in the compute dtype `dtype`.

  `shard` (the Flax modules: [B, T, ...] activations): the projections as einsums over the stored kernel shapes,
  constrained to their logical activation axes (under a `parallel.sharding_context`; none: unchanged). Otherwise
  (decode: [S, ...] activations) q/k/v are the same einsums unconstrained, and o_proj a 2-D dot on the kernel
  flattened over heads: for the 3-axis einsum at one row per slot XLA:CPU copies the o_proj kernel transposed, every
  layer and step. The q/k/v kernels are never flattened: on TPU a chip's [D, heads, head_dim] with a head count that
  is no multiple of the tile (10 of Qwen3-14B's 40 over tensor 4) is laid out heads-major, and flattening it made
  XLA:TPU copy the whole stacked q_proj to another layout on every decode call (tests/model/test_paged_tpu.py)."""

  def __init__(self, dtype, shard: bool = False):
    self.dtype, self.shard = jnp.dtype(dtype), shard

  def qkv(self, p, x):
    dt = self.dtype
    x = x.astype(dt)
    out = []
    for n, axes in (("q_proj", BTHD), ("k_proj", BTKD), ("v_proj", BTKD)):
      w = p[n]["kernel"].astype(dt)  # [D, N, hd]
      y = jnp.einsum("...d,dnh->...nh", x, w)
      out.append(constrain(y, axes) if self.shard else y)
    return tuple(out)

  def out(self, p, o):
    dt = self.dtype
    w = p["o_proj"]["kernel"].astype(dt)  # [H, hd, D]
    if self.shard:
      return jnp.einsum("...nh,nhd->...d", o.astype(dt), w)
    return o.reshape(*o.shape[:-2], -1).astype(dt) @ w.reshape(-1, w.shape[-1])

  def gate_up(self, p, x):
    ys = (x @ p[n]["kernel"].astype(self.dtype) for n in ("gate_proj", "up_proj"))
    return tuple(constrain(y, NF) if self.shard else y for y in ys)

  def down(self, p, h):
    return h @ p["down_proj"]["kernel"].astype(self.dtype)


def attention_inputs(config: ModelConfig, p, x, positions, mm):
  """Queries [..., H, hd], keys and values [..., K, hd] of the normed activations x [..., D] at `positions`:
  projections, q/k/v biases (Qwen2), q/k RMSNorm over head_dim (Qwen3), RoPE on q and k."""
  dt = jnp.dtype(config.dtype)
  q, k, v = mm.qkv(p, x)
  if config.attention_bias:
    q, k, v = (t + p[n]["bias"].astype(dt) for t, n in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")))
  if config.qk_norm:
    q = rms_norm(q, p["q_norm"]["scale"], config.rms_norm_eps, dt)
    k = rms_norm(k, p["k_norm"]["scale"], config.rms_norm_eps, dt)
  inv_freq = rope_inv_freq(config)
  return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def mlp(p, x, mm):
  """The SwiGLU MLP: down(silu(gate(x)) * up(x))."""
  return mm.down(p, swiglu(*mm.gate_up(p, x)))


def feed_forward(
  config: ModelConfig,
  p,
  x,
  mm,
  mlp_fn=mlp,
  layer_index=None,
  *,
  routes=None,
  return_routes: bool = False,
  token_weights=None,
):
  """The layer's MLP on the normed x: the dense `mlp_fn`, the sparse expert block (`_moe.moe`), or, in a model
  with both kinds, the one `config.moe_layers[layer_index]` names (`layer_index` a traced int32).

  routes [..., k]: the experts a sparse layer replays (`_moe.route`); a dense layer ignores them. return_routes
  (a model with experts): also returns the experts used [..., k] int32 (-1 in a dense layer). token_weights [...]
  (a model with experts): also returns the router's balance statistics [2, E] (`_balance.router_stats`; 0 in a dense
  layer). Returns y, or (y, experts if return_routes, statistics if token_weights)."""
  if not config.has_experts:
    return mlp_fn(p, x, mm)
  moe = functools.partial(
    _moe.moe, config, p, x, routes=routes, return_routes=return_routes, token_weights=token_weights
  )
  if not config.has_dense_mlp:
    return moe()
  if layer_index is None:
    raise ValueError("feed_forward: a model with dense and sparse layers needs the layer index.")

  def dense():
    y = mlp_fn(p, x, mm)
    extras = (jnp.full((*x.shape[:-1], config.num_experts_per_tok), -1, jnp.int32),) if return_routes else ()
    if token_weights is not None:
      extras += (jnp.zeros((2, config.num_experts), jnp.float32),)
    return (y, *extras) if extras else y

  return jax.lax.cond(jnp.asarray(config.moe_layers)[layer_index], moe, dense)


def layer(
  config: ModelConfig,
  p,
  x,
  positions,
  attention,
  mm,
  mlp_fn=mlp,
  layer_index=None,
  *,
  routes=None,
  return_routes: bool = False,
  token_weights=None,
):
  """One pre-norm decoder layer on x [..., D]: x + o(attention(q, k, v)) of the normed x, then x + mlp(norm(x)).

  attention(q [..., H, hd], k, v [..., K, hd]) -> (out [..., H, hd], aux): the caller's attention and KV cache;
  mlp_fn(p_mlp, x, mm) (default `mlp`; the modules pass the same forward with a backward rule for training);
  layer_index: this layer's index (needed only by a model with both dense and sparse layers, `feed_forward`);
  routes / return_routes / token_weights: the experts to replay / to return, the router statistics to return, see
  `feed_forward`. Returns (x, aux), or (x, aux, experts [..., k] if return_routes, statistics if token_weights)."""
  eps, dt = config.rms_norm_eps, jnp.dtype(config.dtype)
  a = p["self_attn"]
  q, k, v = attention_inputs(config, a, rms_norm(x, p["input_layernorm"]["scale"], eps, dt), positions, mm)
  out, aux = attention(q, k, v)
  x = x + mm.out(a, out)
  h = rms_norm(x, p["post_attention_layernorm"]["scale"], eps, dt)
  y = feed_forward(
    config,
    p["mlp"],
    h,
    mm,
    mlp_fn,
    layer_index,
    routes=routes,
    return_routes=return_routes,
    token_weights=token_weights,
  )
  if isinstance(y, tuple):
    y, *extras = y
    return (x + y, aux, *extras)
  return x + y, aux


def embed(embedding, tokens, dtype):
  """Token embeddings in the compute dtype."""
  return jnp.take(embedding, tokens, axis=0).astype(dtype)


def unembed(config: ModelConfig, params, h):
  """Float32 logits of the final-norm hidden states: the tied embedding or the untied lm_head."""
  dt = jnp.dtype(config.dtype)
  h = h.astype(dt)
  if config.tie_word_embeddings:
    logits = h @ params["embed_tokens"]["embedding"].astype(dt).T
  else:
    logits = h @ params["lm_head"]["kernel"].astype(dt)
  return logits.astype(jnp.float32)
