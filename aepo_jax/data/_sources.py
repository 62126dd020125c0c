"""Readers for the ARPO files in ../shared/data/arpo: RL parquet sets and the evaluation JSONL sets.

Field differences are normalised into `Example` (see data/README.md there): `Question` (gaia) vs
`problem` (aime25) vs `question`; answers as int (aime25), str, JSON list, or a GSM8K worked solution
ending in `#### <number>`. The parquet files' stored system prompt is never used (backspace bug,
spec §4): `build_messages` rebuilds it from the template.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from aepo_jax.data._records import Example, RecordError, answers_from, require

DATA_ENV = "AEPO_ARPO_DATA"


def arpo_data_root() -> Path:
  """$AEPO_ARPO_DATA, else `<checkout>/../shared/data/arpo` (where CI keeps it) when this package runs from a
  checkout, else (an installed package) `$AEPO_JAX_CACHE/arpo` (default `~/.cache/aepo_jax/arpo`, where the GGUF
  conversion also goes; docs/data.md)."""
  if os.environ.get(DATA_ENV):
    return Path(os.environ[DATA_ENV])
  checkout = Path(__file__).resolve().parents[2]
  if (checkout / "setup.py").is_file() and (checkout / "launch").is_dir():
    return checkout.parent / "shared" / "data" / "arpo"
  cache = os.environ.get("AEPO_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "aepo_jax")
  return Path(cache) / "arpo"


@dataclasses.dataclass(frozen=True)
class Benchmark:
  name: str
  path: str  # relative to the data root
  family: str
  question_key: str = "question"
  gsm8k_answer: bool = False
  bundled: bool = True


# The 14 evaluation sets of the ARPO/AEPO repo (spec §2.5); families as the papers group them.
BENCHMARKS: dict[str, Benchmark] = {
  b.name: b
  for b in [
    Benchmark("aime24", "eval/aime24/test.jsonl", "math", "problem"),
    Benchmark("aime25", "eval/aime25/test.jsonl", "math", "problem"),
    Benchmark("math500", "eval/math500/test.jsonl", "math"),
    Benchmark("gsm8k", "eval/gsm8k/test.jsonl", "math", gsm8k_answer=True),
    Benchmark("math", "eval/math/test.jsonl", "math", "problem", bundled=False),
    Benchmark("hotpotqa", "eval/hotpotqa/test.jsonl", "qa"),
    Benchmark("2wiki", "eval/2wiki/test.jsonl", "qa"),
    Benchmark("musique", "eval/musique/test.jsonl", "qa"),
    Benchmark("bamboogle", "eval/bamboogle/test.jsonl", "qa"),
    Benchmark("webwalker", "eval/webwalker/test.jsonl", "deep_search"),
    Benchmark("gaia", "eval/gaia/test.jsonl", "deep_search", "Question"),
    Benchmark("hle", "eval/hle/top.jsonl", "deep_search"),
    Benchmark("xbench", "eval/xbench/test.jsonl", "deep_search"),
    Benchmark("simpleqa", "eval/SimpleQA/test.jsonl", "deep_search"),
  ]
}

_META_SKIP = {"question", "Question", "problem", "answer", "solution", "rationale", "canary"}


def _gsm8k_answer(text: str, path, line) -> str:
  if "####" not in text:
    raise RecordError(path, line, "answer", "GSM8K answer has no '#### <number>' line")
  return text.rsplit("####", 1)[1].strip().replace(",", "")


def read_jsonl(
  path: str | os.PathLike, *, name: str, family: str, question_key: str = "question", gsm8k_answer: bool = False
) -> list[Example]:
  """Parse one evaluation JSONL file strictly: a bad line raises RecordError(path, line, field)."""
  path = Path(path)
  out = []
  with open(path, encoding="utf-8") as f:
    for line_no, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise RecordError(path, line_no, "<json>", f"invalid JSON ({e.msg} at column {e.colno})") from None
      # aime24 has both `problem` and `question`; fall back to `question` when the key is absent.
      key = question_key if isinstance(rec, dict) and question_key in rec else "question"
      question = require(rec, key, str, path, line_no)
      raw = require(rec, "answer", (str, int, list), path, line_no)
      if gsm8k_answer:
        answers = [_gsm8k_answer(require(rec, "answer", str, path, line_no), path, line_no)]
      else:
        answers = answers_from(raw, path, line_no)
      meta = {k: v for k, v in rec.items() if k not in _META_SKIP and isinstance(v, (str, int, float, bool))}
      if gsm8k_answer:
        meta["solution"] = raw
      out.append(Example(f"{name}:{line_no}", question, answers, name, family, meta))
  return out


def load_benchmark(name: str, root: str | os.PathLike | None = None) -> list[Example]:
  """All examples of one evaluation set by registry name (see `BENCHMARKS`)."""
  if name not in BENCHMARKS:
    raise ValueError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARKS)}")
  b = BENCHMARKS[name]
  path = Path(root or arpo_data_root()) / b.path
  if not path.exists():
    hint = (
      "it is not in the bundled ARPO snapshot (upstream stores it as a large file); put it there yourself"
      if not b.bundled
      else f"set ${DATA_ENV} to the ARPO data folder"
    )
    raise FileNotFoundError(f"benchmark {name!r}: {path} not found; {hint}")
  return read_jsonl(path, name=name, family=b.family, question_key=b.question_key, gsm8k_answer=b.gsm8k_answer)


ARPO_RL_FILES = ("train_10k", "valid", "hard_search_1k", "gaia_test", "hle_test")
_FAMILY_OF_FILE = {"hard_search_1k": "deep_search", "gaia_test": "deep_search", "hle_test": "deep_search"}


def load_arpo_parquet(name_or_path: str | os.PathLike, root: str | os.PathLike | None = None) -> list[Example]:
  """One ARPO RL parquet file (verl schema) as Examples; `name` is a stem from `ARPO_RL_FILES`.

  The stored system prompt is not used when it is the code_search prompt (the configured template then
  applies); metadata['stored_prompt_backspace_bug'] records the bug. Any other stored system prompt is the
  record's own (metadata['system_prompt']).
  """
  import dataclasses

  from aepo_jax.data._files import example_from_verl, iter_rows

  path = Path(name_or_path)
  if path.suffix != ".parquet":
    path = Path(root or arpo_data_root()) / "train" / f"{name_or_path}.parquet"
    if not path.exists():
      raise FileNotFoundError(
        f"ARPO RL file {str(name_or_path)!r} is not at {path}. The ARPO data comes from "
        f"github.com/dongguanting/ARPO (docs/data.md says which files): set ${DATA_ENV} to the folder "
        "holding its train/ and eval/ folders, or give a .parquet / .jsonl path instead."
      )
  out = []
  for i, row, unit in iter_rows(str(path)):
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), list):
      raise RecordError(path, i, "prompt", "missing; expected verl's [system, user] messages", unit=unit)
    if "reward_model" not in row:
      raise RecordError(path, i, "reward_model", "missing; expected {ground_truth: ...}", unit=unit)
    ex = example_from_verl(row, str(path), i, name=path.stem, family="qa", unit=unit)
    if path.stem in _FAMILY_OF_FILE:
      ex = dataclasses.replace(ex, family=_FAMILY_OF_FILE[path.stem])
    out.append(ex)
  return out
