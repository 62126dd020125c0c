"""A TFDS builder for the ARPO RL sets: ArrayRecord files, served by `as_data_source()` without
TensorFlow, so prepared data can live on GCS for pod runs. Imported lazily (tensorflow_datasets)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds

from aepo_jax.data._records import Example
from aepo_jax.data._sources import ARPO_RL_FILES, arpo_data_root, load_arpo_parquet


class ArpoRl(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """One split per ARPO parquet file (train_10k, valid, hard_search_1k, gaia_test, hle_test)."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "ARPO snapshot e257337, normalised to aepo_jax.data.Example."}

  def __init__(self, *, arpo_root: str | None = None, splits: tuple[str, ...] = ARPO_RL_FILES, **kwargs):
    self._arpo_root = Path(arpo_root) if arpo_root else arpo_data_root()
    self._splits = tuple(splits)
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
      features=tfds.features.FeaturesDict(
        {
          "id": tfds.features.Text(),
          "question": tfds.features.Text(),
          "answers_json": tfds.features.Text(),
          "source": tfds.features.Text(),
          "family": tfds.features.Text(),
          "metadata_json": tfds.features.Text(),
        }
      ),
      homepage="https://github.com/dongguanting/ARPO",
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # local files only: nothing is downloaded
    return {name: self._generate_examples(name) for name in self._splits}

  def _generate_examples(self, name: str):
    for ex in load_arpo_parquet(name, root=self._arpo_root):
      yield (
        ex.id,
        {
          "id": ex.id,
          "question": ex.question,
          "answers_json": json.dumps(ex.answers),
          "source": ex.source,
          "family": ex.family,
          "metadata_json": json.dumps(ex.metadata),
        },
      )


def _text(v) -> str:
  if isinstance(v, np.ndarray):
    v = v.item()
  return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def example_from_tfds(record: dict) -> Example:
  """Turn one record of `ArpoRl(...).as_data_source(split)` back into an Example."""
  return Example(
    _text(record["id"]),
    _text(record["question"]),
    json.loads(_text(record["answers_json"])),
    _text(record["source"]),
    _text(record["family"]),
    json.loads(_text(record["metadata_json"])),
  )


def build_arpo_tfds(data_dir: str, *, arpo_root: str | None = None, splits: tuple[str, ...] = ARPO_RL_FILES) -> ArpoRl:
  """Build (once; `data_dir` may be a gs:// path) and return the builder; then
  `builder.as_data_source(split='valid')`, a random-access source `make_loader` accepts."""
  builder = ArpoRl(data_dir=data_dir, arpo_root=arpo_root, splits=splits, file_format="array_record")
  builder.download_and_prepare()
  return builder
