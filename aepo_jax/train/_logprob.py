"""Log-probs of the policy: the chunked next-token log-probs and entropies every training program computes
(`next_token_logprobs`), the batched recomputation of old and reference log-probs (`make_logprob_fn`), routing
replay's disagreement measure, and the sampler-vs-trainer comparisons (`behaviour_log_prob`,
`logprob_mismatch_metrics`).

Log-probs come from final hidden states through chunked unembedding (`token_logprobs_and_entropy`), with logits
divided by the rollout temperature (spec §1.5), so no [mb, T, V] tensor exists for the whole row.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from aepo_jax import objectives
from aepo_jax.model import (
  ModelConfig,
  balance_loss,
  forward_hidden,
  param_shardings,
  resolve_attention_impl,
  unembed_matrix,
)
from aepo_jax.parallel import DEFAULT_RULES, activation_spec, current_mesh, make_mesh, sharding_context
from aepo_jax.train._batch import batch_sharding

DEFAULT_LOGPROB_CHUNK = 256
DEFAULT_SAVED_LOGITS_MB = 1024.0  # a micro-batch's logits up to 1 GiB are kept for the backward, not recomputed


def mesh_or_one_device(mesh: Optional[Mesh]) -> Mesh:
  return mesh if mesh is not None else make_mesh((1, 1, 1), devices=jax.devices()[:1])


# ----------------------------------------------------------------------------------------------------
# Log-probs
# ----------------------------------------------------------------------------------------------------
def shift_left(x_bt):
  """Column t gets column t+1 (the last gets 0): the hidden state at t predicts token t+1."""
  return jnp.concatenate([x_bt[:, 1:], jnp.zeros_like(x_bt[:, :1])], axis=1)


def next_token_logprobs(
  model_config,
  params,
  tokens_bt,
  attention_mask_bt,
  *,
  temperature=1.0,
  chunk=DEFAULT_LOGPROB_CHUNK,
  segment_ids_bt=None,
  where_bt=None,
  capacity: int = 0,
  saved_logits_mb: float = 0.0,
  routes_btsk=None,
  balance: bool = False,
):
  """(log π(token t+1 | ≤t), entropy at t) [B, T] in float32, column T-1 is meaningless (0 target).
  With `segment_ids_bt` (packed rows) the column before a segment's first token is meaningless too; callers mask
  it (an SFT segment starts with untrained prompt tokens). where_bt / capacity: only those columns are computed
  (the others are 0), see `objectives.token_logprobs_and_entropy`. saved_logits_mb: a backward pass keeps the
  float32 logits of the forward when they take at most this many MiB (else it recomputes them). routes_btsk
  [B, T, L_sparse, k]: routing replay (a model with experts), each token through these experts (-1: its own).
  balance (a model with experts): also returns, third, the router's load-balancing loss over the valid tokens
  (`model._balance.balance_loss`, transformers' `load_balancing_loss_func`)."""
  out = forward_hidden(
    model_config,
    params,
    tokens_bt,
    None,
    attention_mask_bt,
    segment_ids_bt,
    routes_btsk=routes_btsk,
    router_stats=balance,
  )
  h_btd, stats = out if balance else (out, None)
  w, layout = unembed_matrix(model_config, params)
  logp_ent = objectives.token_logprobs_and_entropy(
    h_btd,
    w,
    shift_left(tokens_bt),
    temperature,
    chunk,
    where_bt=where_bt,
    capacity=capacity,
    layout=layout,
    max_saved_logits=int(saved_logits_mb * 2**20) // 4,
    sharding=head_sharding(w.shape, layout),
  )
  return (*logp_ent, balance_loss(stats, model_config.num_experts_per_tok)) if balance else logp_ent


def head_sharding(w_shape, layout: str):
  """The LM head's `objectives.HeadSharding` under the enclosing `parallel.sharding_context` (rows over the
  activation batch axes, the vocabulary and D as the parameter rules store the head), or None on one device."""
  mesh = current_mesh()
  if mesh is None or mesh.devices.size == 1:
    return None
  rows = activation_spec((mesh.devices.size, 1), ("activation_batch", None))[0]
  vd = w_shape if layout == "vd" else w_shape[::-1]
  vocab, embed = activation_spec(vd, ("vocab", "embed"))
  as_tuple = lambda a: () if a is None else (a if isinstance(a, tuple) else (a,))  # noqa: E731
  batch_axes = tuple(a for a in as_tuple(rows) if mesh.shape[a] > 1)
  vocab_axes = [a for a in as_tuple(vocab) if mesh.shape[a] > 1]
  embed_axes = [a for a in as_tuple(embed) if mesh.shape[a] > 1]
  if len(vocab_axes) > 1 or len(embed_axes) > 1 or not batch_axes and not vocab_axes:
    return None  # a layout this path does not cover: the partitioner's
  return objectives.HeadSharding(
    mesh, batch_axes, vocab_axes[0] if vocab_axes else None, embed_axes[0] if embed_axes else None
  )


def logit_capacity(fraction: float, rows: int, length: int, multiple: int = 64) -> int:
  """Positions of a [rows, length] micro-batch that get logits when `train.logit_fraction` is `fraction`
  (0: all, returned as 0), rounded up to a multiple of 64."""
  if not fraction:
    return 0
  return min(rows * length, -(-int(math.ceil(fraction * rows * length)) // multiple) * multiple)


def _unshift(x_bt):
  """Back to token alignment: column t describes token t (column 0, the first prompt token, is 0)."""
  return jnp.concatenate([jnp.zeros_like(x_bt[:, :1]), x_bt[:, :-1]], axis=1)


def make_logprob_fn(
  model_config: ModelConfig,
  mesh: Optional[Mesh] = None,
  rules=DEFAULT_RULES,
  *,
  temperature: float = 1.0,
  chunk: int = DEFAULT_LOGPROB_CHUNK,
  with_routes: bool = False,
):
  """Jitted `fn(params, tokens [K, mb, T], attention_mask [K, mb, T]) -> (log_prob, entropy) [K, mb, T]`.

  with_routes (routing replay, a model with experts): `fn(params, tokens, attention_mask, routes)`, routes
  [K, mb, T, L_sparse, k] the experts each token goes through (None: the model routes itself).
  Aligned with the tokens (column t: log π(token t | tokens < t) at logits / temperature; column 0 is 0).
  Micro-batches run one after another (lax.map), so memory is that of one [mb, T] forward. Outputs keep
  the batch sharding, ready to be put into the batch as `old_log_prob` / `ref_log_prob`.
  """
  mesh = mesh_or_one_device(mesh)
  model_config = resolve_attention_impl(model_config, mesh)
  p_sh, b_sh = param_shardings(model_config, mesh, rules), batch_sharding(mesh, rules)

  def one(params, xs):
    tokens, mask, routes = xs
    logp, ent = next_token_logprobs(
      model_config, params, tokens, mask, temperature=temperature, chunk=chunk, routes_btsk=routes
    )
    return _unshift(logp), _unshift(ent)

  def fn(params, tokens, attention_mask, routes=None):
    with sharding_context(mesh, rules):  # the model's activation constraints take effect while tracing
      return jax.lax.map(lambda xs: one(params, xs), (tokens, attention_mask, routes))

  in_shardings = (p_sh, b_sh, b_sh) + ((b_sh,) if with_routes else ())  # jit takes no keyword with in_shardings
  return jax.jit(fn, in_shardings=in_shardings, out_shardings=(b_sh, b_sh))


def make_routing_disagreement_fn(model_config: ModelConfig, mesh: Optional[Mesh] = None, rules=DEFAULT_RULES):
  """Jitted `fn(params, tokens, attention_mask, routes) -> (differing, compared)` over a [K, mb, T] batch (routes
  [K, mb, T, L_sparse, k], the rollout's): how many (token, sparse layer) pairs the trainer's own top-k routes to
  another set of experts than the rollout did, of how many it compares (tokens with recorded routes). One forward
  without the LM head per micro-batch (algo.routing_replay='measure')."""
  mesh = mesh_or_one_device(mesh)
  model_config = resolve_attention_impl(model_config, mesh)
  p_sh, b_sh = param_shardings(model_config, mesh, rules), batch_sharding(mesh, rules)

  def one(params, xs):
    tokens, mask, rollout = xs
    _, own = forward_hidden(model_config, params, tokens, None, mask, return_routes=True)
    recorded = (rollout[..., 0] >= 0) & (mask[..., None] > 0)  # [mb, T, L_sparse]
    differ = jnp.any(jnp.sort(own, axis=-1) != jnp.sort(rollout, axis=-1), axis=-1) & recorded
    return jnp.sum(differ), jnp.sum(recorded)

  def fn(params, tokens, attention_mask, routes):
    with sharding_context(mesh, rules):
      d, n = jax.lax.map(lambda xs: one(params, xs), (tokens, attention_mask, routes))
    return jnp.sum(d), jnp.sum(n)

  return jax.jit(fn, in_shardings=(p_sh, b_sh, b_sh, b_sh))


def routing_disagreement(fn, params, batch, routes) -> dict:
  """train/routing_disagreement: the share of recorded (token, sparse layer) pairs whose experts the trainer would
  choose differently from the rollout (`make_routing_disagreement_fn`); 0 with none recorded."""
  differing, compared = jax.device_get(fn(params, batch["tokens"], batch["attention_mask"], routes))
  return {"train/routing_disagreement": float(differing) / max(float(compared), 1.0)}


@jax.jit
def behaviour_log_prob(old_log_prob, sampler_log_prob, loss_mask):
  """The sampler's log-probs, with the trained tokens the host inserted given the recomputed old log-prob: the EOS
  appended at the tool-call limit (spec §1.2 2.3) is trained, as the official code trains it, but was never sampled
  and carries log-prob 0. So its importance ratio (algo.off_policy) is 1 and it adds nothing to the mismatch
  metrics. A sampled token whose log-prob is exactly 0 (probability 1 in float32) is treated the same, which moves
  its behaviour log-prob by the trainer's own rounding (~1e-6) at most."""
  inserted = (loss_mask > 0) & (sampler_log_prob == 0.0)
  return jnp.where(inserted, old_log_prob, sampler_log_prob)


@jax.jit
def logprob_mismatch_metrics(trainer_log_prob, sampler_log_prob, loss_mask):
  """Sampler vs trainer log-probs on the same tokens (two code paths: the engine samples, the trainer recomputes)."""
  valid = loss_mask > 0
  diff = jnp.where(valid, jnp.abs(trainer_log_prob - sampler_log_prob), 0.0)
  prob_diff = jnp.where(valid, jnp.abs(jnp.exp(trainer_log_prob) - jnp.exp(sampler_log_prob)), 0.0)
  n = jnp.maximum(jnp.sum(valid), 1)
  return {
    "mismatch/logprob_abs_diff_mean": jnp.sum(diff) / n,
    "mismatch/logprob_abs_diff_max": jnp.max(diff),
    "mismatch/prob_abs_diff_mean": jnp.sum(prob_diff) / n,
    "mismatch/prob_abs_diff_max": jnp.max(prob_diff),
  }
