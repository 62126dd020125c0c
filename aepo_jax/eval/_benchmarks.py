"""Which benchmarks an evaluation runs, and what each needs (search backend, judge) before it may start.

Selection accepts benchmark names (`aepo_jax.data.BENCHMARKS`), family names (`math`, `qa`, `deep_search`)
and `all`, comma separated; unknown names fail with the known list. The checks in `requirements_error`
run before any model is loaded (issue 7: bad input fails before compute).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence

from aepo_jax.data import BENCHMARKS, FAMILIES, Example, arpo_data_root, load_benchmark

# Spec §2.5: math sets are scored by math equivalence; QA sets by EM/F1 over aliases; deep-search sets by an
# LLM judge OR'ed with math equivalence. QA and deep search are evaluated with the search tool.
SCORER_OF_FAMILY = {"math": "math_verify", "qa": "em_f1", "deep_search": "judge_or_math"}


def family_of(name: str) -> str:
  return BENCHMARKS[name].family


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
    raise ValueError("--benchmarks is empty; give names like gsm8k,math500, a family "
                     f"({', '.join(FAMILIES)}) or 'all'.")
  out: list[str] = []
  for item in items:
    key = item.lower()
    if item == "MATH":  # 'math' is the family; the full MATH test set (not bundled) is asked for as 'MATH'
      out.append("math")
    elif key == "all":
      out += [n for n in BENCHMARKS if _available(n)]
    elif key in FAMILIES:
      out += [n for n, b in BENCHMARKS.items() if b.family == key and _available(n)]
    elif key in BENCHMARKS:
      out.append(key)
    else:
      raise ValueError(f"unknown benchmark {item!r}; known benchmarks: {', '.join(sorted(BENCHMARKS))}; "
                       f"families: {', '.join(FAMILIES)}; 'all'; or 'MATH' for the full MATH test set.")
  return list(dict.fromkeys(out))


def needs_search(name: str) -> bool:
  return family_of(name) in ("qa", "deep_search")


def needs_judge(name: str) -> bool:
  return family_of(name) == "deep_search"


def requirements_error(names: Iterable[str], *, search_backend: Optional[str], judge: bool) -> Optional[str]:
  """A message naming every benchmark whose needs are not configured, or None.

  `search_backend=None` means "not given"; 'none' is an explicit choice to run QA sets without search
  (deep-search sets still refuse: their answers come from the web).
  """
  names = list(names)
  problems = []
  deep = [n for n in names if needs_judge(n)]
  qa = [n for n in names if family_of(n) == "qa"]
  if deep and search_backend in (None, "none"):
    problems.append(f"deep-search benchmarks {deep} need a search backend: pass --search-backend "
                    "retrieval|replay|local|serper|brave|bing (with its --search-* options).")
  if deep and not judge:
    problems.append(f"deep-search benchmarks {deep} are scored by an LLM judge (spec §2.5): pass --judge-url URL "
                    "--judge-model NAME (an OpenAI-compatible endpoint).")
  if qa and search_backend is None:
    problems.append(f"QA benchmarks {qa} are evaluated with the search tool: pass --search-backend "
                    "retrieval|replay|local|..., or --search-backend none to evaluate them without search.")
  return "\n".join(problems) or None


def load_examples(name: str, limit: Optional[int] = None, root=None) -> list[Example]:
  """The first `limit` examples of a benchmark (file order, so runs with the same limit compare)."""
  examples = load_benchmark(name, root=root)
  return examples[:limit] if limit else examples


@dataclasses.dataclass(frozen=True)
class BenchmarkInfo:
  name: str
  family: str
  scorer: str


def describe(names: Iterable[str]) -> list[BenchmarkInfo]:
  return [BenchmarkInfo(n, family_of(n), SCORER_OF_FAMILY[family_of(n)]) for n in names]
