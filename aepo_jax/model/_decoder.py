"""The Flax decoder for Llama / Qwen2 / Qwen3, with an explicit per-row KV cache.

Parameters carry logical axis names (`embed`, `mlp`, `heads`, `kv_heads`, `head_dim`, `vocab`, `layers`);
`aepo_jax.parallel` maps them onto the mesh. Layers are stacked with `nn.scan` (one compiled layer body,
parameters with a leading `layers` axis), which keeps compile time flat in depth.

Two call modes share the same layer code:
  * full sequence (training, scoring): `attention_mask_bt` marks valid tokens, attention is causal over
    the row's token index, positions are explicit per row (left or right padding both work);
  * cached (rollout engine): `cache` holds K/V rows of shape [L, S, T_max, K, D]; row b writes its T new
    entries at its own offset `write_index_b[b]` and attends to cache entries j <= write_index_b[b] + t.
    Flax's built-in decode cache has one index for the whole batch, hence this layer keeps its own.

Differentiated (training) calls go through two custom backward rules, `_attend_recompute` (probabilities recomputed,
not stored per layer) and `_swiglu` (weight gradients from row-major activations); their gradients are checked
against transformers' autograd in tests/model/test_grad_parity.py, the reasons and timings are in
docs/performance.md. With `attention_impl='cpu_kernel'` (float32, one CPU device; selected by the
training steps) full-sequence attention runs through the C++ kernel of `_cpu_attention` instead, with 'splash'
(selected on TPU) through JAX's Pallas splash-attention kernel (`_splash`), which takes the [B, T] segment ids of
`_splash.segment_ids` where the other paths take the [B, T, S] mask.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from aepo_jax.model import _cpu_attention, _splash
from aepo_jax.model._config import ModelConfig
from aepo_jax.parallel import constrain

# Logical axes of activations (mapped to the mesh by the rules table while a step is traced in
# `parallel.sharding_context`): rows over the batch axes, heads and the MLP's hidden units over 'tensor'.
_BTD = ("activation_batch", "activation_length", "activation_embed")
_BTHD = ("activation_batch", "activation_length", "activation_heads", None)
_BTKD = ("activation_batch", "activation_length", "activation_kv_heads", None)

_NEG_INF = -1e30  # finite, so a query row with no valid key gives a uniform softmax, never NaN


def _dtype(name: str):
  return jnp.dtype(name)


def _param(init, axes):
  return nn.with_logical_partitioning(init, axes)


# ----------------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------------
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
    "Remove rope_scaling from config.json or add the type to aepo_jax/model/_decoder.py:rope_inv_freq."
  )


def apply_rope(x_btnd, positions_bt, inv_freq):
  """HF 'rotate_half' RoPE (non-interleaved halves); cos/sin in float32."""
  freqs_btf = positions_bt[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)[None, None, :]
  emb_btd = jnp.concatenate([freqs_btf, freqs_btf], axis=-1)
  cos = jnp.cos(emb_btd)[:, :, None, :].astype(x_btnd.dtype)
  sin = jnp.sin(emb_btd)[:, :, None, :].astype(x_btnd.dtype)
  x1, x2 = jnp.split(x_btnd, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x_btnd * cos + rotated * sin


# ----------------------------------------------------------------------------------------------------
# Attention core
# ----------------------------------------------------------------------------------------------------
def _scores(q_btkgd, k_bskd, mask_bts):
  logits = jnp.einsum("btkgd,bskd->bkgts", q_btkgd, k_bskd).astype(jnp.float32) / math.sqrt(q_btkgd.shape[-1])
  return jnp.where(mask_bts[:, None, None, :, :], logits, _NEG_INF)


def _attend(q_btkgd, k_bskd, v_bskd, mask_bts):
  """softmax(q·k / sqrt(d), masked) · v with grouped query heads: [B,T,K,G,D] x [B,S,K,D] -> [B,T,K,G,D]."""
  probs = jax.nn.softmax(_scores(q_btkgd, k_bskd, mask_bts), axis=-1).astype(q_btkgd.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", probs, v_bskd)


@jax.custom_vjp
def _attend_recompute(q_btkgd, k_bskd, v_bskd, mask_bts):
  """`_attend` whose backward recomputes the probabilities from q, k and the saved row max and sum.

  Autodiff would keep the [B, K, G, T, S] probabilities of every layer for the backward (in a scanned stack,
  one [L, B, K, G, T, S] buffer: 566 MB for SmolLM2 at 8 x 256); this keeps [B, K, G, T] statistics instead and
  pays one more q·k product per layer in the backward. Same forward values as `_attend`."""
  return _attend(q_btkgd, k_bskd, v_bskd, mask_bts)


def _attend_fwd(q_btkgd, k_bskd, v_bskd, mask_bts):
  s = _scores(q_btkgd, k_bskd, mask_bts)
  m = jnp.max(s, axis=-1, keepdims=True)
  e = jnp.exp(s - m)
  l = jnp.sum(e, axis=-1, keepdims=True)
  out = jnp.einsum("bkgts,bskd->btkgd", (e / l).astype(q_btkgd.dtype), v_bskd)
  return out, (q_btkgd, k_bskd, v_bskd, mask_bts, out, m, l)


def _attend_bwd(res, dout_btkgd):
  q, k, v, mask, out, m, l = res
  dt = q.dtype
  p = jnp.exp(_scores(q, k, mask) - m) / l  # float32, exactly the forward's probabilities
  dv = jnp.einsum("bkgts,btkgd->bskd", p.astype(dt), dout_btkgd)
  dp = jnp.einsum("btkgd,bskd->bkgts", dout_btkgd, v).astype(jnp.float32)
  delta = jnp.einsum("btkgd,btkgd->bkgt", dout_btkgd.astype(jnp.float32), out.astype(jnp.float32))
  ds = p * (dp - delta[..., None]) / math.sqrt(q.shape[-1])
  # masked scores are constants (their gradient is 0), which matters for a row with no valid key (uniform p)
  ds = jnp.where(mask[:, None, None, :, :], ds, 0.0).astype(dt)
  dq = jnp.einsum("bkgts,bskd->btkgd", ds, k)
  dk = jnp.einsum("bkgts,btkgd->bskd", ds, q)
  return dq, dk, dv, None


_attend_recompute.defvjp(_attend_fwd, _attend_bwd)


# ----------------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
  eps: float
  dtype: str
  param_dtype: str
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x):
    scale = self.param(
      "scale", _param(nn.initializers.ones, (self.axis_name,)), (x.shape[-1],), _dtype(self.param_dtype)
    )
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * scale.astype(jnp.float32)).astype(_dtype(self.dtype))


class Einsum(nn.Module):
  """A projection `y = einsum(spec, x, kernel) (+ bias)` whose kernel is created in its final (multi-axis) shape.

  Replaces `nn.DenseGeneral`, which creates a flattened 2-D kernel and then fails when a 3-axis logical
  constraint is attached under `nn.logical_axis_rules` (flax 0.12). Parameter names stay 'kernel'/'bias'.
  """

  spec: str
  kernel_shape: tuple
  kernel_axes: tuple
  bias_axes: Optional[tuple] = None  # None: no bias
  dtype: str = "float32"
  param_dtype: str = "float32"

  @nn.compact
  def __call__(self, x):
    kernel = self.param(
      "kernel", _param(nn.initializers.normal(0.02), self.kernel_axes), self.kernel_shape, _dtype(self.param_dtype)
    )
    y = jnp.einsum(self.spec, x.astype(_dtype(self.dtype)), kernel.astype(_dtype(self.dtype)))
    if self.bias_axes is not None:
      bias_shape = self.kernel_shape[len(self.kernel_shape) - len(self.bias_axes) :]
      bias = self.param("bias", _param(nn.initializers.zeros, self.bias_axes), bias_shape, _dtype(self.param_dtype))
      y = y + bias.astype(_dtype(self.dtype))
    return y


class Attention(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x_btd, positions_bt, mask_bts, layer_cache, write_index_b):
    cfg = self.config
    dt = _dtype(cfg.dtype)
    h, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def proj(name, heads, axis):
      return Einsum(
        "btd,dnh->btnh",
        (cfg.hidden_size, heads, d),
        ("embed", axis, "head_dim"),
        (axis, "head_dim") if cfg.attention_bias else None,
        cfg.dtype,
        cfg.param_dtype,
        name=name,
      )

    q_btnd = constrain(proj("q_proj", h, "heads")(x_btd), _BTHD)
    k_btkd = constrain(proj("k_proj", k, "kv_heads")(x_btd), _BTKD)
    v_btkd = constrain(proj("v_proj", k, "kv_heads")(x_btd), _BTKD)
    if cfg.qk_norm:
      q_btnd = RMSNorm(cfg.rms_norm_eps, cfg.dtype, cfg.param_dtype, "head_dim", name="q_norm")(q_btnd)
      k_btkd = RMSNorm(cfg.rms_norm_eps, cfg.dtype, cfg.param_dtype, "head_dim", name="k_norm")(k_btkd)
    inv_freq = rope_inv_freq(cfg)
    q_btnd = apply_rope(q_btnd, positions_bt, inv_freq)
    k_btkd = apply_rope(k_btkd, positions_bt, inv_freq)

    new_cache = None
    if layer_cache is not None:
      # Each row writes its T new entries at its own offset. Callers guarantee offset + T <= T_max
      # (dynamic_update_slice would otherwise clamp the start and overwrite earlier entries).
      write = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice(c, u.astype(c.dtype), (i, 0, 0)))
      k_cache = write(layer_cache["k"], k_btkd, write_index_b)
      v_cache = write(layer_cache["v"], v_btkd, write_index_b)
      new_cache = {"k": k_cache, "v": v_cache}
      k_bskd, v_bskd = k_cache.astype(dt), v_cache.astype(dt)
    else:
      k_bskd, v_bskd = k_btkd, v_btkd

    b, t = x_btd.shape[:2]
    if layer_cache is None and cfg.attention_impl == "cpu_kernel":
      out_btnd = _cpu_attention.attention(q_btnd, k_bskd, v_bskd, mask_bts)
    elif layer_cache is None and cfg.attention_impl == "splash":
      # mask_bts is the [B, T] segment ids here (`_splash.segment_ids`): the kernel builds the mask block by block
      out_btnd = _splash.attention(q_btnd, k_bskd, v_bskd, mask_bts, cfg)
    else:
      q_btkgd = q_btnd.reshape(b, t, k, h // k, d)
      # Cached calls (engine) are never differentiated; full-sequence calls may be (training).
      attend = _attend if layer_cache is not None else _attend_recompute
      out_btnd = attend(q_btkgd, k_bskd, v_bskd, mask_bts).reshape(b, t, h, d)
    out_btnd = constrain(out_btnd, _BTHD)
    out = Einsum(
      "btnh,nhd->btd",
      (h, d, cfg.hidden_size),
      ("heads", "head_dim", "embed"),
      None,
      cfg.dtype,
      cfg.param_dtype,
      name="o_proj",
    )(out_btnd)
    return out, new_cache


class _Kernel(nn.Module):
  """A bare 'kernel' parameter (the name and shape `nn.Dense` gives it), for layers that do their own matmuls."""

  shape: tuple
  axes: tuple
  param_dtype: str

  @nn.compact
  def __call__(self):
    return self.param("kernel", _param(nn.initializers.normal(0.02), self.axes), self.shape, _dtype(self.param_dtype))


def _t(x):
  """x.T; on CPU written out (an optimization barrier keeps XLA from folding it into the dot): XLA:CPU runs
  `a.T @ b` on Eigen and `a @ b.T` at about half the speed of `a @ b`, and the operands transposed here are the
  small ones ([N, D] activations, [D, F] weights), never the [N, F] MLP activations."""
  if jax.default_backend() != "cpu":
    return x.T
  return jax.lax.optimization_barrier(x.T)


@jax.custom_vjp
def _swiglu(x_nd, wg_df, wu_df, wd_fd):
  """down(silu(x·Wg) * (x·Wu)) on [N, D] rows, with a backward written for CPU dots (`_t`): the weight gradients
  are `x.T @ dG` and `(dY.T @ H).T`, so the [N, F] activations are read row-major. Residuals: x, x·Wg, x·Wu."""
  return (jax.nn.silu(_hidden(x_nd @ wg_df)) * _hidden(x_nd @ wu_df)) @ wd_fd


def _hidden(h_nf):
  """The MLP's [rows, hidden] activations: rows over the batch axes, hidden units over 'tensor'."""
  return constrain(h_nf, ("activation_batch", "activation_mlp"))


