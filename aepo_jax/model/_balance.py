"""The router's load-balancing loss of a mixture-of-experts model (Switch Transformer, arXiv 2101.03961, eqs. 4-6;
transformers' `load_balancing_loss_func` for Qwen3-MoE): per-layer statistics the sparse block returns
(`router_stats`), their combination (`balance_loss`), and the same loss from the layers' router logits
(`load_balancing_loss`, the reference form)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def router_stats(logits_ne, experts_nk, w_n):
  """[2, E] float32, one sparse layer's share of the load-balancing loss: row 0 the weighted count of (token,
  expert) assignments per expert (the experts the tokens went to: their top k, or the replayed ones), row 1 the
  weighted sum of the router's probabilities per expert (the row that carries the gradient). Summed over layers
  and given to `balance_loss`."""
  num_experts = logits_ne.shape[-1]
  w_n = jnp.asarray(w_n, jnp.float32)
  counts = jnp.einsum("nke,n->e", jax.nn.one_hot(experts_nk, num_experts, dtype=jnp.float32), w_n)
  probs = jnp.einsum("ne,n->e", jax.nn.softmax(logits_ne.astype(jnp.float32), axis=-1), w_n)
  return jnp.stack([jax.lax.stop_gradient(counts), probs])


def balance_loss(stats_s2e, top_k: int):
  """The Switch Transformer auxiliary loss (arXiv 2101.03961, eqs. 4-6), transformers' `load_balancing_loss_func`
  for Qwen3-MoE, from the sparse layers' `router_stats` [L_sparse, 2, E]: E * sum_e f_e * P_e, f_e the fraction
  of top-k assignments to expert e and P_e its mean router probability, both over every sparse layer's (weighted)
  tokens; 0 where no token has weight."""
  stats = jnp.asarray(stats_s2e, jnp.float32)
  num_experts = stats.shape[-1]
  counts, probs = jnp.sum(stats[:, 0], axis=0), jnp.sum(stats[:, 1], axis=0)
  rows = jnp.sum(counts) / top_k  # sparse layers x weighted tokens
  return num_experts * jnp.sum(counts * probs) / jnp.maximum(rows * rows, 1e-30)


def load_balancing_loss(router_logits_lne, top_k: int, mask_n=None):
  """The Switch Transformer auxiliary loss (arXiv 2101.03961, eqs. 4-6) as transformers' `load_balancing_loss_func`
  computes it for Qwen3-MoE: E * sum_e f_e * P_e, f_e the fraction of top-k assignments to expert e and P_e its mean
  router probability, both over every sparse layer's tokens (valid ones where `mask_n` [N] is given).

  router_logits_lne: [L, N, E] (the sparse layers' logits, N = B * T tokens). The reference form: training adds the
  same loss from per-layer statistics (`router_stats`, `balance_loss`) when `ModelConfig.router_aux_loss_coef` > 0
  (0 by default: that field says why)."""
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
