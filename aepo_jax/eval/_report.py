"""Summaries of an evaluation run (JSON + markdown) and side-by-side comparisons of runs (markdown + PNG).

Per benchmark: Pass@k by the unbiased estimator for every k <= n (with 95% bootstrap CIs over questions), the
papers' best-of-k ("Pass@5 = best of 5 independent runs", named `best_of_k`), mean EM/F1 for QA sets, which
scorers decided, judge failures, tool calls and response lengths.
"""

from __future__ import annotations

import collections
import json
import os
from typing import Optional, Sequence

import numpy as np

from aepo_jax.eval._passk import summarize

SUMMARY_JSON, SUMMARY_MD = "summary.json", "summary.md"


def summarize_records(records: Sequence[dict], ks: Sequence[int]) -> dict:
  """Metrics of one benchmark's records (every question must have the same samples 0..n-1)."""
  by_q: dict = collections.defaultdict(dict)
  for r in records:
    by_q[r["id"]][r["sample"]] = r
  if not by_q:
    raise ValueError("summarize_records: no records.")
  correct = [[bool(s[k]["correct"]) for k in sorted(s)] for s in by_q.values()]
  scores = [[float(s[k]["score"]) for k in sorted(s)] for s in by_q.values()]
  out = summarize(correct, [k for k in ks if k >= 1], scores=scores)
  out["accuracy"] = float(np.mean([x for row in scores for x in row]))  # mean over all answers (= pass@1)
  out["num_answers"] = len(records)
  for key in ("em", "f1"):
    vals = [r[key] for r in records if r.get(key) is not None]
    if vals:
      out[key] = float(np.mean(vals))
  out["scorers"] = dict(collections.Counter(r.get("scorer", "") for r in records))
  out["judge_failures"] = sum(1 for r in records if r.get("judge_error"))
  out["no_answer"] = sum(1 for r in records if not r.get("extracted"))
  out["tool_calls_mean"] = float(np.mean([r.get("num_tool_calls", 0) for r in records]))
  out["response_len_mean"] = float(np.mean([r.get("response_len", 0) for r in records]))
  protocols = sorted({r.get("protocol", "project") for r in records})
  out["protocol"] = protocols[0] if len(protocols) == 1 else "mixed: " + ",".join(protocols)
  if protocols == ["official"]:
    out["official"] = official_overall(records)
  return out


def official_overall(records: Sequence[dict], sigma: float = 0.1) -> dict:
  """The official `Evaluator.calculate_overall_metrics` over the records (every sample of every question counted
  once, as the official evaluator does over one output file; with n samples per question this is the mean over the
  n runs): em, acc, f1, math_equal, llm_equal (only when judged), num_valid_answer, tool_call (mean python + search
  calls), average_python_calls, average_search_calls, average_datas_used_tool_number (the share of answers that
  called a tool), output_length (mean characters without tool results; the official code records it per sample)
  and tool_productivity."""
  n = len(records)

  def mean(key):
    vals = [float(r[key]) for r in records if r.get(key) is not None]
    return float(np.mean(vals)) if vals else 0.0

  tool_counts = [r.get("tool_counts", 0) for r in records]
  avg_tool = float(np.mean(tool_counts)) if tool_counts else 0.0
  judged = [r for r in records if r.get("llm_equal") is not None]
  out = {
    "em": mean("em"),
    "acc": mean("acc"),
    "f1": mean("f1"),
    "math_equal": mean("math_equal"),
    "num_valid_answer": f"{sum(1 for r in records if r.get('is_valid_answer'))} of {n}",
    "tool_call": avg_tool,
    "average_python_calls": mean("python_calls"),
    "average_search_calls": mean("search_calls"),
    "average_datas_used_tool_number": sum(1 for c in tool_counts if c > 0) / n if n else 0.0,
    "output_length": mean("output_length"),
  }
  if judged:
    out["llm_equal"] = float(np.mean([float(r["llm_equal"]) for r in judged]))
  final = out["llm_equal"] if judged else float(np.mean([float(r["score"]) for r in records]))
  out["tool_productivity"] = final * avg_tool / (avg_tool + sigma) * 100.0 if avg_tool + sigma else 0.0
  return out


def _fmt(x: Optional[float]) -> str:
  return "-" if x is None else f"{100 * x:.1f}"


