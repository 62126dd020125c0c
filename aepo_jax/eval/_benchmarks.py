"""Which benchmarks an evaluation runs, and what each needs (search backend, judge) before it may start.

Selection accepts benchmark names (`aepo_jax.data.BENCHMARKS`), family names (`math`, `qa`, `deep_search`),
`all`, and data files of your own (.jsonl / .parquet, local or gs://; docs/data.md), comma separated; unknown
names fail with the known list. A data file is reported under its file name without the suffix and scored by
the family its records get (`data_options['family']`, default qa). The checks in `requirements_error` run before
any model is loaded: bad input fails before compute. Data files have no fixed protocol, so they require no
search backend or judge.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Optional, Sequence

from aepo_jax.data import BENCHMARKS, FAMILIES, Example, arpo_data_root, is_data_file, load_benchmark, load_records

# Spec §2.5: math sets are scored by math equivalence; QA sets by EM/F1 over aliases; deep-search sets by an
# LLM judge OR'ed with math equivalence. QA and deep search are evaluated with the search tool.
SCORER_OF_FAMILY = {"math": "math_verify", "qa": "em_f1", "deep_search": "judge_or_math"}


def family_of(name: str, data_family: str = "qa") -> str:
  """A benchmark's family; a data file's is `data_family` (what its question/answer records get)."""
  return data_family if is_data_file(name) else BENCHMARKS[name].family


def display_name(name: str) -> str:
  """The name a benchmark is reported under: its own, or a data file's name without directory and suffix."""
  return os.path.splitext(os.path.basename(name))[0] if is_data_file(name) else name


def _available(name: str) -> bool:
  """Bundled sets always count (a missing file then fails loudly); unbundled ones only when present."""
  b = BENCHMARKS[name]
  return b.bundled or (arpo_data_root() / b.path).exists()


def select_benchmarks(spec: str | Sequence[str]) -> list[str]:
  """Benchmark names for 'gsm8k,math500', 'math', 'qa,gaia', 'all'; order kept, duplicates dropped.

  Families and 'all' include the unbundled full MATH set only when its file is present; 'math' names the
  family, 'MATH' (upper case) the full MATH test set."""
  items = spec.split(",") if isinstance(spec, str) else list(spec)
  items = [s.strip() for s in items if s and s.strip()]
  if not items:
    raise ValueError(
      f"--benchmarks is empty; give names like gsm8k,math500, a family ({', '.join(FAMILIES)}) or 'all'."
    )
  out: list[str] = []
  for item in items:
    key = item.lower()
    if is_data_file(item):
      out.append(item)
    elif item == "MATH":  # 'math' is the family; the full MATH test set (not bundled) is asked for as 'MATH'
      out.append("math")
    elif key == "all":
      out += [n for n in BENCHMARKS if _available(n)]
    elif key in FAMILIES:
      out += [n for n, b in BENCHMARKS.items() if b.family == key and _available(n)]
    elif key in BENCHMARKS:
      out.append(key)
    else:
      raise ValueError(
        f"unknown benchmark {item!r}; known benchmarks: {', '.join(sorted(BENCHMARKS))}; "
        f"families: {', '.join(FAMILIES)}; 'all'; 'MATH' for the full MATH test set; or a .jsonl / "
        ".parquet file."
      )
  out = list(dict.fromkeys(out))
  shown: dict = {}
  for name in out:
    other = shown.setdefault(display_name(name), name)
    if other != name:
      raise ValueError(f"{other!r} and {name!r} would both be reported as {display_name(name)!r}; rename one file.")
  return out


def needs_search(name: str) -> bool:
  return not is_data_file(name) and family_of(name) in ("qa", "deep_search")


def needs_judge(name: str) -> bool:
  return not is_data_file(name) and family_of(name) == "deep_search"


def requirements_error(names: Iterable[str], *, search_backend: Optional[str], judge: bool) -> Optional[str]:
  """A message naming every benchmark whose needs are not configured, or None.

  `search_backend=None` means "not given"; 'none' is an explicit choice to run QA sets without search
  (deep-search sets still refuse: their answers come from the web).
  """
  names = list(names)
  problems = []
  deep = [n for n in names if needs_judge(n)]
  qa = [n for n in names if not is_data_file(n) and family_of(n) == "qa"]
  if deep and search_backend in (None, "none"):
    problems.append(
      f"deep-search benchmarks {deep} need a search backend: pass --search_backend="
      "retrieval|replay|local|serper|brave|bing (with its --search_* options)."
    )
  if deep and not judge:
    problems.append(
      f"deep-search benchmarks {deep} are scored by an LLM judge (spec §2.5): pass --judge_url=URL "
      "--judge_model=NAME (an OpenAI-compatible endpoint)."
    )
  if qa and search_backend is None:
    problems.append(
      f"QA benchmarks {qa} are evaluated with the search tool: pass --search_backend="
      "retrieval|replay|local|..., or --search_backend=none to evaluate them without search."
    )
  return "\n".join(problems) or None


def load_examples(
  name: str, limit: Optional[int] = None, root=None, data_options: Optional[dict] = None
) -> list[Example]:
  """The first `limit` examples of a benchmark or data file (file order, so runs with the same limit compare).

  data_options: `load_records` keywords for data files (question_key, answer_key, system_key, family)."""
  if is_data_file(name):
    examples = load_records(name, name=display_name(name), **(data_options or {}))
  else:
    examples = load_benchmark(name, root=root)
  return examples[:limit] if limit else examples


@dataclasses.dataclass(frozen=True)
class BenchmarkInfo:
  name: str
  family: str
  scorer: str


def describe(names: Iterable[str], data_family: str = "qa") -> list[BenchmarkInfo]:
  return [
    BenchmarkInfo(display_name(n), family_of(n, data_family), SCORER_OF_FAMILY[family_of(n, data_family)])
    for n in names
  ]
