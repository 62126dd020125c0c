"""The answers of one evaluation run scored again under the other protocol, and where the two disagree.

    rescore("runs/a", "runs/a_official", protocol="official")   # no generation: the same trajectories
    print(protocol_differences("runs/a", "runs/a_official"))     # per benchmark and metric

A record keeps what generation wrote (`GENERATION_KEYS`); every scoring field is replaced by the new scorer's. A
timed-out answer is scored with the prediction "Timeout", as when it was first scored.
"""

from __future__ import annotations

import os
import re
from typing import Optional, Sequence

from aepo_jax.data import Example
from aepo_jax.eval import _report
from aepo_jax.eval._runner import TIMEOUT_PREDICTION, _write_records, read_records
from aepo_jax.eval._scoring import Scorer

# What the evaluation loop writes before scoring (`Evaluator._record`); the rest of a record is the scorer's.
GENERATION_KEYS = (
  "benchmark",
  "id",
  "sample",
  "family",
  "question",
  "answers",
  "response",
  "tool_calls",
  "stop_reason",
  "prompt_len",
  "response_len",
  "num_tool_calls",
  "seconds",
)


def _example(record: dict) -> Example:
  return Example(
    id=str(record["id"]),
    question=str(record["question"]),
    answers=[str(a) for a in record["answers"]],
    source=str(record["benchmark"]),
    family=str(record["family"]),
  )


def rescore(
  run_dir: str, output: str, *, protocol: str, judge=None, judge_qa: bool = True, ks: Optional[Sequence[int]] = None
) -> dict:
  """Scores every record of `run_dir` under `protocol` into `output` (its JSONL files and summary); returns the
  summary. `judge`: the LLM judge the protocol uses (None: without one, as `--nojudge`); ks default: the run's."""
  source = _report.load_summary(run_dir)
  if os.path.abspath(output) == os.path.abspath(run_dir):
    raise ValueError(f"--output={output!r} is the run being rescored; give a new directory (nothing is overwritten)")
  names = list(source.get("benchmarks", {}))
  if not names:
    raise ValueError(f"{run_dir!r} has no benchmark in its {_report.SUMMARY_JSON}; nothing to rescore")
  if ks is None:
    ks = sorted(
      {int(k[len("pass@") :]) for b in source["benchmarks"].values() for k in b if re.fullmatch(r"pass@\d+", k)}
    )
  scorer = Scorer(judge, judge_qa=judge_qa, protocol=protocol)
  os.makedirs(output, exist_ok=True)
  results, families = {}, {}
  for name in names:
    path = os.path.join(run_dir, f"{name}.jsonl")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{path} is missing: {run_dir!r} lists {name} in its summary but has no records for it")
    records = []
    for old in read_records(path, repair=False):
      rec = {k: old[k] for k in GENERATION_KEYS if k in old}
      prediction = TIMEOUT_PREDICTION if old.get("stop_reason") == "timeout" else None
      ex = _example(old)
      rec.update(
        scorer.score(ex, old["response"]) if prediction is None else scorer.score(ex, old["response"], prediction)
      )
      records.append(rec)
    _write_records(os.path.join(output, f"{name}.jsonl"), records)
    results[name], families[name] = records, source["benchmarks"][name].get("family", "")
  meta = {k: v for k, v in source.items() if k != "benchmarks"}
  meta.update(protocol=protocol, rescored_from=os.path.abspath(run_dir), source_protocol=source.get("protocol"))
  return _report.write_summary(output, results, ks=ks, families=families, meta=meta)


def _records(run_dir: str, name: str) -> dict:
  return {(r["id"], r["sample"]): r for r in read_records(os.path.join(run_dir, f"{name}.jsonl"), repair=False)}


def _mean(xs) -> Optional[float]:
  xs = [float(x) for x in xs if x is not None]
  return sum(xs) / len(xs) if xs else None


def protocol_differences(run_a: str, run_b: str) -> str:
  """A markdown table of two scorings of the same answers: per benchmark, the share correct under each, the
  answers each alone counts correct, and the means of the metrics both records carry (em, f1, ...)."""
  a_sum, b_sum = _report.load_summary(run_a), _report.load_summary(run_b)
  pa, pb = a_sum.get("protocol", "?"), b_sum.get("protocol", "?")
  lines = [
    f"| benchmark | answers | correct ({pa}) | correct ({pb}) | only {pa} | only {pb} | metric means ({pa} / {pb}) |",
    "|---|---|---|---|---|---|---|",
  ]
  for name in a_sum.get("benchmarks", {}):
    ra, rb = _records(run_a, name), _records(run_b, name)
    keys = sorted(set(ra) & set(rb), key=str)
    if not keys:
      continue
    if any(ra[k]["response"] != rb[k]["response"] for k in keys):
      raise ValueError(f"{run_a} and {run_b} hold different answers for {name}: rescore one run, do not rerun it")
    ca = [bool(ra[k].get("correct")) for k in keys]
    cb = [bool(rb[k].get("correct")) for k in keys]
    shared = [m for m in ("em", "f1", "acc", "math_equal", "llm_equal") if any(m in ra[k] and m in rb[k] for k in keys)]
    means = []
    for m in shared:
      x, y = _mean(ra[k].get(m) for k in keys), _mean(rb[k].get(m) for k in keys)
      if x is not None and y is not None:
        means.append(f"{m} {x:.3f} / {y:.3f}")
    lines.append(
      f"| {name} | {len(keys)} | {_mean(ca):.3f} | {_mean(cb):.3f} | {sum(x and not y for x, y in zip(ca, cb))} | "
      f"{sum(y and not x for x, y in zip(ca, cb))} | {'; '.join(means) or '-'} |"
    )
  return "\n".join(lines) + "\n"


def disagreements(run_a: str, run_b: str, limit: int = 20) -> list[dict]:
  """Up to `limit` answers the two scorings judge differently: benchmark, id, sample, gold, both extractions."""
  out = []
  for name in _report.load_summary(run_a).get("benchmarks", {}):
    ra, rb = _records(run_a, name), _records(run_b, name)
    for k in sorted(set(ra) & set(rb), key=str):
      if bool(ra[k].get("correct")) != bool(rb[k].get("correct")):
        out.append(
          {
            "benchmark": name,
            "id": k[0],
            "sample": k[1],
            "answers": ra[k]["answers"],
            "a": {"correct": ra[k].get("correct"), "extracted": ra[k].get("extracted"), "scorer": ra[k].get("scorer")},
            "b": {"correct": rb[k].get("correct"), "extracted": rb[k].get("extracted"), "scorer": rb[k].get("scorer")},
          }
        )
        if len(out) >= limit:
          return out
  return out
