"""The sparse expert block of Qwen3-MoE: softmax router, top-k, dropless SwiGLU experts (the router's
load-balancing loss: `_balance`).

Parameters (one layer, below its `mlp` group; the names are the HF checkpoint's, the expert weights stacked):
  gate    {kernel [D, E]}                          the router (HF `mlp.gate.weight` [E, D])
  experts {gate_proj, up_proj {kernel [E, D, F]}, down_proj {kernel [E, F, D]}}
                                                   (HF `mlp.experts.{e}.{gate,up,down}_proj.weight`)

Routing (HF `Qwen3MoeTopKRouter`): probabilities = softmax(x · gate) in float32, each token's top k experts, their
probabilities renormalised to sum to 1 when `norm_topk_prob`; the output is the gate-weighted sum of the k experts'
SwiGLU outputs. Every token reaches its k experts (dropless: no capacity, no token dropped). The sum's four
computations ('gmm', 'ragged', 'dense', 'gather': `ModelConfig.moe_impl`, `resolve_impl`) are in `_experts`; expert
parallelism (the experts split over a mesh axis, the tokens' all-to-all) is in `_expert_parallel`.
The router logits are computed in float32 (HF: in the compute dtype), so a bf16 model routes as its float32 self.

Routing replay (R3, arXiv 2510.11370): a forward may be given each token's experts ("routes", [..., L_sparse, k],
the sparse layers in layer order) instead of choosing them, and may return the ones it used: the rollout engine
records them (`Engine(record_routes=True)`) and the update replays them, so a token goes through the experts it went
through when sampled whatever the trainer's numerics (`route`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from aepo_jax import parallel
from aepo_jax.model import _balance
from aepo_jax.model._config import GMM_DTYPES, ModelConfig
from aepo_jax.model._expert_parallel import expert_parallel_axes, experts_parallel
from aepo_jax.model._experts import EXPERTS


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


def resolve_impl(config: ModelConfig, num_tokens: int | None = None) -> str:
  """The expert computation for `config.moe_impl`; 'auto': on CPU 'gather' for a call of `num_tokens` tokens whose
  (token, expert) pairs are at most half the experts (a decode step's few slots: it reads only those experts'
  weights) and 'dense' otherwise; 'gmm' on TPU (where the compute dtype is one the kernel takes, else 'ragged'),
  whose forward visits only the experts that have rows (megablox `gmm` builds its grid without empty groups);
  'ragged' elsewhere. Measured by bench/moe_decode.py (docs/performance.md)."""
  if config.moe_impl != "auto":
    return config.moe_impl
  platform = parallel.current_platform()
  if platform == "cpu":
    few = num_tokens is not None and 2 * num_tokens * config.num_experts_per_tok <= config.num_experts
    return "gather" if few else "dense"
  return "gmm" if platform == "tpu" and config.dtype in GMM_DTYPES else "ragged"


def router_logits(p, x_nd):
  """Float32 router logits [N, E] of tokens x [N, D]."""
  return x_nd.astype(jnp.float32) @ p["gate"]["kernel"].astype(jnp.float32)


def route(config: ModelConfig, logits_ne, replay_nk=None):
  """(gates [N, k] float32, experts [N, k] int32): each token's top-k experts and their weights.

  replay_nk [N, k] (routing replay, R3: arXiv 2510.11370): the experts to use instead of the top k (a token whose row
  holds a negative index takes its own top k). The gates are this router's probabilities at those experts,
  renormalised when `norm_topk_prob` as for its own choice, so the router keeps its gradient; R3's softmax over the
  replayed experts' logits is the same thing for norm_topk_prob (Qwen3-MoE's checkpoints)."""
  probs = jax.nn.softmax(logits_ne, axis=-1)
  gates, experts = jax.lax.top_k(probs, config.num_experts_per_tok)
  experts = experts.astype(jnp.int32)
  if replay_nk is not None:
    replay_nk = jnp.asarray(replay_nk, jnp.int32)
    experts = jnp.where(jnp.any(replay_nk < 0, axis=-1, keepdims=True), experts, replay_nk)
    gates = jnp.take_along_axis(probs, experts, axis=-1)
  if config.norm_topk_prob:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return gates, experts


def sparse_layer_index(config: ModelConfig) -> np.ndarray:
  """[L] int32: layer i's index among the sparse layers (a dense layer: 0, never read). The routes of a forward are
  [..., L_sparse, k], the sparse layers in layer order; the layer scans carry them as [L, ..., k]."""
  return np.maximum(np.cumsum(config.moe_layers) - 1, 0).astype(np.int32)


def routes_per_layer(config: ModelConfig, routes_xsk):
  """Routes [..., L_sparse, k] -> [L, ..., k], the layer axis first for a layer scan (a dense layer gets a sparse
  layer's routes, which it ignores)."""
  routes = jnp.asarray(routes_xsk, jnp.int32)
  num_sparse = sum(config.moe_layers)
  if routes.shape[-2:] != (num_sparse, config.num_experts_per_tok):
    raise ValueError(
      f"routes {routes.shape}: the last two axes must be (sparse layers, num_experts_per_tok) = "
      f"({num_sparse}, {config.num_experts_per_tok})."
    )
  return jnp.moveaxis(routes[..., sparse_layer_index(config), :], -2, 0)


def sparse_routes(config: ModelConfig, experts_lxk):
  """A layer scan's experts [L, ..., k] -> routes [..., L_sparse, k] (the sparse layers only)."""
  return jnp.moveaxis(experts_lxk[np.flatnonzero(config.moe_layers)], 0, -2)


def moe(config: ModelConfig, p, x, impl: str = "", *, routes=None, return_routes: bool = False, token_weights=None):
  """The sparse block on x [..., D] in x's dtype: route, then the experts (`impl`, default `resolve_impl`).

  routes [..., k]: replayed experts (`route`'s replay_nk); return_routes: also return the experts used [..., k].
  token_weights [...]: also return the router's balance statistics over the tokens so weighted (`router_stats`).
  Returns y, or (y, experts if return_routes, statistics if token_weights) in that order."""
  lead, d = x.shape[:-1], x.shape[-1]
  x_nd = x.reshape(-1, d)
  replay = None if routes is None else routes.reshape(-1, routes.shape[-1])
  logits = router_logits(p, x_nd)
  gates, experts = route(config, logits, replay)
  impl = impl or resolve_impl(config, x_nd.shape[0])
  axes = expert_parallel_axes(config, x_nd.shape[0]) if impl not in ("dense", "gather") else ()
  experts_fn = functools.partial(experts_parallel, axes=axes, impl=impl) if axes else EXPERTS[impl]
  y = experts_fn(p, x_nd, gates, experts, config.num_experts).reshape(*lead, d)
  extras = (experts.reshape(*lead, -1),) if return_routes else ()
  if token_weights is not None:
    extras += (_balance.router_stats(logits, experts, jnp.reshape(token_weights, (-1,))),)
  return (y, *extras) if extras else y