def _swiglu_fwd(x_nd, wg_df, wu_df, wd_fd):
  g, u = _hidden(x_nd @ wg_df), _hidden(x_nd @ wu_df)
  return (jax.nn.silu(g) * u) @ wd_fd, (x_nd, g, u, wg_df, wu_df, wd_fd)


def _swiglu_bwd(res, dy_nd):
  x, g, u, wg, wu, wd = res
  sig = jax.nn.sigmoid(g)
  silu = g * sig
  dh = _hidden(dy_nd @ _t(wd))
  dg = dh * u * (sig * (1 + g * (1 - sig)))
  du = dh * silu
  x_t = _t(x)
  dwd = _t(_t(dy_nd) @ (silu * u))
  return dg @ _t(wg) + du @ _t(wu), x_t @ dg, x_t @ du, dwd


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class MLP(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x_btd):
    cfg = self.config
    dt = _dtype(cfg.dtype)
    b, t, d = x_btd.shape
    f = cfg.intermediate_size
    wg = _Kernel((d, f), ("embed", "mlp"), cfg.param_dtype, name="gate_proj")()
    wu = _Kernel((d, f), ("embed", "mlp"), cfg.param_dtype, name="up_proj")()
    wd = _Kernel((f, d), ("mlp", "embed"), cfg.param_dtype, name="down_proj")()
    # Rows flattened: each weight gradient then contracts one token axis (with [B, T] XLA:CPU wrote the SiLU
    # backward transposed, [F, B*T], for its weight-gradient dots: ~2 s of a SmolLM2 8 x 256 step).
    y_nd = _swiglu(x_btd.reshape(b * t, d).astype(dt), wg.astype(dt), wu.astype(dt), wd.astype(dt))
    return constrain(y_nd.reshape(b, t, d), _BTD)


