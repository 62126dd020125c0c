"""The sparse expert block of Qwen3-MoE: softmax router, top-k, dropless SwiGLU experts; and the router's
load-balancing loss.

Parameters (one layer, below its `mlp` group; the names are the HF checkpoint's, the expert weights stacked):
  gate    {kernel [D, E]}                          the router (HF `mlp.gate.weight` [E, D])
  experts {gate_proj, up_proj {kernel [E, D, F]}, down_proj {kernel [E, F, D]}}
                                                   (HF `mlp.experts.{e}.{gate,up,down}_proj.weight`)

Routing (HF `Qwen3MoeTopKRouter`): probabilities = softmax(x · gate) in float32, each token's top k experts, their
probabilities renormalised to sum to 1 when `norm_topk_prob`; the output is the gate-weighted sum of the k experts'
SwiGLU outputs. Every token reaches its k experts (dropless: no capacity, no token dropped). Three computations of
the same sum (`ModelConfig.moe_impl`, tested equal):
  * 'gmm': the N * k (token, expert) pairs sorted by expert, each expert's rows one group of the grouped matmul of
    JAX's Pallas TPU library (`jax.experimental.pallas.ops.tpu.megablox.gmm`; the weight gradient is its transposed
    kernel `tgmm`), k of E experts' FLOPs. The kernel's terms: float32 or bfloat16 operands (bfloat16 ones traced at
    the default matmul precision, the only one Mosaic takes for them); a row count that is a multiple of its row
    tile (the sorted rows are padded with zero rows counted in the last expert's group: `_sorted_experts`); tiles
    `GMM_TILING` clamped to each matmul's shape (`gmm_tiling`). Off TPU the kernel runs in Pallas's interpret mode
    (slow; for tests on CPU). Mosaic kernels do not partition: under a multi-device `parallel.sharding_context` the
    block runs inside `jax.shard_map`, tokens over the rules' batch axes, the experts' hidden units F over theirs
    ('tensor'), the partial down projections summed over that axis;
  * 'ragged': the same sorted rows through `jax.lax.ragged_dot` (XLA's own lowering);
  * 'dense': every expert on every token, combined by the gates (E / k times the FLOPs; no sort, gather or
    ragged dot). Faster on CPU at small shapes (docs/performance.md), and a reference.
'auto' (`resolve_impl`): 'gmm' on TPU, 'dense' on CPU, 'ragged' elsewhere.
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
from jax.sharding import PartitionSpec

from aepo_jax import parallel
from aepo_jax.model._config import GMM_DTYPES, ModelConfig

# The grouped matmul's largest tiles (rows, contracted dim, output dim), clamped to each matmul's shape by
# `gmm_tiling`. Their VMEM fits v5e and v6e: Qwen3-30B-A3B's block (bfloat16, 4,096 tokens, F over tensor=4)
# compiles there, forward and backward (docs/performance.md).
GMM_TILING = (512, 1024, 1024)
_SUBLANES, _LANES = 16, 128  # bfloat16's packed [16, 128] TPU tile: row tiles are multiples of 16, others of 128


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


def _platform() -> str:
  """The platform the block is traced for: the `parallel.sharding_context` mesh's (a TPU slice compiled on a CPU
  host included), else the default backend's."""
  mesh = parallel.current_mesh()
  return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def resolve_impl(config: ModelConfig) -> str:
  """The expert computation for `config.moe_impl`; 'auto': 'dense' on CPU, 'gmm' on TPU (where the compute dtype
  is one the kernel takes, else 'ragged'), 'ragged' elsewhere."""
  if config.moe_impl != "auto":
    return config.moe_impl
  platform = _platform()
  if platform == "cpu":
    return "dense"
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


def _expert_weights(p, dtype):
  w = p["experts"]
  return tuple(w[n]["kernel"].astype(dtype) for n in ("gate_proj", "up_proj", "down_proj"))


