"""The sparse expert block of Qwen3-MoE: softmax router, top-k, dropless SwiGLU experts; and the router's
load-balancing loss.

Parameters (one layer, below its `mlp` group; the names are the HF checkpoint's, the expert weights stacked):
  gate    {kernel [D, E]}                          the router (HF `mlp.gate.weight` [E, D])
  experts {gate_proj, up_proj {kernel [E, D, F]}, down_proj {kernel [E, F, D]}}
                                                   (HF `mlp.experts.{e}.{gate,up,down}_proj.weight`)

Routing (HF `Qwen3MoeTopKRouter`): probabilities = softmax(x · gate) in float32, each token's top k experts, their
probabilities renormalised to sum to 1 when `norm_topk_prob`; the output is the gate-weighted sum of the k experts'
SwiGLU outputs. Every token reaches its k experts (dropless: no capacity, no token dropped). Two computations of
the same sum (`ModelConfig.moe_impl`, tested equal):
  * 'ragged': the N * k (token, expert) pairs sorted by expert, each expert's rows one group of
    `jax.lax.ragged_dot` (k of E experts' FLOPs);
  * 'dense': every expert on every token, combined by the gates (E / k times the FLOPs; no sort, gather or
    ragged dot). Faster on CPU at small shapes (docs/performance.md), and a reference.
The router logits are computed in float32 (HF: in the compute dtype), so a bf16 model routes as its float32 self.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aepo_jax.model._config import ModelConfig


def moe_spec(config: ModelConfig) -> tuple:
  """The sparse block's entries of `_layers.layer_spec` (`(name, shape, logical axes, init)` / `(name, entries)`)."""
  d, e, f = config.hidden_size, config.num_experts, config.moe_intermediate_size
  return (
    ("gate", (("kernel", (d, e), ("embed", "expert"), "normal"),)),
    (
      "experts",
      (
        ("gate_proj", (("kernel", (e, d, f), ("expert", "embed", "mlp"), "normal"),)),
        ("up_proj", (("kernel", (e, d, f), ("expert", "embed", "mlp"), "normal"),)),
        ("down_proj", (("kernel", (e, f, d), ("expert", "mlp", "embed"), "normal"),)),
      ),
    ),
  )


def resolve_impl(config: ModelConfig) -> str:
  """'ragged' or 'dense' for `config.moe_impl` ('auto': 'dense' on CPU, 'ragged' elsewhere)."""
  if config.moe_impl != "auto":
    return config.moe_impl
  return "dense" if jax.default_backend() == "cpu" else "ragged"


def router_logits(p, x_nd):
  """Float32 router logits [N, E] of tokens x [N, D]."""
  return x_nd.astype(jnp.float32) @ p["gate"]["kernel"].astype(jnp.float32)


def route(config: ModelConfig, logits_ne):
  """(gates [N, k] float32, experts [N, k] int32): each token's top-k experts and their weights."""
  probs = jax.nn.softmax(logits_ne, axis=-1)
  gates, experts = jax.lax.top_k(probs, config.num_experts_per_tok)
  if config.norm_topk_prob:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return gates, experts.astype(jnp.int32)


def _expert_weights(p, dtype):
  w = p["experts"]
  return tuple(w[n]["kernel"].astype(dtype) for n in ("gate_proj", "up_proj", "down_proj"))


def experts_ragged(p, x_nd, gates_nk, experts_nk, num_experts: int):
  """sum_j gates[n, j] * expert_{experts[n, j]}(x[n]) through `jax.lax.ragged_dot` over rows sorted by expert."""
  n, k = experts_nk.shape
  wg, wu, wd = _expert_weights(p, x_nd.dtype)
  flat = experts_nk.reshape(-1)
  order = jnp.argsort(flat, stable=True)  # pair order sorted by expert
  rows = x_nd[order // k]  # [N * k, D]: token n's pairs are n * k .. n * k + k - 1
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  h = jax.nn.silu(jax.lax.ragged_dot(rows, wg, sizes)) * jax.lax.ragged_dot(rows, wu, sizes)
  y = jax.lax.ragged_dot(h, wd, sizes)  # [N * k, D], sorted
  y_nkd = jnp.zeros_like(y).at[order].set(y).reshape(n, k, -1)  # back in token order
  return jnp.einsum("nkd,nk->nd", y_nkd, gates_nk.astype(y.dtype))


def experts_dense(p, x_nd, gates_nk, experts_nk, num_experts: int):
  """The same sum with every expert on every token, combined by the [N, E] gates (0 off the top k)."""
  wg, wu, wd = _expert_weights(p, x_nd.dtype)
  combine_ne = jnp.einsum("nk,nke->ne", gates_nk, jax.nn.one_hot(experts_nk, num_experts, dtype=gates_nk.dtype))
  h = jax.nn.silu(jnp.einsum("nd,edf->enf", x_nd, wg)) * jnp.einsum("nd,edf->enf", x_nd, wu)
  y = jnp.einsum("enf,efd->end", h, wd)
  return jnp.einsum("end,ne->nd", y, combine_ne.astype(y.dtype))


EXPERTS = {"ragged": experts_ragged, "dense": experts_dense}


def moe(config: ModelConfig, p, x, impl: str = ""):
  """The sparse block on x [..., D] in x's dtype: route, then the experts (`impl`, default `resolve_impl`)."""
  lead, d = x.shape[:-1], x.shape[-1]
  x_nd = x.reshape(-1, d)
  gates, experts = route(config, router_logits(p, x_nd))
  y = EXPERTS[impl or resolve_impl(config)](p, x_nd, gates, experts, config.num_experts)
  return y.reshape(*lead, d)


def load_balancing_loss(router_logits_lne, top_k: int, mask_n=None):
  """The Switch Transformer auxiliary loss (arXiv 2101.03961, eqs. 4-6) as transformers' `load_balancing_loss_func`
  computes it for Qwen3-MoE: E * sum_e f_e * P_e, f_e the fraction of top-k assignments to expert e and P_e its mean
  router probability, both over every sparse layer's tokens (valid ones where `mask_n` [N] is given).

  router_logits_lne: [L, N, E] (the sparse layers' logits, N = B * T tokens). Not part of any training loss here
  (`ModelConfig.router_aux_loss_coef` says why)."""
  logits = jnp.asarray(router_logits_lne, jnp.float32)
  num_experts = logits.shape[-1]
  probs = jax.nn.softmax(logits, axis=-1)
  _, top = jax.lax.top_k(probs, top_k)
  counts_lne = jnp.sum(jax.nn.one_hot(top, num_experts, dtype=jnp.float32), axis=-2)
  w_n = jnp.ones(logits.shape[1], jnp.float32) if mask_n is None else jnp.asarray(mask_n, jnp.float32).reshape(-1)
  rows = logits.shape[0] * jnp.sum(w_n)
  tokens_per_expert = jnp.einsum("lne,n->e", counts_lne, w_n) / rows
  prob_per_expert = jnp.einsum("lne,n->e", probs, w_n) / rows
  return num_experts * jnp.sum(tokens_per_expert * prob_per_expert)