class Block(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, h_btd, layer_cache, positions_bt, mask_bts, write_index_b):
    cfg = self.config
    norm = functools.partial(RMSNorm, cfg.rms_norm_eps, cfg.dtype, cfg.param_dtype)
    attn, new_cache = Attention(cfg, name="self_attn")(
      norm(name="input_layernorm")(h_btd), positions_bt, mask_bts, layer_cache, write_index_b
    )
    h_btd = h_btd + attn
    h_btd = h_btd + MLP(cfg, name="mlp")(norm(name="post_attention_layernorm")(h_btd))
    h_btd = constrain(h_btd, _BTD)
    return h_btd, new_cache


class Decoder(nn.Module):
  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.embed_tokens = nn.Embed(
      cfg.vocab_size,
      cfg.hidden_size,
      dtype=_dtype(cfg.dtype),
      param_dtype=_dtype(cfg.param_dtype),
      embedding_init=_param(nn.initializers.normal(0.02), ("vocab", "embed")),
    )
    block = Block
    if cfg.remat:
      block = nn.remat(Block, prevent_cse=False, policy=jax.checkpoint_policies.nothing_saveable)
    self.layers = nn.scan(
      block,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
      out_axes=0,
      length=cfg.num_layers,
      unroll=min(cfg.scan_unroll, cfg.num_layers),
      metadata_params={nn.PARTITION_NAME: "layers"},
    )(cfg)
    self.norm = RMSNorm(cfg.rms_norm_eps, cfg.dtype, cfg.param_dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = nn.Dense(
        cfg.vocab_size,
        use_bias=False,
        dtype=_dtype(cfg.dtype),
        param_dtype=_dtype(cfg.param_dtype),
        kernel_init=_param(nn.initializers.normal(0.02), ("embed", "vocab")),
      )

  def __call__(self, tokens_bt, positions_bt, mask_bts, cache=None, write_index_b=None):
    """Returns (final hidden states [B,T,D] after the last norm, new cache or None)."""
    h_btd = self.embed_tokens(tokens_bt)
    h_btd = constrain(h_btd, _BTD)
    h_btd, new_cache = self.layers(h_btd, cache, positions_bt, mask_bts, write_index_b)
    return self.norm(h_btd), new_cache

  def unembed(self, h_btd):
    if self.config.tie_word_embeddings:
      logits = self.embed_tokens.attend(h_btd)
    else:
      logits = self.lm_head(h_btd)
    return logits.astype(jnp.float32)

  def init_all(self, tokens_bt, positions_bt, mask_bts):
    h, _ = self(tokens_bt, positions_bt, mask_bts)
    return self.unembed(h)