def _sorted_experts(x_nd, gates_nk, experts_nk, weights, num_experts: int, grouped_matmul, row_multiple: int = 1):
  """sum_j gates[n, j] * expert_{experts[n, j]}(x[n]) over the N * k (token, expert) pairs sorted by expert, each
  expert's rows one group of `grouped_matmul(rows [M, K], w [E, K, N'], group_sizes [E] int32) -> [M, N']`.

  `row_multiple`: the rows are padded with zero rows to a multiple of it, counted in the last expert's group, so
  every row belongs to a group (the gmm kernel leaves rows outside every group unwritten: their values, and their
  gradients through silu, would be whatever the buffer held); a zero row adds nothing to any gradient."""
  n, k = experts_nk.shape
  wg, wu, wd = weights
  flat = experts_nk.reshape(-1)
  order = jnp.argsort(flat, stable=True)  # pair order sorted by expert
  rows = x_nd[order // k]  # [N * k, D]: token n's pairs are n * k .. n * k + k - 1
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  pad = _round_up(n * k, row_multiple) - n * k
  if pad:
    rows, sizes = jnp.pad(rows, ((0, pad), (0, 0))), sizes.at[-1].add(pad)
  h = jax.nn.silu(grouped_matmul(rows, wg, sizes)) * grouped_matmul(rows, wu, sizes)
  y = grouped_matmul(h, wd, sizes)[: n * k]  # [N * k, D], sorted
  y_nkd = jnp.zeros_like(y).at[order].set(y).reshape(n, k, -1)  # back in token order
  return jnp.einsum("nkd,nk->nd", y_nkd, gates_nk.astype(y.dtype))


def experts_ragged(p, x_nd, gates_nk, experts_nk, num_experts: int):
  """sum_j gates[n, j] * expert_{experts[n, j]}(x[n]) through `jax.lax.ragged_dot` over rows sorted by expert."""
  weights = _expert_weights(p, x_nd.dtype)
  return _sorted_experts(x_nd, gates_nk, experts_nk, weights, num_experts, jax.lax.ragged_dot)


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def gmm_tiling(m: int, k: int, n: int, max_tiling=GMM_TILING) -> tuple:
  """(tm, tk, tn) for a grouped [m, k] x [E, k, n] matmul: `max_tiling` clamped to the shape rounded up to the TPU
  tile (rows to 16, k and n to 128). A k or n tile past the array's end is allowed: the kernel masks the partial
  contracted tile and drops writes past n. The rows must be padded to a multiple of tm (`_sorted_experts`)."""
  tm, tk, tn = max_tiling
  if tm % _SUBLANES or tk % _LANES or tn % _LANES:
    raise ValueError(f"gmm tiling {max_tiling}: rows must be a multiple of {_SUBLANES}, k and n of {_LANES}.")
  return min(tm, _round_up(max(m, 1), _SUBLANES)), min(tk, _round_up(k, _LANES)), min(tn, _round_up(n, _LANES))


def _at_default_precision(grouped_matmul):
  """`grouped_matmul(lhs, w, sizes)` with its forward and backward kernels traced at jax_default_matmul_precision
  'default'. Mosaic refuses bfloat16 operands at 'highest' (an fp32 contract precision: "Bad lhs type"), and the
  setting means nothing for them (bf16 x bf16 products are exact in the kernel's float32 accumulator). The backward
  is traced where the caller differentiates, outside any context set here: hence the custom_vjp."""
  default = functools.partial(jax.default_matmul_precision, "default")

  @jax.custom_vjp
  def fn(lhs, w, sizes):
    with default():
      return grouped_matmul(lhs, w, sizes)

  def fwd(lhs, w, sizes):
    with default():
      return jax.vjp(lambda lhs, w: grouped_matmul(lhs, w, sizes), lhs, w)  # (out, the vjp: its residuals)

  def bwd(vjp, g):
    with default():
      return (*vjp(g), None)

  fn.defvjp(fwd, bwd)
  return fn


def _experts_gmm_local(x_nd, gates_nk, experts_nk, wg, wu, wd, *, num_experts, max_tiling, interpret, sum_axes):
  """The gmm block on one device's tokens and hidden units (all F, or its shard); `sum_axes`: the mesh axes F is
  split over, whose partial down projections are summed."""
  from jax.experimental.pallas.ops.tpu.megablox import gmm  # Pallas: imported when first used

  tm = gmm_tiling(experts_nk.size, 1, 1, max_tiling)[0]  # the row tile: the padded rows give the same one

  def grouped_matmul(lhs, w, sizes):
    tiling = gmm_tiling(lhs.shape[0], w.shape[1], w.shape[2], max_tiling)
    return gmm(lhs, w, sizes, preferred_element_type=lhs.dtype, tiling=tiling, interpret=interpret)

  if x_nd.dtype == jnp.bfloat16:
    grouped_matmul = _at_default_precision(grouped_matmul)
  out = _sorted_experts(x_nd, gates_nk, experts_nk, (wg, wu, wd), num_experts, grouped_matmul, row_multiple=tm)
  return jax.lax.psum(out, sum_axes) if sum_axes else out


def experts_gmm(p, x_nd, gates_nk, experts_nk, num_experts: int, *, max_tiling=GMM_TILING, interpret=None):
  """The same sum through the Pallas TPU grouped matmul over rows sorted by expert (float32 or bfloat16 x).
  `interpret`: Pallas's interpret mode (default: off TPU); `max_tiling`: see `gmm_tiling`."""
  if jnp.dtype(x_nd.dtype).name not in GMM_DTYPES:
    raise ValueError(f"moe_impl='gmm': the kernel takes {GMM_DTYPES}, not {x_nd.dtype}; use 'ragged' or 'dense'.")
  weights = _expert_weights(p, x_nd.dtype)
  interpret = _platform() != "tpu" if interpret is None else interpret
  local = functools.partial(_experts_gmm_local, num_experts=num_experts, max_tiling=max_tiling, interpret=interpret)
  rows = parallel.activation_spec(x_nd.shape, ("activation_batch", None))
  if rows is None:  # one device, or outside a step
    return local(x_nd, gates_nk, experts_nk, *weights, sum_axes=None)
  hidden = parallel.activation_spec(weights[0].shape, (None, None, "mlp"))[2]  # None where F does not divide
  tokens, up, down = PartitionSpec(rows[0], None), PartitionSpec(None, None, hidden), PartitionSpec(None, hidden, None)
  return jax.shard_map(
    functools.partial(local, sum_axes=hidden),
    mesh=parallel.current_mesh(),
    in_specs=(tokens, tokens, tokens, up, up, down),
    out_specs=tokens,
    check_vma=False,  # the Pallas call's output declares no varying mesh axes; the gradients are tested equal
  )(x_nd, gates_nk, experts_nk, *weights)


def experts_dense(p, x_nd, gates_nk, experts_nk, num_experts: int):
  """The same sum with every expert on every token, combined by the [N, E] gates (0 off the top k)."""
  wg, wu, wd = _expert_weights(p, x_nd.dtype)
  combine_ne = jnp.einsum("nk,nke->ne", gates_nk, jax.nn.one_hot(experts_nk, num_experts, dtype=gates_nk.dtype))
  h = jax.nn.silu(jnp.einsum("nd,edf->enf", x_nd, wg)) * jnp.einsum("nd,edf->enf", x_nd, wu)
  y = jnp.einsum("enf,efd->end", h, wd)
  return jnp.einsum("end,ne->nd", y, combine_ne.astype(y.dtype))


EXPERTS = {"gmm": experts_gmm, "ragged": experts_ragged, "dense": experts_dense}


def moe(config: ModelConfig, p, x, impl: str = "", *, routes=None, return_routes: bool = False):
  """The sparse block on x [..., D] in x's dtype: route, then the experts (`impl`, default `resolve_impl`).

  routes [..., k]: replayed experts (`route`'s replay_nk); return_routes: also return the experts used [..., k]."""
  lead, d = x.shape[:-1], x.shape[-1]
  x_nd = x.reshape(-1, d)
  replay = None if routes is None else routes.reshape(-1, routes.shape[-1])
  gates, experts = route(config, router_logits(p, x_nd), replay)
  y = EXPERTS[impl or resolve_impl(config)](p, x_nd, gates, experts, config.num_experts).reshape(*lead, d)
  return (y, experts.reshape(*lead, -1)) if return_routes else y


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
