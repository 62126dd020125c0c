"""Expert parallelism (`experts_parallel`): where the rules table maps the logical axis 'expert' to a mesh axis
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
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from aepo_jax import parallel
from aepo_jax.model._config import GMM_DTYPES, ModelConfig
from aepo_jax.model._experts import (
  GMM_TILING,
  expert_weights,
  gmm_matmul,
  round_up,
  swiglu_groups,
  gmm_tiling,
)


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
  exchange = exchange or ("ragged" if parallel.current_platform() == "tpu" else "dense")
  if exchange not in ("ragged", "dense"):
    raise ValueError(f"exchange {exchange!r}: 'ragged' (ragged_all_to_all) or 'dense' (all_to_all).")
  mesh = parallel.current_mesh()
  weights = expert_weights(p, x_nd.dtype)
  rows = parallel.activation_spec(x_nd.shape, ("activation_batch", None))[0]
  hidden = parallel.activation_spec(weights[0].shape, ("expert", "embed", "mlp"))[2]  # None where F does not divide
  n = int(np.prod([mesh.shape[a] for a in axes]))
  if impl == "gmm":
    interpret = parallel.current_platform() != "tpu" if interpret is None else interpret
    grouped_matmul = gmm_matmul(x_nd.dtype, max_tiling, interpret)
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
  pad = round_up(r, row_multiple) - r
  if pad:
    rows = jnp.pad(rows, ((0, pad), (0, 0)))
  y = jnp.where(valid, swiglu_groups(rows, sizes, weights, grouped_matmul)[:r], 0)
  return jnp.zeros_like(y).at[order].set(y)
