"""verl's dynamic micro-batches (`use_dynamic_bsz`), reproduced as per-row loss weights on our fixed batch shape.

What the released scripts ran (actor.use_dynamic_bsz=True, ppo_max_token_len_per_gpu = 2 x (prompt + response
length), 8 GPUs, trainer.balance_batch=True), read in verl as the official repository ships it
(ARPO/verl_arpo_entropy/verl/):
  1. `ray_trainer._balance_batch`: the step's rows are split over the W data-parallel ranks by
     `get_seqlen_balanced_partitions(seqlens, W, equal_size=True)` (seqlen = prompt + response tokens); rank r takes
     the rows of partition r, in index order.
  2. `dp_actor.update_policy`: each rank cuts its rows into mini-batches of ppo_mini_batch_size x n / W consecutive
     rows; `seqlen_balancing.rearrange_micro_batches` splits mini-batch j into
     min(rows, ceil(tokens / max_token_len)) micro-batches (the count all-reduced to its MAX over the ranks), by
     `get_seqlen_balanced_partitions(..., equal_size=False)`.
  3. Each micro-batch k of rank r contributes `agg_loss(ℓ_k) x n_k / N_r` (n_k its rows, N_r the rank's
     mini-batch rows), and the ranks' gradients are averaged.
So one optimizer step minimises Σ_k (n_k / N) · agg_loss(ℓ_k) over every rank's micro-batches, N the global
mini-batch rows. Which rows share a micro-batch decides each token's weight (a token-mean divides by its own
micro-batch's token count), not the compute layout: `verl_dynamic_layout` gives the row order of our mini-batches
(verl's mini-batch j is ours) and every row's denominator, and the update step divides each row's summed (or, for
seq-mean-token-mean, averaged) loss by it (`objectives.aggregate` with a per-row normalizer). Statistics a loss
takes over the tokens it sees (AEPO's entropy standardisation) stay per physical micro-batch.

`karmarkar_karp` re-implements verl's `seqlen_balancing.karmarkar_karp` (largest differencing method) with its
tie-breaking, so the partitions are verl's own; tests/train/test_verl_batching.py compares them with verl's code.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Sequence

import numpy as np

_TOKEN_MEAN_EPS = 1e-8  # verl agg_loss's masked_mean


def _set_key(s):  # verl's Set.__lt__: by sum, then item count, then the (index, length) items
  return (s[0], len(s[1]), s[1])


class _State:
  """k partial partitions, largest first; the heap pops the state of largest spread first (verl's State.__lt__)."""

  __slots__ = ("sets",)

  def __init__(self, sets):
    self.sets = sorted(sets, key=_set_key, reverse=True)

  @property
  def spread(self) -> int:
    return self.sets[0][0] - self.sets[-1][0]

  def __lt__(self, other) -> bool:
    if self.spread != other.spread:
      return self.spread > other.spread
    return _set_key(self.sets[0]) > _set_key(other.sets[0])

  def merge(self, other) -> None:  # the largest set of one with the smallest of the other, and so on
    k = len(self.sets)
    merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(self.sets, reversed(other.sets))]
    assert len(merged) == k
    self.sets = sorted(merged, key=_set_key, reverse=True)


