"""The sparse expert block of Qwen3-MoE: softmax router, top-k, dropless SwiGLU experts (the router's
load-balancing loss: `_balance`).

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
    ragged dot). Faster on CPU at small shapes (docs/performance.md), and a reference;
  * 'gather': each token's k experts' weights gathered, reading only the experts the tokens chose (a decode step's
    few tokens on CPU; its weight gradient is a scatter of N * k weight copies, so not for training).
'auto' (`resolve_impl`): 'gmm' on TPU, on CPU 'gather' for calls of few tokens and 'dense' otherwise, 'ragged'
elsewhere.

Expert parallelism (`experts_parallel`): where the rules table maps the logical axis 'expert' to a mesh axis
(`parallel._mesh.expert_parallel_rules`, e.g. 'fsdp'), each device of that axis holds E / n whole experts (their F
still over 'tensor'). A rules row, not a ModelConfig field, because where a weight lives is the rules' business
everywhere else (parameters, optimizer state and checkpoints follow the same table), and mapping 'expert' to a mesh
axis that already exists needs no new mesh axis, so every mesh and config keeps working; the 'expert' row sits ahead
of 'embed' so it takes the axis before D does. 'ragged' and 'gmm' then run in `jax.shard_map`: each device's
(token, expert) pairs, sorted by expert, go to the device holding their expert by an all-to-all over that axis, run
through its local experts (the same sorted-rows path), come back by the reverse all-to-all and are combined by the
gates. On TPU the exchange is `jax.lax.ragged_all_to_all` (only the pairs move); elsewhere (XLA:CPU has no
ragged-all-to-all) a dense `jax.lax.all_to_all` of one slot per pair for every destination. Either way a device's
receive buffer holds n x (its own pairs), the worst case (every pair of every device to its experts): dropless, at n
times the activation rows of the replicated layout. The tokens must be split over the expert axis (they are: the
batch rows go over data and fsdp); where they are not (too few rows), or with 'dense' (XLA partitions its einsums),
the block runs as without the row.
The router logits are computed in float32 (HF: in the compute dtype), so a bf16 model routes as its float32 self.

Routing replay (R3, arXiv 2510.11370): a forward may be given each token's experts ("routes", [..., L_sparse, k],
the sparse layers in layer order) instead of choosing them, and may return the ones it used: the rollout engine
records them (`Engine(record_routes=True)`) and the update replays them, so a token goes through the experts it went
through when sampled whatever the trainer's numerics (`route`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from aepo_jax import parallel
from aepo_jax.model import _balance
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


def resolve_impl(config: ModelConfig, num_tokens: int | None = None) -> str:
  """The expert computation for `config.moe_impl`; 'auto': on CPU 'gather' for a call of `num_tokens` tokens whose
  (token, expert) pairs are at most half the experts (a decode step's few slots: it reads only those experts'
  weights) and 'dense' otherwise; 'gmm' on TPU (where the compute dtype is one the kernel takes, else 'ragged'),
  whose forward visits only the experts that have rows (megablox `gmm` builds its grid without empty groups);
  'ragged' elsewhere. Measured by bench/moe_decode.py (docs/performance.md)."""
  if config.moe_impl != "auto":
    return config.moe_impl
  platform = _platform()
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
  y = _swiglu_groups(rows, sizes, weights, grouped_matmul)[: n * k]  # [N * k, D], sorted
  y_nkd = jnp.zeros_like(y).at[order].set(y).reshape(n, k, -1)  # back in token order
  return jnp.einsum("nkd,nk->nd", y_nkd, gates_nk.astype(y.dtype))


def _swiglu_groups(rows_md, sizes_e, weights, grouped_matmul):
  """Each expert's SwiGLU on its group of the sorted rows [M, D] (`sizes_e` rows each, in expert order)."""
  wg, wu, wd = weights
  h = jax.nn.silu(grouped_matmul(rows_md, wg, sizes_e)) * grouped_matmul(rows_md, wu, sizes_e)
  return grouped_matmul(h, wd, sizes_e)


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
  tm = gmm_tiling(experts_nk.size, 1, 1, max_tiling)[0]  # the row tile: the padded rows give the same one
  grouped_matmul = _gmm_matmul(x_nd.dtype, max_tiling, interpret)
  out = _sorted_experts(x_nd, gates_nk, experts_nk, (wg, wu, wd), num_experts, grouped_matmul, row_multiple=tm)
  return jax.lax.psum(out, sum_axes) if sum_axes else out


