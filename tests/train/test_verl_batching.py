"""verl's dynamic micro-batches (use_dynamic_bsz) against verl's own code on the same inputs.

`_verl_*` below are verl's functions as the official repository ships them (ARPO/verl_arpo_entropy/verl/utils/
seqlen_balancing.py: karmarkar_karp, get_seqlen_balanced_partitions, rearrange_micro_batches' partition count;
verl/trainer/ppo/ray_trainer.py: _balance_batch; verl/workers/actor/dp_actor.py: update_policy's micro-batch
weighting; verl/trainer/ppo/core_algos.py: agg_loss), vendored under verl's Apache License 2.0 (Copyright 2024
Bytedance Ltd. and/or its affiliates), with torch replaced by plain Python / numpy and nothing else changed.
"""

from __future__ import annotations

import heapq
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aepo_jax import objectives
from aepo_jax.train._batch import micro_batches
from aepo_jax.train._verl_batching import balanced_partitions, karmarkar_karp, verl_dynamic_layout

# ---- vendored from verl (Apache-2.0) ----------------------------------------------------------------------------


def _verl_karmarkar_karp(seqlen_list, k_partitions, equal_size):
  class Set:
    def __init__(self) -> None:
      self.sum = 0
      self.items = []

    def add(self, idx, val):
      self.items.append((idx, val))
      self.sum += val

    def merge(self, other):
      for idx, val in other.items:
        self.items.append((idx, val))
        self.sum += val

    def __lt__(self, other):
      if self.sum != other.sum:
        return self.sum < other.sum
      if len(self.items) != len(other.items):
        return len(self.items) < len(other.items)
      return self.items < other.items

  class State:
    def __init__(self, items, k) -> None:
      self.k = k
      self.sets = [Set() for _ in range(k)]
      assert len(items) in [1, k], f"{len(items)} not in [1, {k}]"
      for i, (idx, seqlen) in enumerate(items):
        self.sets[i].add(idx=idx, val=seqlen)
      self.sets = sorted(self.sets, reverse=True)

    def get_partitions(self):
      return [[idx for idx, _ in s.items] for s in self.sets]

    def merge(self, other):
      for i in range(self.k):
        self.sets[i].merge(other.sets[self.k - 1 - i])
      self.sets = sorted(self.sets, reverse=True)

    @property
    def spread(self):
      return self.sets[0].sum - self.sets[-1].sum

    def __lt__(self, other):
      if self.spread != other.spread:
        return self.spread > other.spread
      return self.sets[0] > other.sets[0]

  sorted_seqlen_list = sorted([(seqlen, i) for i, seqlen in enumerate(seqlen_list)])
  states_pq = []
  if equal_size:
    for offset in range(0, len(sorted_seqlen_list), k_partitions):
      items = []
      for i in range(k_partitions):
        seqlen, idx = sorted_seqlen_list[offset + i]
        items.append((idx, seqlen))
      heapq.heappush(states_pq, State(items=items, k=k_partitions))
  else:
    for seqlen, idx in sorted_seqlen_list:
      heapq.heappush(states_pq, State(items=[(idx, seqlen)], k=k_partitions))
  while len(states_pq) > 1:
    state0 = heapq.heappop(states_pq)
    state1 = heapq.heappop(states_pq)
    state0.merge(state1)
    heapq.heappush(states_pq, state0)
  return states_pq[0].get_partitions()


def _verl_balanced_partitions(seqlen_list, k_partitions, equal_size):
  partitions = _verl_karmarkar_karp(seqlen_list, k_partitions, equal_size)
  return [sorted(p) for p in partitions]


def _verl_agg_loss(loss_mat, loss_mask, loss_agg_mode):
  """core_algos.agg_loss in float64."""
  if loss_agg_mode == "token-mean":
    return (loss_mat * loss_mask).sum() / (loss_mask.sum() + 1e-8)
  if loss_agg_mode == "seq-mean-token-sum":
    return np.mean(np.sum(loss_mat * loss_mask, axis=-1))
  if loss_agg_mode == "seq-mean-token-mean":
    return np.mean(np.sum(loss_mat * loss_mask, axis=-1) / np.sum(loss_mask, axis=-1))
  if loss_agg_mode == "seq-mean-token-sum-norm":
    return np.sum(np.sum(loss_mat * loss_mask, axis=-1)) / loss_mask.shape[-1]
  raise ValueError(loss_agg_mode)


