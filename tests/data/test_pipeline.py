"""Grain loader: deterministic, resumable mid-epoch, disjoint shards; the TFDS builder without TF."""

import json

import pytest

from aepo_jax.data import Example, make_loader


def _examples(n):
  return [Example(f"x:{i}", f"q{i}", [str(i)], "synthetic", "qa") for i in range(n)]


def _ids(batch):
  return [e.id for e in batch]


def test_batches_are_lists_and_epochs_cover_everything():
  exs = _examples(10)
  it = make_loader(exs, batch_size=5, seed=0, num_epochs=2)
  batches = list(it)
  assert len(batches) == 4 and all(isinstance(b, list) and len(b) == 5 for b in batches)
  ep1 = sorted(i for b in batches[:2] for i in _ids(b))
  ep2 = sorted(i for b in batches[2:] for i in _ids(b))
  assert ep1 == ep2 == sorted(e.id for e in exs)
  assert _ids(batches[0]) + _ids(batches[1]) != _ids(batches[2]) + _ids(batches[3])  # reshuffled


def test_same_seed_same_order_other_seed_other_order():
  exs = _examples(50)
  a = [_ids(b) for _, b in zip(range(5), make_loader(exs, batch_size=4, seed=7))]
  b = [_ids(b) for _, b in zip(range(5), make_loader(exs, batch_size=4, seed=7))]
  c = [_ids(b) for _, b in zip(range(5), make_loader(exs, batch_size=4, seed=8))]
  assert a == b and a != c
  plain = [_ids(b) for b in make_loader(exs, batch_size=10, seed=0, shuffle=False, num_epochs=1)]
  assert plain[0] == [f"x:{i}" for i in range(10)]


def test_state_saved_mid_epoch_resumes_exactly():
  exs = _examples(23)
  it = make_loader(exs, batch_size=4, seed=3)  # infinite
  for _ in range(3):  # 12 of 23: mid-epoch
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # survives a JSON checkpoint
  expected = [_ids(next(it)) for _ in range(10)]  # crosses the epoch boundary
  fresh = make_loader(exs, batch_size=4, seed=3)
  fresh.set_state(state)
  assert [_ids(next(fresh)) for _ in range(10)] == expected


def test_shards_are_disjoint_and_cover():
  exs = _examples(30)
  seen = []
  for shard in range(3):
    ids = [
      i for b in make_loader(exs, batch_size=5, seed=1, num_epochs=1, shard_index=shard, shard_count=3) for i in _ids(b)
    ]
    assert len(ids) == 10
    seen += ids
  assert sorted(seen) == sorted(e.id for e in exs)


def test_bad_arguments():
  with pytest.raises(ValueError, match="shard_index"):
    make_loader(_examples(4), batch_size=2, seed=0, shard_index=2, shard_count=2)
  with pytest.raises(ValueError, match="batch_size"):
    make_loader(_examples(4), batch_size=0, seed=0)


def test_tfds_builder_without_tensorflow(tmp_path):
  import sys

  from aepo_jax.data import arpo_data_root, build_arpo_tfds, example_from_tfds, load_arpo_parquet

  if not arpo_data_root().exists():
    pytest.skip("ARPO data not present")
  builder = build_arpo_tfds(str(tmp_path / "tfds"), splits=("valid", "gaia_test"))
  assert "tensorflow" not in sys.modules
  assert list((tmp_path / "tfds").rglob("*.array_record*"))
  src = builder.as_data_source(split="valid")
  got = {e.id: e for e in (example_from_tfds(src[i]) for i in range(len(src)))}
  want = {e.id: e for e in load_arpo_parquet("valid")}
  assert got == want
  batch = next(make_loader(src, batch_size=4, seed=0))
  assert len(batch) == 4 and example_from_tfds(batch[0]).id in want