def _gmm_matmul(dtype, max_tiling, interpret: bool):
  """`grouped_matmul(rows [M, K], w [E, K, N'], group_sizes [E]) -> [M, N']` through the Pallas gmm kernel, its
  tiles `gmm_tiling` of each matmul's shape (M a multiple of the row tile).

  A weight whose N' is no multiple of the TPU lane width while K is (the gate/up kernels [E, D, F] with F per chip
  e.g. 768 / 4 = 192) is given to the kernel transposed ([E, N', K], `transpose_rhs`): XLA:TPU stores such an array
  with K minor (no padding of N' to 256), and the kernel's row-major [E, K, N'] operand was then a relayout copy of
  the whole stacked weight on every call (2 x 4.8 GB per chip per decode call at Qwen3-30B-A3B); transposed, the
  operand is the stored bytes."""
  from jax.experimental.pallas.ops.tpu.megablox import gmm  # Pallas: imported when first used

  def grouped_matmul(lhs, w, sizes):
    k, n = w.shape[1], w.shape[2]
    tiling = gmm_tiling(lhs.shape[0], k, n, max_tiling)
    if n % _LANES and not k % _LANES:
      rhs = jnp.swapaxes(w, 1, 2)
      return gmm(
        lhs, rhs, sizes, preferred_element_type=lhs.dtype, tiling=tiling, transpose_rhs=True, interpret=interpret
      )
    return gmm(lhs, w, sizes, preferred_element_type=lhs.dtype, tiling=tiling, interpret=interpret)

  return _at_default_precision(grouped_matmul) if dtype == jnp.bfloat16 else grouped_matmul


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


def experts_gather(p, x_nd, gates_nk, experts_nk, num_experts: int):
  """The same sum with each token's k experts' weights gathered ([N, k, D, F] each): reads N * k experts' weights
  (at most), not all E, and does k of E experts' FLOPs without a sort. For a decode step's few tokens; its weight
  gradient is a scatter-add of N * k copies of an expert's weights, so never for training."""
  w = p["experts"]
  take = lambda name: jnp.take(w[name]["kernel"], experts_nk, axis=0).astype(x_nd.dtype)  # noqa: E731
  h = jax.nn.silu(jnp.einsum("nd,nkdf->nkf", x_nd, take("gate_proj")))
  h = h * jnp.einsum("nd,nkdf->nkf", x_nd, take("up_proj"))
  y = jnp.einsum("nkf,nkfd->nkd", h, take("down_proj"))
  return jnp.einsum("nkd,nk->nd", y, gates_nk.astype(y.dtype))


EXPERTS = {"gmm": experts_gmm, "ragged": experts_ragged, "dense": experts_dense, "gather": experts_gather}


# ---------------------------------------------------------------------------------------------------------
# Expert parallelism: the experts split over a mesh axis, each (token, expert) pair sent to its expert and back.
# ---------------------------------------------------------------------------------------------------------
def _axis_names(axes) -> tuple:
  return () if axes is None else (axes if isinstance(axes, tuple) else (axes,))


def expert_parallel_axes(config: ModelConfig, num_tokens: int) -> tuple:
  """The mesh axes the experts are split over under the current `parallel.sharding_context` (its rules' 'expert'
  row, axes of size 1 left out) when the `num_tokens` rows are split over them too; () where the block runs as
  without expert parallelism (no context, the row None, E not a multiple of the axes, rows not split over them)."""
  mesh = parallel.current_mesh()
  d, e, f = config.hidden_size, config.num_experts, config.moe_intermediate_size
  spec = parallel.activation_spec((e, d, f), ("expert", "embed", "mlp"))
  if spec is None:
    return ()
  axes = tuple(a for a in _axis_names(spec[0]) if mesh.shape[a] > 1)
  rows = parallel.activation_spec((num_tokens, d), ("activation_batch", None))[0]
  return axes if axes and set(axes) <= set(_axis_names(rows)) else ()


