"""Host-side batch construction: trajectories or SFT demonstrations -> padded micro-batches [K, mb, T].

Every array of a batch is aligned with `tokens` (column t describes token t, as in `Trajectories`):
  tokens          int32    token ids, right padded with `pad_id`
  attention_mask  int32    1 on prompt + response tokens
  loss_mask       int32    1 on tokens that are trained on (model-generated response tokens; SFT: the
                           assistant's own tokens, never tool results or the prompt)
  advantages      float32  per-token advantage (RL)
  old_log_prob    float32  log-prob of token t under the rollout policy (RL; filled by `make_logprob_fn`)
  ref_log_prob    float32  reference-policy log-prob (RL with a KL term)
  sampler_log_prob float32 the engine's log-prob (for sampler/trainer mismatch metrics)
  routes          int32    [.., T, L_sparse, k]: the experts token t went to in each sparse layer in the rollout
                           (routing replay, algo.routing_replay='rollout'), -1 on padding and where none was recorded
Rows are padded up to whole micro-batches with empty rows (all masks 0), which no aggregation counts.
`T` is padded to `seq_len` so one compiled step serves every batch. Batches are numpy until
`shard_batch` puts them on the mesh; in a multi-process run each process keeps the rows its devices hold
(`process_rows`, from the batch sharding's own index map, in any mesh order) and `shard_batch` assembles the global
array.
"""

from __future__ import annotations

import dataclasses

from typing import Iterator, Mapping, Optional, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec

from aepo_jax import parallel
from aepo_jax.parallel import DEFAULT_RULES, logical_to_mesh

_INT_KEYS = ("tokens", "attention_mask", "loss_mask", "segment_ids", "routes")
_FILL = {"routes": -1}  # padding of a key other than tokens (pad_id) and 0

# A batch is [micro-batch index, rows, T, ...]; rows are split over the batch mesh axes, trailing axes (routes'
# L_sparse, k) replicated.
BATCH_LOGICAL_SPEC = PartitionSpec(None, "batch", None)


def _field(traj, name):
  return traj[name] if isinstance(traj, Mapping) else getattr(traj, name)


