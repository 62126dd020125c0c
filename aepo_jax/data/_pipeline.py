"""Grain input pipeline over any sequence of examples, with a checkpointable iterator.

grain itself imports jax (its profiler), so this module is imported only when `make_loader` is
called; the rest of `aepo_jax.data` stays jax-free.
"""

from __future__ import annotations

from typing import Any, Sequence


def make_loader(
  examples: Sequence[Any],
  *,
  batch_size: int,
  seed: int,
  shuffle: bool = True,
  num_epochs: int | None = None,
  shard_index: int = 0,
  shard_count: int = 1,
  drop_remainder: bool = False,
):
  """An iterator of batches (lists of examples) with `get_state()` / `set_state(state)`.

  Order: shard (host `shard_index` of `shard_count` takes every shard_count-th example, so hosts
  never overlap), then a seeded global shuffle that differs per epoch (grain's index shuffle;
  the same seed gives the same order on every run), repeat `num_epochs` (None = forever), batch.
  A batch may span an epoch boundary. The state is a small JSON-safe dict: store it with the
  training checkpoint and `set_state` it to resume with exactly the next batch.
  `examples` can be a list, or any random-access source such as a TFDS `as_data_source()`.
  """
  import grain  # lazy: imports jax

  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index}, {shard_count}")
  if len(examples) < shard_count:
    raise ValueError(f"{len(examples)} examples cannot be split over {shard_count} shards")
  ds = grain.MapDataset.source(examples)
  if shard_count > 1:
    ds = ds[shard_index::shard_count]
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs)
  ds = ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=list)
  return iter(ds.to_iter_dataset())