def experts_parallel(
  p,
  x_nd,
  gates_nk,
  experts_nk,
  num_experts: int,
  *,
  axes: tuple,
  impl: str = "ragged",
  exchange: str = "",
  max_tiling=GMM_TILING,
  interpret=None,
):
  """The same sum with the experts split over the mesh axes `axes` (`expert_parallel_axes`), in `jax.shard_map`
  under the current `parallel.sharding_context`: each device's pairs go to their experts' device and back
  (`_exchange_dense` / `_exchange_ragged`), F over the rules' 'mlp' axes, the partial down projections summed.

  impl: the local experts' computation, 'ragged' (`jax.lax.ragged_dot`) or 'gmm' (the Pallas kernel; `interpret`
  and `max_tiling` as in `experts_gmm`); exchange: 'ragged' (`jax.lax.ragged_all_to_all`, the default on TPU) or
  'dense' (`jax.lax.all_to_all`, the default elsewhere)."""
  if impl not in ("ragged", "gmm"):
    raise ValueError(f"expert parallelism runs the local experts with 'ragged' or 'gmm', not {impl!r}.")
  if impl == "gmm" and jnp.dtype(x_nd.dtype).name not in GMM_DTYPES:
    raise ValueError(f"moe_impl='gmm': the kernel takes {GMM_DTYPES}, not {x_nd.dtype}; use 'ragged' or 'dense'.")
  exchange = exchange or ("ragged" if _platform() == "tpu" else "dense")
  if exchange not in ("ragged", "dense"):
    raise ValueError(f"exchange {exchange!r}: 'ragged' (ragged_all_to_all) or 'dense' (all_to_all).")
  mesh = parallel.current_mesh()
  weights = _expert_weights(p, x_nd.dtype)
  rows = parallel.activation_spec(x_nd.shape, ("activation_batch", None))[0]
  hidden = parallel.activation_spec(weights[0].shape, ("expert", "embed", "mlp"))[2]  # None where F does not divide
  n = int(np.prod([mesh.shape[a] for a in axes]))
  if impl == "gmm":
    interpret = _platform() != "tpu" if interpret is None else interpret
    grouped_matmul = _gmm_matmul(x_nd.dtype, max_tiling, interpret)
    local_rows = x_nd.shape[0] // int(np.prod([mesh.shape[a] for a in _axis_names(rows)]))
    row_multiple = gmm_tiling(n * local_rows * experts_nk.shape[1], 1, 1, max_tiling)[0]
  else:
    grouped_matmul, row_multiple = jax.lax.ragged_dot, 1
  local = functools.partial(
    _experts_parallel_local,
    num_experts=num_experts,
    axes=axes,
    exchange=_exchange_ragged if exchange == "ragged" else _exchange_dense,
    grouped_matmul=grouped_matmul,
    row_multiple=row_multiple,
    sum_axes=hidden,
  )
  tokens, up, down = PartitionSpec(rows, None), PartitionSpec(axes, None, hidden), PartitionSpec(axes, hidden, None)
  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(tokens, tokens, tokens, up, up, down),
    out_specs=tokens,
    check_vma=impl != "gmm",  # the Pallas call's output declares no varying mesh axes; the gradients are tested equal
  )(x_nd, gates_nk, experts_nk, *weights)


class _Plan(NamedTuple):
  """Who sends what to whom, on one device of the expert axes (n devices, E_l experts each)."""

  me: jax.Array  # this device's index along the expert axes
  n: int
  num_local: int  # E_l
  token: jax.Array  # [P] the token of each of this device's pairs, sorted by expert
  device: jax.Array  # [P] the device holding each sorted pair's expert
  pairs_ss: jax.Array  # [n, n] pairs device s sends to device d
  mine_se: jax.Array  # [n, E_l] pairs device s sends to each of this device's experts


def _experts_parallel_local(
  x_nd, gates_nk, experts_nk, wg, wu, wd, *, num_experts, axes, exchange, grouped_matmul, row_multiple, sum_axes
):
  """One device's part: its tokens x [N, D] with their gates and (global) experts [N, k], its E_l = E / n experts
  [E_l, D, F'] (F' = F or its shard over `sum_axes`)."""
  num_local = wg.shape[0]
  n = num_experts // num_local
  me = jax.lax.axis_index(axes)
  flat = experts_nk.reshape(-1)
  order = jnp.argsort(flat, stable=True)  # pair order sorted by expert, hence by the device holding it
  counts_se = jax.lax.all_gather(jnp.bincount(flat, length=num_experts).astype(jnp.int32), axes)  # [n, E] pairs
  plan = _Plan(
    me=me,
    n=n,
    num_local=num_local,
    token=order // experts_nk.shape[1],
    device=flat[order] // num_local,
    pairs_ss=counts_se.reshape(n, n, num_local).sum(-1),
    mine_se=jax.lax.dynamic_slice_in_dim(counts_se, me * num_local, num_local, axis=1),
  )
  run = functools.partial(
    _local_experts, weights=(wg, wu, wd), num_local=num_local, grouped_matmul=grouped_matmul, row_multiple=row_multiple
  )
  y = exchange(x_nd, plan, run, axes)  # [P, D], sorted pairs
  y_nkd = jnp.zeros_like(y).at[order].set(y).reshape(*experts_nk.shape, -1)  # back in token order
  out = jnp.einsum("nkd,nk->nd", y_nkd, gates_nk.astype(y.dtype))
  return jax.lax.psum(out, sum_axes) if sum_axes else out