def _verl_update_losses(seqlen, loss_bt, mask_bt, *, world_size, mini_rows, max_token_len, agg):
  """The loss each optimizer step of verl's update minimises (summed over ranks / world_size, as FSDP averages
  the ranks' gradients): _balance_batch, then per rank dp_actor.update_policy with use_dynamic_bsz."""
  order = [j for p in _verl_balanced_partitions(seqlen.tolist(), world_size, equal_size=True) for j in p]
  per_rank = len(order) // world_size
  ranks = [order[r * per_rank : (r + 1) * per_rank] for r in range(world_size)]  # the dispatch's equal chunks
  mini = mini_rows // world_size  # ppo_mini_batch_size after normalisation by the world size
  losses = []
  for j in range(per_rank // mini):
    chunks = [np.asarray(rows[j * mini : (j + 1) * mini]) for rows in ranks]
    # rearrange_micro_batches: min(rows, ceil(total / max_token_len)), all-reduced to the MAX over the ranks
    count = max(min(len(c), -(-int(seqlen[c].sum()) // max_token_len)) for c in chunks)
    total = 0.0
    for c in chunks:
      for part in _verl_balanced_partitions(seqlen[c].tolist(), count, equal_size=False):
        rows = c[part]
        total += _verl_agg_loss(loss_bt[rows], mask_bt[rows], agg) * (len(rows) / mini)  # len(data) / mini-batch
    losses.append(total / world_size)
  return losses


# ---- tests ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("equal_size", [True, False])
def test_partitions_are_verls_own(equal_size):
  rng = np.random.default_rng(0)
  for trial in range(200):
    k = int(rng.integers(1, 9))
    n = k * int(rng.integers(1, 7)) if equal_size else int(rng.integers(k, 40))
    # few distinct lengths: many ties, where the heap's and the sets' tie-breaking decide
    lengths = rng.integers(1, 6 if trial % 2 else 5000, n).tolist()
    want = _verl_karmarkar_karp(lengths, k, equal_size)
    assert karmarkar_karp(lengths, k, equal_size) == want, (lengths, k)
    assert balanced_partitions(lengths, k, equal_size) == [sorted(p) for p in want]


def _case(seed, n, t):
  rng = np.random.default_rng(seed)
  seqlen = rng.integers(t // 4, t + 1, n)
  mask = np.zeros((n, t))
  for i, s in enumerate(seqlen):
    mask[i, int(rng.integers(1, s // 2 + 1)) : s] = 1  # the response: trained tokens
  return seqlen, rng.normal(size=(n, t)), mask


@pytest.mark.parametrize("agg", objectives.AGG_MODES)
@pytest.mark.parametrize("world_size,mini_rows", [(1, 16), (4, 16), (8, 32)])
def test_per_row_denominators_give_verls_loss(agg, world_size, mini_rows):
  n, t, max_tokens = 64, 48, 100
  seqlen, loss_bt, mask_bt = _case(world_size * 7 + mini_rows, n, t)
  want = _verl_update_losses(
    seqlen, loss_bt, mask_bt, world_size=world_size, mini_rows=mini_rows, max_token_len=max_tokens, agg=agg
  )
  layout = verl_dynamic_layout(
    seqlen,
    mask_bt.sum(-1),
    rows_per_update=mini_rows,
    world_size=world_size,
    max_token_len=max_tokens,
    agg=agg,
    seq_len=t,
  )
  assert sorted(layout.order.tolist()) == list(range(n))
  assert layout.micro_batches.min() >= 2  # several micro-batches per rank: the weighting is not trivial
  got = []
  for j in range(n // mini_rows):
    rows = layout.order[j * mini_rows : (j + 1) * mini_rows]
    d = jnp.asarray(layout.denominator[j * mini_rows : (j + 1) * mini_rows], jnp.float32)
    got.append(float(objectives.aggregate(jnp.asarray(loss_bt[rows], jnp.float32), mask_bt[rows], agg, d)))
  # float32 sums of <= 48 x 16 terms of magnitude ~1 against verl's formula in float64
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  global_loss = [
    float(
      objectives.aggregate(
        jnp.asarray(loss_bt[j * mini_rows : (j + 1) * mini_rows]), mask_bt[j * mini_rows :][:mini_rows], agg
      )
    )
    for j in range(n // mini_rows)
  ]
  if agg in ("token-mean", "seq-mean-token-sum-norm"):  # the weighting differs from one global mean
    assert np.max(np.abs(np.asarray(global_loss) - np.asarray(want))) > 1e-3


def test_layout_refuses_what_verl_refuses():
  seqlen, _, mask = _case(0, 16, 32)
  kw = dict(world_size=4, max_token_len=64, agg="token-mean", seq_len=32)
  with pytest.raises(ValueError, match="whole mini-batches of 6 rows"):
    verl_dynamic_layout(seqlen, mask.sum(-1), rows_per_update=6, **kw)
  with pytest.raises(ValueError, match="more than algo.verl_max_token_len=16"):
    verl_dynamic_layout(seqlen, mask.sum(-1), rows_per_update=8, **{**kw, "max_token_len": 16})


@pytest.mark.slow
def test_update_step_gradient_is_verls_dynamic_bsz_gradient():
  """The jitted update step on a tiny model, its batch in our micro-batches of 2 rows, gives the gradient of the
  loss verl's use_dynamic_bsz update minimises (its own token-balanced micro-batches, computed by the vendored
  code above) to float32 rounding."""
  from test_step import _run, _step
  from test_step_fixtures import M, MB, T, float32_spread, host_params, max_abs_diff, reference_logprobs, rl_arrays

  arrays = rl_arrays()
  seqlen = arrays["attention_mask"].sum(-1)
  n, world_size, max_tokens = M * MB, 2, T
  layout = verl_dynamic_layout(
    seqlen,
    arrays["loss_mask"].sum(-1),
    rows_per_update=n,
    world_size=world_size,
    max_token_len=max_tokens,
    agg="token-mean",
    seq_len=T,
  )
  reordered = {k: v[layout.order] for k, v in arrays.items()}
  reordered["loss_denominator"] = np.broadcast_to(layout.denominator[:, None], (n, T)).astype(np.float32)
  batch = micro_batches(reordered, micro_batch_size=MB, pad_id=0, seq_len=T)
  _, _, _, grads = _run(_step(M, aggregation="verl"), batch)

  a = {k: jnp.asarray(v) for k, v in arrays.items()}
  fn = objectives.policy_loss("ppo")

  def verl_loss(p):
    lp = reference_logprobs(p, a["tokens"], a["attention_mask"])
    args = (lp[:, 1:], a["old_log_prob"][:, 1:], a["advantages"][:, 1:], a["loss_mask"][:, 1:])
    order = [j for q in _verl_balanced_partitions(seqlen.tolist(), world_size, equal_size=True) for j in q]
    per_rank = n // world_size
    ranks = [np.asarray(order[r * per_rank : (r + 1) * per_rank]) for r in range(world_size)]
    count = max(min(per_rank, math.ceil(int(seqlen[c].sum()) / max_tokens)) for c in ranks)
    total = 0.0
    for c in ranks:
      for part in _verl_balanced_partitions(seqlen[c].tolist(), count, equal_size=False):
        rows = c[part]
        total = total + fn(*(x[rows] for x in args))[0] * (len(rows) / per_rank)
    return total / world_size

  ref = jax.device_get(jax.grad(verl_loss)(host_params()))
  assert max_abs_diff(grads, ref) <= 4 * float32_spread({k: jnp.asarray(v) for k, v in arrays.items()})
  assert layout.micro_batches[0] >= 2
