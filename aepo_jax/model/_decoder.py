"""The Flax decoder for Llama / Qwen2 / Qwen3 / Qwen3-MoE, with an explicit per-row KV cache.

The modules declare the parameters and run the layer definition of `_layers` (`layer_spec`, `layer`), the same
definition the engine's decode step (`_decode`) runs; what is specific here is the full-sequence and cached
attention, the sharding constraints of the activations and the backward rules of training.

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

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from aepo_jax.model import _cpu_attention, _layers, _moe, _splash
from aepo_jax.model._config import ModelConfig
from aepo_jax.model._layers import BTD as _BTD
from aepo_jax.model._layers import BTHD as _BTHD
from aepo_jax.model._layers import apply_rope, rope_inv_freq  # noqa: F401 (re-exported)
from aepo_jax.parallel import constrain

_attend = _layers.attend
_scores = _layers.scores
_INITS = {"normal": nn.initializers.normal(0.02), "ones": nn.initializers.ones, "zeros": nn.initializers.zeros}


def _dtype(name: str):
  return jnp.dtype(name)


def _param(init, axes):
  return nn.with_logical_partitioning(init, axes)


# ----------------------------------------------------------------------------------------------------
# Attention core (training)
# ----------------------------------------------------------------------------------------------------
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


def _attention(cfg: ModelConfig, q_btnd, k_btkd, v_btkd, mask_bts, layer_cache, write_index_b):
  """The modules' attention: over the chunk itself (full sequence) or, with a layer cache, after writing each row's
  T new entries at its offset, over the row's cache. Returns (out [B, T, H, D], new layer cache or None)."""
  dt = _dtype(cfg.dtype)
  b, t, h, d = q_btnd.shape
  k = cfg.num_kv_heads
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
  if layer_cache is None and cfg.attention_impl == "cpu_kernel":
    out_btnd = _cpu_attention.attention(q_btnd, k_bskd, v_bskd, mask_bts)
  elif layer_cache is None and cfg.attention_impl == "splash":
    # mask_bts is the [B, T] segment ids here (`_splash.segment_ids`): the kernel builds the mask block by block
    out_btnd = _splash.attention(q_btnd, k_bskd, v_bskd, mask_bts, cfg)
  else:
    # Cached calls (engine) are never differentiated; full-sequence calls may be (training).
    attend = _attend if layer_cache is not None else _attend_recompute
    out_btnd = attend(_layers.grouped(q_btnd, k), k_bskd, v_bskd, mask_bts).reshape(b, t, h, d)
  return constrain(out_btnd, _BTHD), new_cache


# ----------------------------------------------------------------------------------------------------
# MLP (training): the SwiGLU of `_layers.mlp` with a backward rule for CPU dots
# ----------------------------------------------------------------------------------------------------
def _t(x):
  """x.T; on CPU written out (an optimization barrier keeps XLA from folding it into the dot): XLA:CPU runs
  `a.T @ b` on Eigen and `a @ b.T` at about half the speed of `a @ b`, and the operands transposed here are the
  small ones ([N, D] activations, [D, F] weights), never the [N, F] MLP activations."""
  if jax.default_backend() != "cpu":
    return x.T
  return jax.lax.optimization_barrier(x.T)


def _mlp_params(wg_df, wu_df, wd_fd):
  return {"gate_proj": {"kernel": wg_df}, "up_proj": {"kernel": wu_df}, "down_proj": {"kernel": wd_fd}}


@jax.custom_vjp
def _swiglu(x_nd, wg_df, wu_df, wd_fd):
  """`_layers.mlp` on [N, D] rows (hidden units constrained to their logical axes), with a backward written for CPU
  dots (`_t`): the weight gradients are `x.T @ dG` and `(dY.T @ H).T`, so the [N, F] activations are read
  row-major. Residuals: x, x·Wg, x·Wu."""
  return _layers.mlp(_mlp_params(wg_df, wu_df, wd_fd), x_nd, _layers.Dots(x_nd.dtype, shard=True))


def _swiglu_fwd(x_nd, wg_df, wu_df, wd_fd):
  p, mm = _mlp_params(wg_df, wu_df, wd_fd), _layers.Dots(x_nd.dtype, shard=True)
  g, u = mm.gate_up(p, x_nd)
  return mm.down(p, _layers.swiglu(g, u)), (x_nd, g, u, wg_df, wu_df, wd_fd)


def _swiglu_bwd(res, dy_nd):
  x, g, u, wg, wu, wd = res
  sig = jax.nn.sigmoid(g)
  silu = g * sig
  dh = constrain(dy_nd @ _t(wd), _layers.NF)
  dg = dh * u * (sig * (1 + g * (1 - sig)))
  du = dh * silu
  x_t = _t(x)
  dwd = _t(_t(dy_nd) @ (silu * u))
  return dg @ _t(wg) + du @ _t(wu), x_t @ dg, x_t @ du, dwd


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def _train_mlp(p, x_btd, mm):
  """`_layers.mlp` through `_swiglu`: rows flattened, so each weight gradient contracts one token axis (with [B, T]
  XLA:CPU wrote the SiLU backward transposed, [F, B*T], for its weight-gradient dots: ~2 s of a SmolLM2 8 x 256
  step)."""
  b, t, d = x_btd.shape
  dt = mm.dtype
  w = [p[n]["kernel"].astype(dt) for n in ("gate_proj", "up_proj", "down_proj")]
  y_nd = _swiglu(x_btd.reshape(b * t, d).astype(dt), *w)
  return constrain(y_nd.reshape(b, t, d), _BTD)