def _exchange_dense(x_nd, plan, run, axes):
  """The sorted pairs' outputs [P, D] through a dense all-to-all: to each device a block of P slots (the worst
  case: all P pairs to it), its pairs first; block s of the receive buffer [n * P, D] came from device s, its rows
  sorted by my local expert (`plan.mine_se[s]` of each), then empty slots."""
  pairs = plan.token.shape[0]
  send = plan.pairs_ss[plan.me]
  start = jnp.cumsum(send) - send  # where each destination's pairs start among the sorted ones
  slot = jnp.arange(plan.n * pairs)
  dst, r = slot // pairs, slot % pairs
  src = plan.token[jnp.minimum(start[dst] + r, pairs - 1)]
  buf = jnp.where((r < send[dst])[:, None], x_nd[src], 0)
  recv = jax.lax.all_to_all(buf, axes, 0, 0, tiled=True)
  ends = jnp.cumsum(plan.mine_se, axis=1)  # [n, E_l]
  ids = jax.vmap(lambda e: jnp.searchsorted(e, jnp.arange(pairs), side="right"))(ends).reshape(-1)  # E_l: empty
  back = jax.lax.all_to_all(run(recv, ids.astype(jnp.int32)), axes, 0, 0, tiled=True)
  return back[plan.device * pairs + jnp.arange(pairs) - start[plan.device]]


def _exchange_ragged(x_nd, plan, run, axes):
  """The sorted pairs' outputs [P, D] through `jax.lax.ragged_all_to_all`: only the pairs move; the receive buffer
  [n * P, D] holds device 0's pairs for me, then device 1's, ... (each sorted by my local expert), then zeros."""
  pairs = plan.token.shape[0]
  send, recv_sizes = plan.pairs_ss[plan.me], plan.pairs_ss[:, plan.me]
  start = jnp.cumsum(send) - send  # where each destination's pairs start among my sorted ones
  recv_start = jnp.cumsum(recv_sizes) - recv_sizes  # where each source's pairs start in my receive buffer
  at_dst = (jnp.cumsum(plan.pairs_ss, axis=0) - plan.pairs_ss)[plan.me]  # where mine start in each receive buffer
  at_src = (jnp.cumsum(plan.pairs_ss, axis=1) - plan.pairs_ss)[:, plan.me]  # where each source's for me start
  rows = x_nd[plan.token]
  a2a = jax.lax.ragged_all_to_all  # looked up when called (a test may stand in for it where XLA lacks it)
  recv = a2a(
    rows, jnp.zeros((plan.n * pairs, rows.shape[1]), rows.dtype), start, send, at_dst, recv_sizes, axis_name=axes
  )
  group = jnp.searchsorted(jnp.cumsum(plan.mine_se.reshape(-1)), jnp.arange(plan.n * pairs), side="right")
  ids = jnp.where(group < plan.n * plan.num_local, group % plan.num_local, plan.num_local).astype(jnp.int32)
  y = run(recv, ids)
  return a2a(y, jnp.zeros_like(rows), recv_start, recv_sizes, at_src, send, axis_name=axes)


def _local_experts(rows_rd, ids_r, *, weights, num_local: int, grouped_matmul, row_multiple: int):
  """Each received row through its local expert `ids_r` (num_local: an empty slot, output 0), in row order. The
  empty slots sort last, outside every group: the grouped matmul skips them (most of the worst-case buffer), and
  whatever it leaves there, forward or backward, is masked."""
  r = rows_rd.shape[0]
  order = jnp.argsort(ids_r, stable=True)
  sizes = jnp.bincount(ids_r, length=num_local).astype(jnp.int32)  # the empty slots' id is not counted
  valid = (jnp.arange(r) < jnp.sum(sizes))[:, None]
  rows = jnp.where(valid, rows_rd[order], 0)
  pad = _round_up(r, row_multiple) - r
  if pad:
    rows = jnp.pad(rows, ((0, pad), (0, 0)))
  y = jnp.where(valid, _swiglu_groups(rows, sizes, weights, grouped_matmul)[:r], 0)
  return jnp.zeros_like(y).at[order].set(y)


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
