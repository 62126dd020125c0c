"""The dropless expert computations of the sparse block (`_moe`): given each token's k experts and gates, the
gate-weighted sum of the k experts' SwiGLU outputs. Four computations of the same sum (`ModelConfig.moe_impl`,
tested equal):
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
'auto' (`_moe.resolve_impl`): 'gmm' on TPU, on CPU 'gather' for calls of few tokens and 'dense' otherwise, 'ragged'
elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from aepo_jax import parallel
from aepo_jax.model._config import GMM_DTYPES

# The grouped matmul's largest tiles (rows, contracted dim, output dim), clamped to each matmul's shape by
# `gmm_tiling`. Their VMEM fits v5e and v6e: Qwen3-30B-A3B's block (bfloat16, 4,096 tokens, F over tensor=4)
# compiles there, forward and backward (docs/performance.md).
GMM_TILING = (512, 1024, 1024)
_SUBLANES, _LANES = 16, 128  # bfloat16's packed [16, 128] TPU tile: row tiles are multiples of 16, others of 128


def expert_weights(p, dtype):
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
  pad = round_up(n * k, row_multiple) - n * k
  if pad:
    rows, sizes = jnp.pad(rows, ((0, pad), (0, 0))), sizes.at[-1].add(pad)
  y = swiglu_groups(rows, sizes, weights, grouped_matmul)[: n * k]  # [N * k, D], sorted
  y_nkd = jnp.zeros_like(y).at[order].set(y).reshape(n, k, -1)  # back in token order
  return jnp.einsum("nkd,nk->nd", y_nkd, gates_nk.astype(y.dtype))


def swiglu_groups(rows_md, sizes_e, weights, grouped_matmul):
  """Each expert's SwiGLU on its group of the sorted rows [M, D] (`sizes_e` rows each, in expert order)."""
  wg, wu, wd = weights
  h = jax.nn.silu(grouped_matmul(rows_md, wg, sizes_e)) * grouped_matmul(rows_md, wu, sizes_e)
  return grouped_matmul(h, wd, sizes_e)


def experts_ragged(p, x_nd, gates_nk, experts_nk, num_experts: int):
  """sum_j gates[n, j] * expert_{experts[n, j]}(x[n]) through `jax.lax.ragged_dot` over rows sorted by expert."""
  weights = expert_weights(p, x_nd.dtype)
  return _sorted_experts(x_nd, gates_nk, experts_nk, weights, num_experts, jax.lax.ragged_dot)


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def gmm_tiling(m: int, k: int, n: int, max_tiling=GMM_TILING) -> tuple:
  """(tm, tk, tn) for a grouped [m, k] x [E, k, n] matmul: `max_tiling` clamped to the shape rounded up to the TPU
  tile (rows to 16, k and n to 128). A k or n tile past the array's end is allowed: the kernel masks the partial
  contracted tile and drops writes past n. The rows must be padded to a multiple of tm (`_sorted_experts`)."""
  tm, tk, tn = max_tiling
  if tm % _SUBLANES or tk % _LANES or tn % _LANES:
    raise ValueError(f"gmm tiling {max_tiling}: rows must be a multiple of {_SUBLANES}, k and n of {_LANES}.")
  return min(tm, round_up(max(m, 1), _SUBLANES)), min(tk, round_up(k, _LANES)), min(tn, round_up(n, _LANES))


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
  grouped_matmul = gmm_matmul(x_nd.dtype, max_tiling, interpret)
  out = _sorted_experts(x_nd, gates_nk, experts_nk, (wg, wu, wd), num_experts, grouped_matmul, row_multiple=tm)
  return jax.lax.psum(out, sum_axes) if sum_axes else out


def gmm_matmul(dtype, max_tiling, interpret: bool):
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
  weights = expert_weights(p, x_nd.dtype)
  interpret = parallel.current_platform() != "tpu" if interpret is None else interpret
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
  wg, wu, wd = expert_weights(p, x_nd.dtype)
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
