"""Datasets of your own: JSONL or Parquet files, local or gs://, read into `Example`s without code.

Each record is one of (detected per record, so a file may mix them):
  question/answer   {"question": "...", "answer": "42"}; the answer may be a string, an int or a list of
                    accepted answers. Field names are arguments (config: data.fields.question / .answer).
  own system prompt the same plus {"system": "..."} (data.fields.system): that text replaces the
                    template's system prompt for this record.
  verl (ARPO)       {"prompt": [{"role": "system", ...}, {"role": "user", ...}],
                     "reward_model": {"ground_truth": "..."}}: the user turn is the question. A system turn
                    that is ARPO's code_search prompt (with or without the stored backspace bug) is dropped,
                    so the configured template applies as for the ARPO files; any other is the record's own.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

from aepo_jax.data._records import FAMILIES, Example, RecordError, answers_from
from aepo_jax.data.prompts import CODE_SEARCH, fix_backspace_bug, has_backspace_bug

SUFFIXES = (".jsonl", ".parquet")


def is_data_file(source: Any) -> bool:
  """True for a path (local or gs://) this module reads, judged by its suffix."""
  return str(source).lower().endswith(SUFFIXES)


def data_file_exists(path: str) -> bool:
  import fsspec  # lazy: gcsfs only when a gs:// path is asked for

  fs, _, (p,) = fsspec.get_fs_token_paths(str(path))
  return fs.isfile(p)


def _stem(path: str) -> str:
  return os.path.splitext(os.path.basename(str(path).rstrip("/")))[0]


def iter_rows(path: str) -> Iterator[tuple[int, Any, str]]:
  """(line or row number, record, unit) of a JSONL (lines from 1) or Parquet file (rows from 0), local or gs://,
  read as a stream; invalid JSON raises RecordError naming the line."""
  import fsspec

  if not data_file_exists(path):
    raise FileNotFoundError(f"data file {path!r} does not exist; check the path (local or gs://bucket/...).")
  if str(path).lower().endswith(".parquet"):
    import pyarrow.parquet as pq  # lazy: only Parquet needs it

    with fsspec.open(str(path), "rb") as f:  # streamed: one record batch in memory at a time
      i = 0
      for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
          yield i, row, "row"
          i += 1
    return
  with fsspec.open(str(path), "rt", encoding="utf-8") as f:
    for line_no, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        yield line_no, json.loads(line), "line"
      except json.JSONDecodeError as e:
        raise RecordError(path, line_no, "<json>", f"invalid JSON ({e.msg} at column {e.colno})") from None


def is_verl_record(record: Any) -> bool:
  return isinstance(record, dict) and isinstance(record.get("prompt"), list) and "reward_model" in record


def _own_system(text: Any) -> str | None:
  """The record's system prompt, or None where it is ARPO's code_search prompt (the template then applies)."""
  if text is None or text == "":
    return None
  return None if fix_backspace_bug(text) == CODE_SEARCH else fix_backspace_bug(text)


def example_from_verl(row: dict, path: str, i: int, *, name: str, family: str, unit: str = "row") -> Example:
  """One verl-schema record: prompt [system?, user], reward_model.ground_truth (a string or a list)."""
  prompt = row["prompt"]
  roles = [m.get("role") if isinstance(m, dict) else None for m in prompt]
  if roles not in (["system", "user"], ["user"]) or not all(isinstance(m.get("content"), str) for m in prompt):
    raise RecordError(
      path, i, "prompt", f"expected [system, user] or [user] messages with string content, got roles {roles}", unit=unit
    )
  rm = row["reward_model"]
  if not isinstance(rm, dict) or "ground_truth" not in rm:
    raise RecordError(path, i, "reward_model.ground_truth", "missing", unit=unit)
  answers = answers_from(rm["ground_truth"], path, i, "reward_model.ground_truth", unit)
  stored = prompt[0]["content"] if roles[0] == "system" else None
  extra = row.get("extra_info") or {}
  ability = row.get("ability")
  meta = {
    "data_source": row.get("data_source"),
    "ability": ability,
    "split": extra.get("split"),
    "index": extra.get("index"),
  }
  if stored is not None:
    meta["stored_prompt_backspace_bug"] = has_backspace_bug(stored)
  own = _own_system(stored)
  if own is not None:
    meta["system_prompt"] = own
  family = ability if ability in FAMILIES else family
  return Example(f"{name}:{i}", prompt[-1]["content"], answers, name, family, meta)


def load_records(
  path: str | os.PathLike,
  *,
  question_key: str = "question",
  answer_key: str = "answer",
  system_key: str = "system",
  family: str = "qa",
  name: str | None = None,
) -> list[Example]:
  """Every record of a JSONL or Parquet file (local or gs://) as an Example; a bad record raises RecordError
  naming the file, the line (JSONL, from 1) or row (Parquet, from 0) and the field.

  `family` ('qa': answers count by math equivalence or exact match; 'math': math equivalence only) applies to
  question/answer records; verl records take theirs from `ability` when it names one.
  """
  path = str(path)
  if family not in FAMILIES:
    raise ValueError(f"family {family!r} is unknown; choose one of {FAMILIES}.")
  if not is_data_file(path):
    raise ValueError(f"data file {path!r}: expected a {' or '.join(SUFFIXES)} file.")
  name = name or _stem(path)
  out = []
  for i, rec, unit in iter_rows(path):
    if is_verl_record(rec):
      out.append(example_from_verl(rec, path, i, name=name, family=family, unit=unit))
      continue
    if not isinstance(rec, dict):
      raise RecordError(path, i, "<record>", f"expected a JSON object, got {type(rec).__name__}", unit=unit)
    for key, what in ((question_key, "question"), (answer_key, "answer")):
      if rec.get(key) is None:
        raise RecordError(
          path,
          i,
          key,
          f"missing (fields present: {sorted(rec)}); name the {what} field "
          f"with data.fields.{what} (evaluate: --{what}_field), or write verl records "
          "(prompt + reward_model)",
          unit=unit,
        )
    question = rec[question_key]
    if not isinstance(question, str) or not question.strip():
      raise RecordError(path, i, question_key, f"expected a non-empty string, got {question!r:.80}", unit=unit)
    answers = answers_from(rec[answer_key], path, i, answer_key, unit)
    meta = {
      k: v
      for k, v in rec.items()
      if k not in (question_key, answer_key, system_key) and isinstance(v, (str, int, float, bool))
    }
    system = rec.get(system_key)
    if system is not None:
      if not isinstance(system, str):
        raise RecordError(path, i, system_key, f"expected a string, got {type(system).__name__}", unit=unit)
      own = _own_system(system)
      if own is not None:
        meta["system_prompt"] = own
    out.append(Example(f"{name}:{i}", question, answers, name, family, meta))
  if not out:
    raise ValueError(f"data file {path!r} holds no records.")
  return out
