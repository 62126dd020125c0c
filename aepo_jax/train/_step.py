"""The jitted update steps (RL and SFT); their log-probs and the batched recomputation are `_logprob`'s.

`make_update_step` / `make_sft_step` return ONE jitted pure function
    (params, opt_state, batch) -> (params, opt_state, metrics)
compiled once per batch shape, with explicit in/out shardings from the logical-axis rules (parameters and
optimizer state as the model names them, batch rows over ('data', 'fsdp')), donated params/opt_state,
and gradient accumulation over the M micro-batches of a [M, mb, T] batch inside the jit (lax.scan).

Aggregation under accumulation (spec §1.5, §5 item 10), `aggregation=`:
  'global'  (default) each micro-batch's loss is Σ ℓ·m over its tokens divided by the normalizer of the
            WHOLE mini-batch (its total valid token count for token-mean), computed before the scan, and
            the micro-batch losses are summed: loss and gradient equal one big batch exactly.
  'verl'    each micro-batch's own aggregate, weighted by its share of sequences (verl's loss / gradient
            accumulation); with a `loss_denominator` row in the batch, each row divided by its own denominator:
            the micro-batches of verl's use_dynamic_bsz (`_verl_batching.verl_dynamic_layout`).
Statistics a loss takes over the tokens it sees (AEPO's entropy standardisation, spec §2.3) stay per
micro-batch in both modes, as in the official code.

A non-finite loss or gradient norm skips the update (params and optimizer state unchanged) and reports
`train/nonfinite_skipped` = 1; the trainer counts these and stops after its limit.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from aepo_jax import objectives
from aepo_jax.model import (
  ModelConfig,
  param_shapes,
  param_shardings,
  resolve_attention_impl,
)
from aepo_jax.parallel import DEFAULT_RULES, sharding_context
from aepo_jax.train._batch import batch_sharding
from aepo_jax.train._logprob import (
  DEFAULT_LOGPROB_CHUNK,
  DEFAULT_SAVED_LOGITS_MB,
  mesh_or_one_device,
  next_token_logprobs,
  shift_left,
)
from aepo_jax.train._optim import current_lr

AGGREGATIONS = ("global", "verl")


# ----------------------------------------------------------------------------------------------------
# Shardings and state
# ----------------------------------------------------------------------------------------------------
def opt_state_shardings(
  model_config: ModelConfig, optimizer: optax.GradientTransformation, mesh: Optional[Mesh] = None, rules=DEFAULT_RULES
):
  """Optimizer-state shardings: moments like their parameters, counters and hyperparameters replicated."""
  mesh = mesh_or_one_device(mesh)
  p_sh = param_shardings(model_config, mesh, rules)
  shapes = jax.eval_shape(optimizer.init, param_shapes(model_config))
  replicated = NamedSharding(mesh, PartitionSpec())
  return optax.tree_map_params(optimizer, lambda _, s: s, shapes, p_sh, transform_non_params=lambda _: replicated)


def init_train_state(
  model_config: ModelConfig,
  params,
  optimizer: optax.GradientTransformation,
  mesh: Optional[Mesh] = None,
  rules=DEFAULT_RULES,
):
  """(params, opt_state) placed on the mesh. `params` are host or device arrays holding the same values
  on every process (same checkpoint or same seed); each process keeps only its own shards."""
  mesh = mesh_or_one_device(mesh)
  p_sh = param_shardings(model_config, mesh, rules)
  params = jax.tree.map(_place, params, p_sh)
  opt_state = jax.jit(optimizer.init, out_shardings=opt_state_shardings(model_config, optimizer, mesh, rules))(params)
  return params, opt_state


def _place(x, sharding):
  if isinstance(x, jax.Array) and not x.is_fully_addressable:  # already global: reshard on device (any device order)
    return jax.device_put(x, sharding)
  host = np.asarray(jax.device_get(x))
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _balance(model_config: ModelConfig) -> float:
  """The load-balancing loss weight the update and SFT steps add (`ModelConfig.router_aux_loss_coef`; a model
  with experts only)."""
  return float(model_config.router_aux_loss_coef) if model_config.has_experts else 0.0


# ----------------------------------------------------------------------------------------------------
# The update step
# ----------------------------------------------------------------------------------------------------
def _combine_metrics(metrics_m, weights_m):
  """Per-micro-batch metrics [M] -> one value: max/min for extremes, else valid-token-weighted mean."""
  out = {}
  for k, v in metrics_m.items():
    if k.endswith("_max"):
      out[k] = jnp.max(v)
    elif k.endswith("_min"):
      out[k] = jnp.min(v)
    else:
      out[k] = jnp.sum(v * weights_m) / jnp.maximum(jnp.sum(weights_m), 1.0)
  return out


def _build_step(model_config, micro_loss, optimizer, mesh, rules, micro_batches, agg, aggregation):
  """micro_loss(params, mb, normalizer, scale) -> (loss, aux dict). Shared by RL and SFT steps."""
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"aggregation={aggregation!r} is unknown; choose one of {AGGREGATIONS}")
  if micro_batches < 1:
    raise ValueError(f"micro_batches={micro_batches} must be >= 1")
  mesh = mesh_or_one_device(mesh)
  p_sh = param_shardings(model_config, mesh, rules)
  o_sh = opt_state_shardings(model_config, optimizer, mesh, rules)
  b_sh = batch_sharding(mesh, rules)
  replicated = NamedSharding(mesh, PartitionSpec())
  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

  def step(params, opt_state, batch):
    with sharding_context(mesh, rules):  # the model's activation constraints take effect while tracing
      return _step(params, opt_state, batch)

  def _step(params, opt_state, batch):
    m_count = batch["tokens"].shape[0]
    if m_count != micro_batches:
      raise ValueError(
        f"batch has {m_count} micro-batches but the step was built with micro_batches="
        f"{micro_batches}; use split_updates(batch, {micro_batches})"
      )
    mask_all = shift_left(batch["loss_mask"].reshape(-1, batch["loss_mask"].shape[-1]))
    normalizer = objectives.loss_normalizer(mask_all, agg)
    total_seqs = jnp.maximum(objectives.num_sequences(mask_all), 1.0)

    def body(grads_acc, mb):
      if aggregation == "global":
        norm, scale = normalizer, 1.0
      elif "loss_denominator" in mb:  # verl's dynamic micro-batches: each row's own weight (_verl_batching)
        norm, scale = mb["loss_denominator"][:, 0], 1.0
      else:
        norm, scale = None, objectives.num_sequences(shift_left(mb["loss_mask"])) / total_seqs
      (loss, aux), grads = grad_fn(params, mb, norm, scale)
      return jax.tree.map(jnp.add, grads_acc, grads), (loss, aux)

    zeros = jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(jnp.zeros_like(p), s), params, p_sh)
    grads, (loss_m, aux_m) = jax.lax.scan(body, zeros, batch)

    loss = jnp.sum(loss_m)
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def apply(operand):
      p, s = operand
      updates, s = optimizer.update(grads, s, p)
      return optax.apply_updates(p, updates), s, optax.global_norm(updates).astype(jnp.float32)

    def skip(operand):
      return operand + (jnp.zeros((), jnp.float32),)

    params, opt_state, update_norm = jax.lax.cond(finite, apply, skip, (params, opt_state))

    tokens_m = aux_m.pop("tokens")
    entropy_sum = aux_m.pop("entropy_sum")
    sums = {k[len("sum:") :]: jnp.sum(aux_m.pop(k)) for k in list(aux_m) if k.startswith("sum:")}
    metrics = _combine_metrics(aux_m, tokens_m)
    metrics.update(sums)
    metrics.update(
      {
        "train/loss": loss,
        "train/grad_norm": grad_norm,
        "train/update_norm": update_norm,  # of the optimizer's step (0 when skipped)
        "train/param_norm": optax.global_norm(params),
        "train/nonfinite_skipped": 1.0 - finite.astype(jnp.float32),
        "train/tokens": jnp.sum(tokens_m),
        "train/sequences": objectives.num_sequences(mask_all),
        "actor/entropy_mean": jnp.sum(entropy_sum) / jnp.maximum(jnp.sum(tokens_m), 1.0),
      }
    )
    lr = current_lr(opt_state)
    if lr is not None:
      metrics["train/lr"] = lr
    return params, opt_state, metrics

  return jax.jit(step, in_shardings=(p_sh, o_sh, b_sh), out_shardings=(p_sh, o_sh, replicated), donate_argnums=(0, 1))


def _loss_agg(loss_fn, loss_hp):
  if "agg" in loss_hp:
    return loss_hp["agg"]
  param = inspect.signature(loss_fn).parameters.get("agg")
  return param.default if param is not None and param.default is not inspect.Parameter.empty else "token-mean"


def make_update_step(
  model_config: ModelConfig,
  *,
  loss_fn: Union[str, Callable],
  loss_hp: Optional[dict] = None,
  optimizer: optax.GradientTransformation,
  micro_batches: int,
  mesh: Optional[Mesh] = None,
  rules=DEFAULT_RULES,
  temperature: float = 1.0,
  kl_name: Optional[str] = None,
  kl_coef: float = 0.0,
  need_entropy: bool = False,
  logprob_chunk: int = DEFAULT_LOGPROB_CHUNK,
  aggregation: str = "global",
  logit_capacity: int = 0,
  saved_logits_mb: float = DEFAULT_SAVED_LOGITS_MB,
  off_policy: str = "none",
  off_policy_hp: Optional[dict] = None,
):
  """The RL update step. batch: tokens, attention_mask, loss_mask, old_log_prob, advantages (+ ref_log_prob
  when kl_coef != 0, + sampler_log_prob with an off-policy correction), each [micro_batches, mb, T] and aligned
  with the tokens (see `_batch`); + routes [micro_batches, mb, T, L_sparse, k] for routing replay (a model with
  experts: every token through the experts the rollout chose, R3).

  loss_fn: a registered policy-loss name (`objectives.policy_loss`) or a callable with its signature
    fn(log_prob, old_log_prob, advantages, mask, entropy=None, **loss_hp) -> (loss, metrics).
  need_entropy: pass the current policy's entropy to the loss (AEPO's entropy-aware advantage, §2.3).
    The entropy is computed in the same chunked pass either way and reported as `actor/entropy_mean`.
  kl_name / kl_coef: a KL loss term kl_coef · aggregate(kl(log_prob, ref_log_prob)) (verl use_kl_loss).
  logit_capacity: > 0 computes the LM head only at the loss positions of a micro-batch, up to this many (a
    micro-batch with more takes the dense path; same result either way), see `objectives.token_logprobs_and_entropy`.
  saved_logits_mb: the backward reuses the forward's float32 logits of a micro-batch when they take at most this
    many MiB (one LM-head matmul fewer per step), and recomputes them chunk by chunk otherwise; same values.
  off_policy / off_policy_hp: a registered off-policy correction (`objectives.off_policy`) with the sampler's
    log-probs as the behaviour policy and old_log_prob as the proximal one; 'none' leaves the loss as it is.
  """
  model_config = resolve_attention_impl(model_config, mesh_or_one_device(mesh))
  fn = objectives.policy_loss(loss_fn) if isinstance(loss_fn, str) else loss_fn
  if off_policy != "none":
    fn = objectives.apply_off_policy(fn, off_policy, **(off_policy_hp or {}))
  hp = dict(loss_hp or {})
  if "normalizer" in hp:
    raise ValueError("loss_hp['normalizer'] is set by the update step (see `aggregation=`); remove it")
  agg = _loss_agg(fn, hp)
  hp["agg"] = agg
  use_kl = kl_coef != 0.0
  if use_kl and not kl_name:
    raise ValueError(f"kl_coef={kl_coef} needs kl_name (one of {objectives.list_kl_estimators()})")

  balance = _balance(model_config)

  def micro_loss(params, mb, normalizer, scale):
    mask = shift_left(mb["loss_mask"])
    logp, ent, *aux = next_token_logprobs(
      model_config,
      params,
      mb["tokens"],
      mb["attention_mask"],
      temperature=temperature,
      chunk=logprob_chunk,
      where_bt=mask > 0,
      capacity=logit_capacity,
      saved_logits_mb=saved_logits_mb,
      routes_btsk=mb.get("routes"),
      balance=balance > 0,
    )
    pg_loss, metrics = fn(
      logp,
      shift_left(mb["old_log_prob"]),
      shift_left(mb["advantages"]),
      mask,
      entropy=jax.lax.stop_gradient(ent) if need_entropy else None,
      normalizer=normalizer,
      **hp,
      **({"behaviour_log_prob": shift_left(mb["sampler_log_prob"])} if off_policy != "none" else {}),
    )
    pg_loss = pg_loss * scale
    loss = pg_loss
    metrics = dict(metrics)
    metrics["sum:actor/pg_loss"] = pg_loss
    if use_kl:
      kl_loss = (
        objectives.kl_loss(
          logp, shift_left(mb["ref_log_prob"]), mask, estimator=kl_name, agg=agg, normalizer=normalizer
        )
        * scale
      )
      loss = loss + kl_coef * kl_loss
      metrics["sum:actor/kl_loss"] = kl_loss
    if aux:  # the mean over micro-batches of each one's balance loss
      loss = loss + balance * aux[0] / micro_batches
      metrics["sum:actor/router_aux_loss"] = aux[0] / micro_batches
    metrics.pop("actor/pg_loss", None)
    valid = mask > 0
    metrics["tokens"] = jnp.sum(valid).astype(jnp.float32)
    metrics["entropy_sum"] = jnp.sum(jnp.where(valid, jax.lax.stop_gradient(ent), 0.0))
    return loss, metrics

  return _build_step(model_config, micro_loss, optimizer, mesh, rules, micro_batches, agg, aggregation)


def make_sft_step(
  model_config: ModelConfig,
  *,
  optimizer: optax.GradientTransformation,
  micro_batches: int,
  mesh: Optional[Mesh] = None,
  rules=DEFAULT_RULES,
  temperature: float = 1.0,
  logprob_chunk: int = DEFAULT_LOGPROB_CHUNK,
  aggregation: str = "global",
  logit_capacity: int = 0,
  saved_logits_mb: float = DEFAULT_SAVED_LOGITS_MB,
):
  """Cold-start SFT step: masked NLL, token-mean over the loss_mask (prompt and tool results excluded).
  batch: tokens, attention_mask, loss_mask, each [micro_batches, mb, T], and `segment_ids` when rows are packed
  (`sft_batch(packed_rows=...)`): the same loss as the unpacked batch, on fewer padded tokens.
  logit_capacity, saved_logits_mb: as in `make_update_step`."""
  model_config = resolve_attention_impl(model_config, mesh_or_one_device(mesh))
  balance = _balance(model_config)

  def micro_loss(params, mb, normalizer, scale):
    seg = mb.get("segment_ids")
    mask = shift_left(mb["loss_mask"])
    if seg is not None:  # a target in another segment than its context (the next demo's first token)
      mask = mask * (shift_left(seg) == seg)
    logp, ent, *lb = next_token_logprobs(
      model_config,
      params,
      mb["tokens"],
      mb["attention_mask"],
      temperature=temperature,
      chunk=logprob_chunk,
      segment_ids_bt=seg,
      where_bt=mask > 0,
      capacity=logit_capacity,
      saved_logits_mb=saved_logits_mb,
      balance=balance > 0,
    )
    nll = objectives.aggregate(-logp, mask, "token-mean", normalizer) * scale
    valid = mask > 0
    aux = {
      "sum:sft/nll": nll,
      "tokens": jnp.sum(valid).astype(jnp.float32),
      "entropy_sum": jnp.sum(jnp.where(valid, jax.lax.stop_gradient(ent), 0.0)),
    }
    if lb:  # the mean over micro-batches of each one's balance loss
      aux["sum:sft/router_aux_loss"] = lb[0] / micro_batches
      return nll + balance * lb[0] / micro_batches, aux
    return nll, aux

  return _build_step(model_config, micro_loss, optimizer, mesh, rules, micro_batches, "token-mean", aggregation)