def karmarkar_karp(lengths: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
  """Indices of `lengths` in k partitions of balanced sums (verl `karmarkar_karp`, same tie-breaking)."""
  ranked = sorted((int(v), i) for i, v in enumerate(lengths))
  heap = []
  if equal_size:
    if len(ranked) % k:
      raise ValueError(f"{len(ranked)} rows cannot be split into {k} partitions of equal size")
    for off in range(0, len(ranked), k):
      heapq.heappush(heap, _State([(v, [(i, v)]) for v, i in ranked[off : off + k]]))
  else:
    for v, i in ranked:
      heapq.heappush(heap, _State([(v, [(i, v)])] + [(0, [])] * (k - 1)))
  while len(heap) > 1:
    a, b = heapq.heappop(heap), heapq.heappop(heap)
    a.merge(b)
    heapq.heappush(heap, a)
  return [[i for i, _ in s[1]] for s in heap[0].sets]


def balanced_partitions(lengths: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
  """verl `get_seqlen_balanced_partitions`: k non-empty partitions, each in index order."""
  if len(lengths) < k:
    raise ValueError(f"{len(lengths)} rows cannot fill {k} partitions")
  parts = [sorted(p) for p in karmarkar_karp(lengths, k, equal_size)]
  if any(not p for p in parts):
    raise ValueError(f"a balanced partition of {len(lengths)} rows into {k} is empty")
  return parts


@dataclasses.dataclass(frozen=True)
class VerlLayout:
  """order: the rows in our mini-batch order ([N], a permutation); denominator: each row's (aligned with `order`):
  its summed loss (per-row mean for seq-mean-token-mean) divided by this is its share of the step's loss;
  micro_batches: verl's micro-batch count per rank, per mini-batch."""

  order: np.ndarray
  denominator: np.ndarray
  micro_batches: np.ndarray


def verl_dynamic_layout(
  seqlen_n: Sequence[int],
  loss_tokens_n: Sequence[int],
  *,
  rows_per_update: int,
  world_size: int,
  max_token_len: int,
  agg: str,
  seq_len: int,
) -> VerlLayout:
  """The row order and per-row loss denominators that make our update equal verl's use_dynamic_bsz update.

  seqlen_n: every row's prompt + response tokens (attention mask sum); loss_tokens_n: its trained tokens;
  rows_per_update: the global mini-batch rows (ppo_mini_batch_size x n); world_size: verl's data-parallel ranks;
  max_token_len: ppo_max_token_len_per_gpu (x the sequence-parallel size); seq_len: the batch width T
  (seq-mean-token-sum-norm divides by it, as `objectives.loss_normalizer` does)."""
  seqlen = np.asarray(seqlen_n, np.int64)
  tokens = np.asarray(loss_tokens_n, np.float64)
  n = len(seqlen)
  if n % rows_per_update or rows_per_update % world_size:
    raise ValueError(
      f"verl's dynamic micro-batches need the step's {n} rows in whole mini-batches of {rows_per_update} rows "
      f"(train.ppo_mini_batch_size x rollout.n), each split evenly over algo.verl_world_size={world_size} ranks"
    )
  if seqlen.max(initial=0) > max_token_len:
    raise ValueError(
      f"a row holds {int(seqlen.max())} tokens, more than algo.verl_max_token_len={max_token_len}: verl asserts "
      "max_token_len >= the sequence length; raise it"
    )
  ranks = balanced_partitions(seqlen.tolist(), world_size, equal_size=True)  # ray_trainer._balance_batch
  per_rank = rows_per_update // world_size
  updates = n // rows_per_update
  order, denominator, counts = [], [], []
  for j in range(updates):
    chunks = [np.asarray(rank[j * per_rank : (j + 1) * per_rank]) for rank in ranks]
    want = max(min(per_rank, math.ceil(int(seqlen[c].sum()) / max_token_len)) for c in chunks)  # all-reduce MAX
    for rows in chunks:
      for part in balanced_partitions(seqlen[rows].tolist(), want, equal_size=False):
        micro = rows[part]
        n_k = len(micro)
        if agg == "token-mean":
          d = rows_per_update * (tokens[micro].sum() + _TOKEN_MEAN_EPS) / n_k
        elif agg in ("seq-mean-token-sum", "seq-mean-token-mean"):
          d = float(rows_per_update)  # (n_k / N_r) / n_k per row, averaged over the ranks
        elif agg == "seq-mean-token-sum-norm":
          d = rows_per_update * float(seq_len) / n_k
        else:
          raise ValueError(f"unknown aggregation mode agg={agg!r}")
        order.extend(micro.tolist())
        denominator.extend([d] * n_k)
      counts.append(want)
  return VerlLayout(np.asarray(order, np.int64), np.asarray(denominator, np.float64), np.asarray(counts, np.int64))