# ----------------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------------
class _Params(nn.Module):
  """Declares the parameters of a `_layers.layer_spec` group (nested groups as submodules of their name) and
  returns their values as the nested dict the layer functions take."""

  spec: tuple
  param_dtype: str

  @nn.compact
  def __call__(self):
    out = {}
    for entry in self.spec:
      if len(entry) == 2:
        out[entry[0]] = _Params(entry[1], self.param_dtype, name=entry[0])()
      else:
        name, shape, axes, init = entry
        out[name] = self.param(name, _param(_INITS[init], axes), shape, _dtype(self.param_dtype))
    return out


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
    return _layers.rms_norm(x, scale, self.eps, _dtype(self.dtype))


class _Kernel(nn.Module):
  """A bare 'kernel' parameter (the name and shape `nn.Dense` gives it), for layers that do their own matmuls."""

  shape: tuple
  axes: tuple
  param_dtype: str

  @nn.compact
  def __call__(self):
    return self.param("kernel", _param(nn.initializers.normal(0.02), self.axes), self.shape, _dtype(self.param_dtype))


class Block(nn.Module):
  """One decoder layer: the parameters of `_layers.layer_spec`, `_layers.layer` with the modules' attention.
  Returns (h, new layer cache), or (h, (new layer cache, experts [B, T, k] with `return_routes`, the router's
  balance statistics [2, E] given `token_weights_bt`))."""

  config: ModelConfig
  return_routes: bool = False

  @nn.compact
  def __call__(
    self,
    h_btd,
    layer_cache,
    positions_bt,
    mask_bts,
    write_index_b,
    layer_index=None,
    routes_btk=None,
    token_weights_bt=None,
  ):
    cfg = self.config
    p = {name: _Params(spec, cfg.param_dtype, name=name)() for name, spec in _layers.layer_spec(cfg)}

    def attention(q_btnd, k_btkd, v_btkd):
      return _attention(cfg, q_btnd, k_btkd, v_btkd, mask_bts, layer_cache, write_index_b)

    mm = _layers.Dots(cfg.dtype, shard=True)
    out = _layers.layer(
      cfg,
      p,
      h_btd,
      positions_bt,
      attention,
      mm,
      mlp_fn=_train_mlp,
      layer_index=layer_index,
      routes=routes_btk,
      return_routes=self.return_routes,
      token_weights=token_weights_bt,
    )
    h_btd = constrain(out[0], _BTD)
    return (h_btd, tuple(out[1:])) if len(out) > 2 else (h_btd, out[1])


class Decoder(nn.Module):
  """`return_routes` (a model with experts): the calls also return the experts each token went to."""

  config: ModelConfig
  return_routes: bool = False

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
      in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, 0, 0, nn.broadcast),
      out_axes=0,
      length=cfg.num_layers,
      unroll=min(cfg.scan_unroll, cfg.num_layers),
      metadata_params={nn.PARTITION_NAME: "layers"},
    )(cfg, self.return_routes)
    self.norm = RMSNorm(cfg.rms_norm_eps, cfg.dtype, cfg.param_dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = _Kernel((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.param_dtype)

  def __call__(
    self, tokens_bt, positions_bt, mask_bts, cache=None, write_index_b=None, routes_btsk=None, token_weights_bt=None
  ):
    """Returns (final hidden states [B,T,D] after the last norm, new cache or None), then the experts used
    [B, T, L_sparse, k] with `return_routes`, then given `token_weights_bt` [B, T] the router's balance statistics
    of the sparse layers [L_sparse, 2, E] (`_balance.router_stats`, tokens weighted so). routes_btsk: experts to replay
    (`_moe.route`), sparse layers in order."""
    cfg = self.config
    h_btd = _layers.embed(self.embed_tokens.embedding, tokens_bt, _dtype(cfg.dtype))
    h_btd = constrain(h_btd, _BTD)
    layer_index = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    routes_lbtk = None if routes_btsk is None else _moe.routes_per_layer(cfg, routes_btsk)
    h_btd, ys = self.layers(
      h_btd, cache, positions_bt, mask_bts, write_index_b, layer_index, routes_lbtk, token_weights_bt
    )
    if not self.return_routes and token_weights_bt is None:
      return self.norm(h_btd), ys
    new_cache, *extras = ys
    if self.return_routes:
      extras[0] = _moe.sparse_routes(cfg, extras[0])
    if token_weights_bt is not None:
      extras[-1] = extras[-1][np.flatnonzero(cfg.moe_layers)]
    return (self.norm(h_btd), new_cache, *extras)

  def unembed(self, h_btd):
    params = {"embed_tokens": {"embedding": self.embed_tokens.embedding}}
    if not self.config.tie_word_embeddings:
      params["lm_head"] = {"kernel": self.lm_head()}
    return _layers.unembed(self.config, params, h_btd)

  def init_all(self, tokens_bt, positions_bt, mask_bts):
    h, _ = self(tokens_bt, positions_bt, mask_bts)
    return self.unembed(h)