def micro_batches(
  arrays_nt: Mapping[str, np.ndarray],
  *,
  micro_batch_size: int,
  pad_id: int,
  seq_len: Optional[int] = None,
  rows_multiple: int = 1,
  seq_multiple: int = 64,
) -> dict[str, np.ndarray]:
  """{name: [N, T, ...]} -> {name: [K, micro_batch_size, seq_len, ...]}, K·micro_batch_size a multiple of
  rows_multiple. Trailing axes (routes [N, T, L_sparse, k]) are kept; padding is pad_id for tokens, -1 for routes,
  else 0.

  seq_len: the padded length T (default: the longest row rounded up to `seq_multiple`). Give a fixed
  value in training so every step has the same shape and the update step compiles once.
  rows_multiple: pad N to a multiple of this many rows (micro_batch_size · micro-batches per update).
  """
  if "tokens" not in arrays_nt:
    raise ValueError(f"micro_batches needs a 'tokens' array; got keys {sorted(arrays_nt)}")
  if micro_batch_size < 1:
    raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
  n, t = np.shape(arrays_nt["tokens"])
  for name, x in arrays_nt.items():
    if np.shape(x)[:2] != (n, t):
      raise ValueError(f"batch array {name!r} has shape {np.shape(x)}; every array must be [N={n}, T={t}, ...]")
  if n == 0:
    raise ValueError("micro_batches got 0 rows; there is nothing to train on")
  mask = np.asarray(arrays_nt.get("attention_mask", np.ones((n, t))))
  used_t = int(np.max(np.nonzero(mask.any(0))[0]) + 1) if mask.any() else 1
  if seq_len is None:
    seq_len = -(-used_t // seq_multiple) * seq_multiple
  if used_t > seq_len:
    raise ValueError(
      f"a row holds {used_t} tokens but seq_len={seq_len}; raise seq_len (the config's "
      "maximum sequence length) or shorten the rollouts"
    )
  step_rows = int(np.lcm(micro_batch_size, rows_multiple))
  n_pad = -(-n // step_rows) * step_rows
  out = {}
  for name, x in arrays_nt.items():
    x = np.asarray(x)[:, : min(t, seq_len)]
    dtype = np.int32 if name in _INT_KEYS else np.float32
    fill = pad_id if name == "tokens" else _FILL.get(name, 0)
    padded = np.full((n_pad, seq_len) + x.shape[2:], fill, dtype)
    padded[:n, : x.shape[1]] = x
    out[name] = padded.reshape((n_pad // micro_batch_size, micro_batch_size, seq_len) + x.shape[2:])
  return out


def trajectories_batch(
  traj,
  advantages_bt,
  *,
  micro_batch_size: int,
  pad_id: int,
  seq_len: Optional[int] = None,
  rows_multiple: int = 1,
  ref_log_prob_bt=None,
  layout=None,
) -> dict[str, np.ndarray]:
  """RL batch from rollout `Trajectories` (docs/rollout_contract.md) and per-token advantages [N, T].

  `old_log_prob` is left out: recompute it with `make_logprob_fn` on the device batch (spec §1.5: verl's
  actor recomputes old log-probs; the sampler's are kept as `sampler_log_prob` for mismatch metrics).
  layout: a `_verl_batching.VerlLayout`: the rows in its order, with its per-row `loss_denominator` (every column).
  `routes` [K, mb, T, L_sparse, k] comes along when the trajectories hold them (`routes_btsk`, routing replay).
  """
  tokens = np.asarray(_field(traj, "tokens_bt"))
  arrays = {
    "tokens": tokens,
    "attention_mask": np.asarray(_field(traj, "attention_mask_bt")),
    "loss_mask": np.asarray(_field(traj, "loss_mask_bt")),
    "advantages": np.asarray(advantages_bt, np.float32),
    "sampler_log_prob": np.asarray(_field(traj, "sampler_logprob_bt"), np.float32),
  }
  if ref_log_prob_bt is not None:
    arrays["ref_log_prob"] = np.asarray(ref_log_prob_bt, np.float32)
  routes = traj.get("routes_btsk") if isinstance(traj, Mapping) else getattr(traj, "routes_btsk", None)
  if routes is not None:
    arrays["routes"] = np.asarray(routes, np.int32)
  if layout is not None:
    arrays = {k: v[layout.order] for k, v in arrays.items()}
    arrays["loss_denominator"] = np.broadcast_to(layout.denominator[:, None], tokens.shape).astype(np.float32)
  return micro_batches(
    arrays, micro_batch_size=micro_batch_size, pad_id=pad_id, seq_len=seq_len, rows_multiple=rows_multiple
  )


def sft_example(segments: Sequence[tuple[Sequence[int], bool]]) -> tuple[np.ndarray, np.ndarray]:
  """(tokens, loss_mask) of one demonstration from (token_ids, trained) segments in order.

  Mark the assistant's own turns (reasoning, tool calls, answer, closing tags, EOS) trained=True; the
  prompt and every tool result trained=False, as the cold-start SFT of ARPO/AEPO masks tool outputs.
  """
  if not segments:
    raise ValueError("sft_example got no segments")
  tokens = np.concatenate([np.asarray(ids, np.int32).reshape(-1) for ids, _ in segments])
  mask = np.concatenate([np.full(len(ids), int(bool(trained)), np.int32) for ids, trained in segments])
  if not mask.any():
    raise ValueError("sft_example: no segment is marked trained=True, so the example has no loss tokens")
  return tokens, mask


def pack_rows(lengths: Sequence[int], rows: int, seq_len: int) -> list[list[int]]:
  """Example indices per row: first-fit of the examples, longest first, into `rows` rows of `seq_len` tokens.
  Raises ValueError when they do not fit (the caller names the config knobs)."""
  bins, free = [[] for _ in range(rows)], [seq_len] * rows
  for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    row = next((r for r in range(rows) if free[r] >= lengths[i]), None)
    if row is None:
      raise ValueError(
        f"{len(lengths)} examples of {sum(lengths)} tokens (longest {max(lengths)}) do not fit "
        f"into {rows} rows of {seq_len} tokens"
      )
    bins[row].append(i)
    free[row] -= lengths[i]
  return [sorted(b) for b in bins]


def sft_batch(
  examples: Sequence[tuple[Sequence[int], Sequence[int]]],
  *,
  micro_batch_size: int,
  pad_id: int,
  seq_len: Optional[int] = None,
  rows_multiple: int = 1,
  truncate: bool = False,
  packed_rows: Optional[int] = None,
) -> dict[str, np.ndarray]:
  """SFT batch from (tokens, loss_mask) pairs. `truncate=True` cuts rows longer than seq_len instead of
  raising (an SFT trace is still a valid prefix; an RL trajectory is not, so RL never truncates).

  `packed_rows=R` packs the examples into R rows of `seq_len` (first fit, longest first; needs seq_len) with a
  `segment_ids` array (1, 2, ... per example in its row, 0 on padding): the model attends within each example and
  the loss is the same token mean over the same trained tokens, on fewer padded tokens. ValueError when they do
  not fit."""
  if not examples:
    raise ValueError("sft_batch got no examples")
  if packed_rows and seq_len is None:
    raise ValueError("sft_batch(packed_rows=...) needs seq_len (the length of a packed row)")
  cut = []
  for i, (tok, m) in enumerate(examples):
    tok, m = np.asarray(tok), np.asarray(m)
    if len(tok) != len(m):
      raise ValueError(f"SFT example {i}: tokens ({len(tok)}) and loss_mask ({len(m)}) differ in length")
    if seq_len is not None and len(tok) > seq_len:
      if not truncate:
        raise ValueError(
          f"an SFT example has {len(tok)} tokens but seq_len={seq_len}; raise seq_len or pass truncate=True"
        )
      tok, m = tok[:seq_len], m[:seq_len]
    cut.append((tok, m))
  t = max(len(tok) for tok, _ in cut) if seq_len is None else seq_len
  rows = pack_rows([len(tok) for tok, _ in cut], packed_rows, t) if packed_rows else [[i] for i in range(len(cut))]
  names = ("tokens", "attention_mask", "loss_mask") + (("segment_ids",) if packed_rows else ())
  arrays = {k: np.zeros((len(rows), t), np.int32) for k in names}
  arrays["tokens"][:] = pad_id
  for r, members in enumerate(rows):
    at = 0
    for j, i in enumerate(members, start=1):
      tok, m = cut[i]
      sl = slice(at, at + len(tok))
      arrays["tokens"][r, sl], arrays["loss_mask"][r, sl], arrays["attention_mask"][r, sl] = tok, m, 1
      if packed_rows:
        arrays["segment_ids"][r, sl] = j
      at += len(tok)
  return micro_batches(
    arrays, micro_batch_size=micro_batch_size, pad_id=pad_id, seq_len=seq_len, rows_multiple=rows_multiple
  )


def split_updates(batch: Mapping[str, jax.Array], micro_batches_per_update: int) -> Iterator[dict]:
  """Yields the [M, mb, T] mini-batches (one optimizer update each) of a [K, mb, T] batch, in order."""
  k = next(iter(batch.values())).shape[0]
  if k % micro_batches_per_update:
    raise ValueError(
      f"the batch has {k} micro-batches, not a multiple of micro_batches_per_update="
      f"{micro_batches_per_update}; build it with rows_multiple = micro_batch_size · "
      "micro_batches_per_update"
    )
  for i in range(0, k, micro_batches_per_update):
    yield {name: x[i : i + micro_batches_per_update] for name, x in batch.items()}


def batch_sharding(mesh, rules=DEFAULT_RULES):
  """NamedSharding of every [K, mb, T, ...] batch array: rows over the batch axes ('data', 'fsdp'), the rest
  replicated."""
  return jax.sharding.NamedSharding(mesh, logical_to_mesh(BATCH_LOGICAL_SPEC, rules))


def batch_rows(mesh, rows: int, process: Optional[int] = None, rules=DEFAULT_RULES) -> np.ndarray:
  """The rows (ascending) of a `rows`-row micro-batch that process `process`'s devices hold (default: this process),
  read from the batch sharding's own index map: on a TPU slice's mesh they need not be contiguous (v5p:2x2x2 with
  mesh (1, 4, 2): process 0 holds rows {0-1, 4-5} of 8), and two processes may hold the same rows (a mesh axis that
  replicates the batch spans hosts)."""
  p = jax.process_index() if process is None else process
  index_map = batch_sharding(mesh, rules).devices_indices_map((1, rows, 1))
  held = set()
  for device, index in index_map.items():
    if device.process_index == p:
      held.update(range(*index[1].indices(rows)))
  return np.asarray(sorted(held), np.int64)


def _check_rows(name: str, rows: int, mesh) -> None:
  rows_devices = mesh.shape["data"] * mesh.shape["fsdp"]
  if rows % rows_devices:
    raise ValueError(
      f"batch {name!r}: {rows} rows per micro-batch cannot be split over the "
      f"mesh's data×fsdp = {rows_devices} devices; make micro_batch_size a multiple of it"
    )


def shard_batch(batch_np: Mapping[str, np.ndarray], mesh, rules=DEFAULT_RULES) -> dict[str, jax.Array]:
  """Global device arrays from this process's rows: with several processes each passes [K, r, T], the rows of every
  micro-batch that its devices hold (`process_rows`: `batch_rows` of the global micro-batch, in ascending order);
  on one process the whole batch (a plain device_put)."""
  sharding = batch_sharding(mesh, rules)
  out = {}
  if jax.process_count() == 1:
    for name, x in batch_np.items():
      x = np.asarray(x)
      _check_rows(name, x.shape[1], mesh)
      out[name] = jax.device_put(x, sharding)
    return out
  rows_devices = mesh.shape["data"] * mesh.shape["fsdp"]
  blocks = len(batch_rows(mesh, rows_devices, rules=rules))  # the batch blocks (one row each here) this host holds
  for name, x in batch_np.items():
    x = np.asarray(x)
    if (x.shape[1] * rows_devices) % blocks:
      raise ValueError(
        f"batch {name!r}: {x.shape[1]} local rows per micro-batch are not {blocks} equal blocks (this host's share "
        "of the mesh's data×fsdp devices); pass process_rows(global batch, mesh)"
      )
    rows = x.shape[1] * rows_devices // blocks
    _check_rows(name, rows, mesh)
    held = batch_rows(mesh, rows, rules=rules)
    if len(held) != x.shape[1]:
      raise ValueError(f"batch {name!r}: {x.shape[1]} local rows, but this host's devices hold {len(held)} rows")
    position = np.full((rows,), -1, np.int64)
    position[held] = np.arange(len(held))
    global_shape = (x.shape[0], rows) + x.shape[2:]

    def local(index, x=x, position=position, rows=rows):
      take = position[np.arange(rows)[index[1]]]
      return x[index[0]][:, take][(slice(None), slice(None)) + tuple(index[2:])]

    out[name] = jax.make_array_from_callback(global_shape, sharding, local)
  return out


_ROW_FIELDS = (
  ("tokens_bt", None),
  ("loss_mask_bt", 0),
  ("attention_mask_bt", 0),
  ("sampler_logprob_bt", 0),
  ("sampler_entropy_bt", 0),
  ("prompt_len_b", 0),
  ("response_len_b", 0),
  ("group_id_b", 0),
  ("parent_b", -1),
  ("fork_pos_b", -1),
  ("num_tool_calls_b", 0),
)


def _row_fields(traj) -> tuple:
  """The per-row fields of `traj` and their padding (routes when the rollout recorded them)."""
  return _ROW_FIELDS + ((("routes_btsk", -1),) if getattr(traj, "routes_btsk", None) is not None else ())


def gather_trajectories(traj, rewards_b, *, pad_id: int):
  """(trajectories, rewards) of every host, concatenated in process order, on every host (a few small collectives
  per RL step, none inside a rollout). Each host rolled out its own prompts on its own devices; from here on every
  host sees the same global batch and builds the same micro-batches a single host would, then keeps its share of
  each (`process_rows`). See `merge_hosts` for the layout. One process: unchanged.
  """
  if jax.process_count() == 1:
    return traj, np.asarray(rewards_b)
  from jax.experimental import multihost_utils

  n, t = np.shape(traj.tokens_bt)
  sizes = np.asarray(multihost_utils.process_allgather(np.asarray([n, t], np.int64))).reshape(-1, 2)
  rows, width = int(sizes[:, 0].max()), int(sizes[:, 1].max())
  hosts: list = [dict() for _ in range(len(sizes))]
  fields = [(name, pad_id if fill is None else fill, getattr(traj, name)) for name, fill in _row_fields(traj)]
  for name, fill, x in fields + [("rewards", 0, np.asarray(rewards_b, np.float32))]:
    x = np.asarray(x)
    padded = np.full((rows,) + ((width,) + x.shape[2:] if x.ndim >= 2 else ()), fill, x.dtype)
    padded[tuple(slice(0, k) for k in x.shape)] = x
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape((len(sizes),) + padded.shape)
    for p, host in enumerate(hosts):
      host[name] = every[p, : sizes[p, 0], : sizes[p, 1]] if x.ndim >= 2 else every[p, : sizes[p, 0]]
  stats = parallel.allgather_json(dict(traj.stats))
  parts = [
    dataclasses.replace(traj, stats=s, **{k: v for k, v in h.items() if k != "rewards"}) for h, s in zip(hosts, stats)
  ]
  return merge_hosts(parts, pad_id=pad_id), np.concatenate([h["rewards"] for h in hosts])


def merge_hosts(parts: Sequence, *, pad_id: int):
  """One `Trajectories` from the hosts' own, in process order: group ids and parent rows offset by the earlier
  hosts' (so they stay unique), columns right-padded to the widest host. The per-trajectory text fields are left
  empty; `stats` combine the hosts' (`rollout.policies.combine_stats`: counts summed, maxima maxed, means weighted by
  trajectories)."""
  groups = [int(np.max(tr.group_id_b)) + 1 if len(tr.group_id_b) else 0 for tr in parts]
  rows = [len(tr.group_id_b) for tr in parts]
  group_off, row_off = np.cumsum([0] + groups)[:-1], np.cumsum([0] + rows)[:-1]
  width = max(np.shape(tr.tokens_bt)[1] for tr in parts)
  out = {}
  for name, fill in _row_fields(parts[0]):
    fill = pad_id if fill is None else fill
    xs = []
    for tr, g0, r0 in zip(parts, group_off, row_off):
      x = np.asarray(getattr(tr, name))
      if x.ndim >= 2:
        x = np.concatenate([x, np.full((x.shape[0], width - x.shape[1]) + x.shape[2:], fill, x.dtype)], axis=1)
      if name == "group_id_b":
        x = x + g0
      elif name == "parent_b":
        x = np.where(x >= 0, x + r0, -1)
      xs.append(x)
    out[name] = np.concatenate(xs).astype(np.asarray(getattr(parts[0], name)).dtype)
  from aepo_jax.rollout.policies import combine_stats

  stats = combine_stats([tr.stats for tr in parts])
  return dataclasses.replace(parts[0], stop_reason_b=[], response_text=[], kind_b=[], stats=stats, **out)


def process_rows(batch_np: Mapping[str, np.ndarray], mesh, rules=DEFAULT_RULES) -> dict:
  """The rows of every micro-batch of a global [K, mb, T] batch that this process's devices hold on `mesh`
  (`batch_rows`, in ascending order; `shard_batch` then assembles the global arrays from every process's rows).
  One process: the whole batch."""
  if jax.process_count() == 1:
    return dict(batch_np)
  out = {}
  for k, v in batch_np.items():
    v = np.asarray(v)
    _check_rows(k, v.shape[1], mesh)
    out[k] = v[:, batch_rows(mesh, v.shape[1], rules=rules)]
  return out


def global_value(x: jax.Array) -> np.ndarray:
  """The whole of a (possibly multi-host) global array as numpy, on every host."""
  if jax.process_count() == 1 or x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