def summary_markdown(summary: dict) -> str:
  """One row per benchmark: Pass@1, Pass@k (unbiased, with CI), best-of-k, EM/F1, judge failures."""
  benches = summary["benchmarks"]
  ks = sorted(
    {int(k.split("@")[1]) for b in benches.values() for k in b if k.startswith("pass@") and not k.endswith("_ci95")}
  )
  head = ["benchmark", "family", "questions", "n"] + [f"pass@{k} (95% CI)" for k in ks]
  head += [f"best_of_{k}" for k in ks if k > 1] + ["EM", "F1", "judge fail", "tool calls"]
  protocols = sorted({b.get("protocol", "project") for b in benches.values()}) or [summary.get("protocol", "project")]
  lines = [
    f"# Evaluation of {summary.get('checkpoint', '?')}",
    "",
    f"protocol: {summary.get('protocol') or ', '.join(protocols)} (scoring: 'official' = the official ARPO/AEPO "
    "evaluator's metrics, 'project' = math-verify and the strict judge; docs/evaluation.md)",
    "",
    f"settings: `{json.dumps(summary.get('settings', {}), sort_keys=True)}`",
    "",
    "| " + " | ".join(head) + " |",
    "|" + "---|" * len(head),
  ]
  for name, b in benches.items():
    row = [name, b.get("family", ""), str(b["num_questions"]), str(b["samples_per_question"])]
    for k in ks:
      v = b.get(f"pass@{k}")
      ci = b.get(f"pass@{k}_ci95")
      row.append("-" if v is None else f"{_fmt(v)} [{_fmt(ci[0])}, {_fmt(ci[1])}]")
    row += [_fmt(b.get(f"best_of_{k}")) for k in ks if k > 1]
    row += [_fmt(b.get("em")), _fmt(b.get("f1")), str(b.get("judge_failures", 0)), f"{b['tool_calls_mean']:.2f}"]
    lines.append("| " + " | ".join(row) + " |")
  official = {name: b["official"] for name, b in benches.items() if "official" in b}
  if official:
    keys = ["em", "acc", "f1", "math_equal", "llm_equal", "tool_call", "average_datas_used_tool_number"]
    lines += ["", "Official metrics (the official evaluator's overall metrics):", ""]
    lines += ["| benchmark | " + " | ".join(keys) + " | output_length | valid |", "|" + "---|" * (len(keys) + 3)]
    for name, o in official.items():
      cells = [f"{o[k]:.3f}" if k in o else "-" for k in keys]
      lines.append(f"| {name} | " + " | ".join(cells) + f" | {o['output_length']:.0f} | {o['num_valid_answer']} |")
  return "\n".join(lines) + "\n"


def write_summary(out_dir: str, results: dict, *, ks: Sequence[int], families: dict, meta: dict) -> dict:
  """results: {benchmark: records}. Writes summary.json and summary.md into out_dir; returns the summary."""
  summary = dict(meta)
  summary["benchmarks"] = {}
  for name, records in results.items():
    if records:
      summary["benchmarks"][name] = {"family": families.get(name, ""), **summarize_records(records, ks)}
  with open(os.path.join(out_dir, SUMMARY_JSON), "w") as f:
    json.dump(summary, f, indent=2, sort_keys=True)
  with open(os.path.join(out_dir, SUMMARY_MD), "w") as f:
    f.write(summary_markdown(summary))
  return summary


def load_summary(run_dir: str) -> dict:
  path = os.path.join(run_dir, SUMMARY_JSON)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{run_dir!r} has no {SUMMARY_JSON}; is it an evaluation --output directory?")
  with open(path) as f:
    return json.load(f)


def compare(run_dirs: Sequence[str], out_prefix: Optional[str] = None, metric: str = "pass@1") -> tuple[str, str]:
  """Markdown table of `metric` (and pass@k columns present in all runs) per benchmark side by side, and a PNG
  bar chart of `metric`. Returns (markdown, png path)."""
  if len(run_dirs) < 1:
    raise ValueError("compare: give at least one run directory.")
  runs = [(os.path.basename(os.path.normpath(d)) or d, load_summary(d)) for d in run_dirs]
  names = list(dict.fromkeys(b for _, s in runs for b in s["benchmarks"]))
  metrics = [
    m for m in ("pass@1", "pass@5", "best_of_5") if any(m in s["benchmarks"].get(b, {}) for _, s in runs for b in names)
  ]
  if metric not in metrics:
    metrics.insert(0, metric)
  head = ["benchmark"] + [f"{label} {m}" for m in metrics for label, _ in runs]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for b in names:
    row = [b] + [_fmt(s["benchmarks"].get(b, {}).get(m)) for m in metrics for _, s in runs]
    lines.append("| " + " | ".join(row) + " |")
  md = "\n".join(lines) + "\n"
  out_prefix = out_prefix or os.path.join(run_dirs[0], "compare")
  os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
  with open(out_prefix + ".md", "w") as f:
    f.write(md)
  png = out_prefix + ".png"
  _bar_chart(runs, names, metric, png)
  return md, png


def _bar_chart(runs, names, metric: str, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  width = 0.8 / len(runs)
  x = np.arange(len(names))
  fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names) * max(1, len(runs) / 2)), 4))
  for i, (label, s) in enumerate(runs):
    vals = [100 * s["benchmarks"].get(b, {}).get(metric, np.nan) for b in names]
    ax.bar(x + (i - (len(runs) - 1) / 2) * width, vals, width, label=label)
  ax.set_xticks(x)
  ax.set_xticklabels(names, rotation=30, ha="right")
  ax.set_ylabel(f"{metric} (%)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
