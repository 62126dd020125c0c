"""Data: one record type, the ARPO sources, prompt templates, Grain loaders, a TFDS builder and the
generated tool-use task suite. Never imports jax at import time: grain (which imports jax) and
tensorflow_datasets load only when `make_loader` / `build_arpo_tfds` are first used.

  Example(id, question, answers, source, family, metadata); RecordError(path, line, field, problem)
  BENCHMARKS, load_benchmark(name, root=None) -> list[Example]      # the 14 evaluation sets
  ARPO_RL_FILES, load_arpo_parquet(name_or_path, root=None)          # RL parquet (verl schema)
  load_records(path, *, question_key, answer_key, system_key, family)   # your own JSONL / Parquet, local or gs://
  is_data_file(source), data_file_exists(path), iter_rows(path) (streamed records with their line / row numbers)
  read_traces(path) -> Trace(id, messages)   # SFT chat traces: alpaca or sharegpt (LLaMA-Factory's forms)
  trace_segments(assistant_text, mask_results=True, observed=()) -> [(text, trained)]
                                      # tool results untrained (mask_results=False: only observation turns)
  read_jsonl(path, name=, family=, question_key=, gsm8k_answer=)     # strict JSONL reader
  prompts: TEMPLATES, system_prompt(name), build_messages(example, template), has_backspace_bug
  make_loader(examples, *, batch_size, seed, shuffle, num_epochs, shard_index, shard_count)
  build_arpo_tfds(data_dir, arpo_root=None), ArpoRl, example_from_tfds(record)
  tasks: generate_suite(seed, n_train, n_heldout, corpus_dir=None, difficulty=1) -> TaskSuite
"""

from aepo_jax.data import prompts
from aepo_jax.data._files import data_file_exists, is_data_file, iter_rows, load_records
from aepo_jax.data._traces import Trace, read_traces, trace_from_record
from aepo_jax.data._traces import OBSERVED as TRACE_OBSERVED
from aepo_jax.data._traces import segments as trace_segments
from aepo_jax.data._records import FAMILIES, Example, RecordError
from aepo_jax.data._sources import (
  ARPO_RL_FILES,
  BENCHMARKS,
  Benchmark,
  arpo_data_root,
  load_arpo_parquet,
  load_benchmark,
  read_jsonl,
)
from aepo_jax.data.prompts import TEMPLATES, build_messages, has_backspace_bug, system_prompt

_LAZY = {
  "make_loader": "aepo_jax.data._pipeline",
  "build_arpo_tfds": "aepo_jax.data._tfds_builder",
  "ArpoRl": "aepo_jax.data._tfds_builder",
  "example_from_tfds": "aepo_jax.data._tfds_builder",
  "generate_suite": "aepo_jax.data.tasks",
  "TaskSuite": "aepo_jax.data.tasks",
  "Demo": "aepo_jax.data.tasks",
}


def __getattr__(name):  # PEP 562: heavy optional parts load on first use
  if name in _LAZY:
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'aepo_jax.data' has no attribute {name!r}")


__all__ = [
  "prompts",
  "FAMILIES",
  "Example",
  "RecordError",
  "ARPO_RL_FILES",
  "BENCHMARKS",
  "Benchmark",
  "arpo_data_root",
  "load_arpo_parquet",
  "load_benchmark",
  "read_jsonl",
  "load_records",
  "is_data_file",
  "iter_rows",
  "Trace",
  "read_traces",
  "trace_from_record",
  "trace_segments",
  "TRACE_OBSERVED",
  "data_file_exists",
  "TEMPLATES",
  "build_messages",
  "has_backspace_bug",
  "system_prompt",
  *_LAZY,
]
