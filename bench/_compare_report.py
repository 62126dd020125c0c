"""The report of bench/compare_algorithms.py: one record per finished RL run (results.json), the table with 95%
bootstrap intervals over seeds (results.md) and the plots (plots/algorithms.png)."""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict

import numpy as np

# record key -> metric of the run's metrics.jsonl (one value per RL step)
SERIES = {
  "reward": "reward/mean",
  "tool_calls_per_traj": "rollout/tool_calls_per_traj",
  "policy_entropy": "actor/entropy_mean",  # the update batch's entropy (the trained policy, every token)
  "sampler_entropy": "rollout/sampler_entropy_mean",
  "entropy_after_tool": "rollout/entropy_after_tool",
  "entropy_initial": "rollout/entropy_initial",
  "token_entropy_after_tool": "rollout/token_entropy_after_tool",  # per token, the first 20 after a tool result
  "token_entropy_elsewhere": "rollout/token_entropy_elsewhere",  # per token, every other generated token
  "branches_per_prompt": "rollout/branches_per_prompt",
  "top3_branch_share": "rollout/top3_branch_share",
  "consecutive_branch_share": "rollout/consecutive_branch_share",
  "tree_depth_mean": "rollout/tree_depth_mean",
  "tree_depth_max": "rollout/tree_depth_max",
  "response_len": "rollout/response_len_mean",
  "step_s": "perf/step_s",
  "rollout_s": "perf/rollout_s",
  "rollout_compile_s": "perf/rollout_compile_s",  # the part of rollout_s spent compiling (new shapes)
  "trajectories": "rollout/trajectories",
  "decode_tokens": "rollout/decode_tokens",  # tokens sampled in the step's rollout (carried trajectories' too)
  "slot_occupancy": "rollout/slot_occupancy",
  "occupancy_wall": "rollout/occupancy_wall",  # the same over the rollout's wall time (prefill, tools: 0)
  "engine_slots": "rollout/engine_slots",  # the slots those are shares of
  "staleness_mean": "rollout/staleness_mean",
}
OCCUPANCY_TENTHS = [f"occupancy_t{10 * i:02d}" for i in range(10)]  # each tenth of a step's rollout wall time
SERIES.update({k: f"rollout/{k}" for k in OCCUPANCY_TENTHS})


def _read_jsonl(path: str) -> list[dict]:
  out = []
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line:
        try:
          out.append(json.loads(line))
        except ValueError:  # a line cut by a kill
          continue
  return out


def read_run(run: dict) -> dict:
  """One run's record: its per-step series and evaluations (a step logged twice, before and after a resume, counts
  once: the later line)."""
  workdir = run["config"].workdir
  train, evals = {}, {}
  for rec in _read_jsonl(os.path.join(workdir, "metrics.jsonl")):
    step = int(rec["step"])
    if "eval/accuracy" in rec:
      calls = [v for k, v in rec.items() if k.startswith("eval/") and k.endswith("/tool_calls") and "/tools/" not in k]
      evals[step] = {
        "step": step,
        "accuracy": rec["eval/accuracy"],
        "tool_calls": float(np.mean(calls)) if calls else None,
      }
    passk = {k[len("eval/") :]: v for k, v in rec.items() if k.startswith("eval/pass@")}
    if passk:  # eval.pass_k: sampled answers before and after RL, written at the same step as the greedy ones
      evals.setdefault(step, {"step": step}).update(passk)
    if "reward/mean" in rec:
      train[step] = rec
  steps = sorted(train)
  with open(os.path.join(run["dir"], "summary.json")) as f:
    summary = json.load(f)
  ev = [evals[s] for s in sorted(evals)]
  out = {
    "algorithm": run["algorithm"],
    "seed": run["seed"],
    "before_accuracy": ev[0]["accuracy"] if ev and ev[0]["step"] == 0 else None,
    "after_accuracy": ev[-1]["accuracy"] if ev and ev[-1]["step"] > 0 else None,
    "before_tool_calls": ev[0]["tool_calls"] if ev and ev[0]["step"] == 0 else None,
    "after_tool_calls": ev[-1]["tool_calls"] if ev and ev[-1]["step"] > 0 else None,
    "before_pass": {k: v for k, v in ev[0].items() if k.startswith("pass@")} if ev and ev[0]["step"] == 0 else {},
    "after_pass": {k: v for k, v in ev[-1].items() if k.startswith("pass@")} if ev and ev[-1]["step"] > 0 else {},
    "evaluations": ev,
    "steps": steps,
    "wall_s": summary.get("wall_s"),
    "kept_from_base": run["reverted"],
    "max_staleness": int(getattr(getattr(run["config"], "train", None), "max_staleness", 0)),
  }
  for name, key in SERIES.items():
    out[name] = [train[s].get(key) for s in steps]
  # Undefined, not zero: branch shares of a step without branches, the entropy after tool results without results.
  for i, s in enumerate(steps):
    if not train[s].get("rollout/branches_per_prompt"):
      out["top3_branch_share"][i] = out["consecutive_branch_share"][i] = None
    if not train[s].get("rollout/tool_calls_per_traj"):
      out["entropy_after_tool"][i] = None
    if not train[s].get("rollout/tokens_after_tool"):
      out["token_entropy_after_tool"][i] = None
  return out


def _ci(values) -> tuple:
  from aepo_jax.eval import bootstrap_ci

  v = [x for x in values if x is not None]
  if not v:
    return (None, None, None)
  lo, hi = bootstrap_ci(v, num_resamples=10000) if len(v) > 1 else (v[0], v[0])
  return float(np.mean(v)), lo, hi


def _fmt(m, lo, hi, digits=3) -> str:
  if m is None:
    return "n/a"
  return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def _step_numbers(rec: dict) -> list[int]:
  """The RL step (1-based) of each per-step entry of a run's record."""
  return rec.get("steps") or list(range(1, len(rec["rollout_s"]) + 1))


def _mean_over_steps(rec, key, last=None, window=None):
  """Mean of a per-step metric over the run (last: its last N entries; window: steps (first, last), both included)."""
  v = rec.get(key) or []
  if window:
    v = [x for x, t in zip(v, _step_numbers(rec)) if window[0] <= t <= window[1]]
  v = [x for x in v if x is not None]
  if last:
    v = v[-last:]
  return float(np.mean(v)) if v else None


def table(records: list[dict]) -> str:
  by = defaultdict(list)
  for r in records:
    by[r["algorithm"]].append(r)
  ks = sorted({k for r in records for k in r.get("after_pass", {})}, key=lambda k: int(k[len("pass@") :]))
  head = (
    "| algorithm | seeds | accuracy before RL | accuracy after RL | change | "
    + "".join(f"{k} before RL | {k} after RL | " for k in ks)
    + "tool calls per answer (after) | policy entropy, first -> last step | entropy per token: first 20 after "
    "tool results / elsewhere | branch-rule entropy after tool results / at the start | branches per prompt | "
    "top-3 branch share | consecutive branch share | minutes per run |\n" + "|---" * (14 + 2 * len(ks)) + "|\n"
  )
  rows = []
  for algo, rs in by.items():
    delta = [
      r["after_accuracy"] - r["before_accuracy"]
      for r in rs
      if r["after_accuracy"] is not None and r["before_accuracy"] is not None
    ]
    ends = [(r["policy_entropy"][0], r["policy_entropy"][-1]) for r in rs if r.get("policy_entropy")]
    ends = [(a, b) for a, b in ends if a is not None and b is not None]
    drift = f"{np.mean([a for a, _ in ends]):.3f} -> {np.mean([b for _, b in ends]):.3f}" if ends else "n/a"
    after_tool = [_mean_over_steps(r, "entropy_after_tool") for r in rs]
    initial = [_mean_over_steps(r, "entropy_initial") for r in rs]
    after_tool, initial = [x for x in after_tool if x is not None], [x for x in initial if x is not None]
    ratio = f"{np.mean(after_tool):.3f} / {np.mean(initial):.3f}" if after_tool and initial else "n/a"
    tok_after = [x for x in (_mean_over_steps(r, "token_entropy_after_tool") for r in rs) if x is not None]
    tok_else = [x for x in (_mean_over_steps(r, "token_entropy_elsewhere") for r in rs) if x is not None]
    per_token = f"{np.mean(tok_after):.3f} / {np.mean(tok_else):.3f}" if tok_after and tok_else else "n/a"
    passes = []
    for k in ks:
      passes += [
        _fmt(*_ci([r.get("before_pass", {}).get(k) for r in rs])),
        _fmt(*_ci([r.get("after_pass", {}).get(k) for r in rs])),
      ]
    rows.append(
      "| "
      + " | ".join(
        [
          algo,
          str(len(rs)),
          _fmt(*_ci([r["before_accuracy"] for r in rs])),
          _fmt(*_ci([r["after_accuracy"] for r in rs])),
          _fmt(*_ci(delta)),
          *passes,
          _fmt(*_ci([r["after_tool_calls"] for r in rs]), digits=2),
          drift,
          per_token,
          ratio,
          _fmt(*_ci([_mean_over_steps(r, "branches_per_prompt") for r in rs]), digits=2),
          _fmt(*_ci([_mean_over_steps(r, "top3_branch_share") for r in rs]), digits=2),
          _fmt(*_ci([_mean_over_steps(r, "consecutive_branch_share") for r in rs]), digits=2),
          f"{np.mean([r['wall_s'] for r in rs]) / 60:.1f}",
        ]
      )
      + " |"
    )
  return head + "\n".join(rows) + "\n"


def max_staleness(rec: dict) -> int:
  """The run's train.max_staleness: its record's, or (records written before it was kept) its label's
  'train.max_staleness=K', else 0."""
  if rec.get("max_staleness") is not None:
    return int(rec["max_staleness"])
  m = re.search(r"train\.max_staleness=(\d+)", str(rec.get("algorithm", "")))
  return int(m.group(1)) if m else 0


def trajectories_per_rollout_s(
  rec: dict,
  skip_first: bool = True,
  compiles: bool = True,
  key: str = "trajectories",
  from_step: int = 0,
  to_step: int | None = None,
) -> float | None:
  """Completed trajectories (key='decode_tokens': sampled tokens) per second of rollout time over a run's steps (the
  first step, which compiles the engine, left out when there are others); compiles=False: less the rollout's
  compile time (a later step's first call of a new shape), the steady state of a long run (runs without the metric
  count it as 0); from_step / to_step: only steps numbered from_step to to_step (1-based, both included)."""
  n = len(rec["rollout_s"])
  comp = rec.get("rollout_compile_s") or [None] * n
  numbers = _step_numbers(rec)
  pairs = [
    (t, s - (0.0 if compiles or c is None else c))
    for t, s, c, step in zip(rec.get(key) or [None] * n, rec["rollout_s"], comp, numbers)
    if t is not None and s and step >= from_step and (to_step is None or step <= to_step)
  ]
  if skip_first and len(pairs) > 1 and not from_step:
    pairs = pairs[1:]
  return sum(t for t, _ in pairs) / sum(s for _, s in pairs) if pairs else None


def _by_arm(records: list[dict]) -> tuple:
  """{arm: {seed: record}} in the records' order, its arm names, and the first arm's runs (every ratio's base)."""
  by = defaultdict(dict)
  for r in records:
    by[r["algorithm"]][r["seed"]] = r
  names = list(by)
  return by, names, by[names[0]]


def _rates(rs: dict, base: dict, **kw) -> tuple:
  """`trajectories_per_rollout_s(run, **kw)` per seed, and its ratio to the base arm's run of the same seed (only
  seeds where both have a rate)."""
  rate = {s: trajectories_per_rollout_s(r, **kw) for s, r in rs.items()}
  base_rate = {s: trajectories_per_rollout_s(r, **kw) for s, r in base.items()}
  return rate, {s: rate[s] / base_rate[s] for s in rs if rate[s] and base_rate.get(s)}


def _rate_cells(rs: dict, base: dict, digits: int = 3, **kw) -> str:
  """'rate | ratio': the mean over seeds of `trajectories_per_rollout_s(run, **kw)` and of its ratio to the base
  arm's run of the same seed, each with its interval (seeds without a rate left out)."""
  rate, ratio = _rates(rs, base, **kw)
  return f"{_fmt(*_ci([x for x in rate.values() if x]), digits=digits)} | {_fmt(*_ci(list(ratio.values())), digits=2)}"


def throughput_table(records: list[dict]) -> str:
  """Rollout throughput per algorithm, and its ratio to the first algorithm's on the same seeds."""
  by, names, base = _by_arm(records)
  out = (
    f"| algorithm | seeds | trajectories per rollout second, steps 2.. | ratio to {names[0]} (same seeds) | "
    f"steps 2.., compile time excluded | ratio to {names[0]} | all steps (the first compiles) | ratio to "
    f"{names[0]} | slot occupancy (decode steps) | slot occupancy (rollout wall time) | staleness (tokens, mean) | "
    f"tokens sampled per rollout second, steps 2.. | ratio to {names[0]} | response tokens per trajectory (mean "
    "over steps) |"
  )
  # Partial runs reach their steady state once the carried run is full (every step then hands back groups started
  # up to K steps before; with train.staleness_ramp the run fills over steps 1..K+1): the same steps of every arm.
  full_from = max(max_staleness(r) for r in records) + 2
  if full_from > 2:
    out += (
      f" trajectories per rollout second, steps {full_from}.. (every run full) | ratio to {names[0]} | tokens per "
      f"rollout second, steps {full_from}.. | ratio to {names[0]} |"
    )
  out += "\n" + "|---" * (out.count("|") - 1) + "|\n"
  for name in names:
    rs = by[name]
    cells = [
      _rate_cells(rs, base, skip_first=skip, compiles=compiles)
      for skip, compiles in ((True, True), (True, False), (False, True))
    ]
    occ = [
      _fmt(*_ci([_mean_over_steps(r, k) for r in rs.values()]), digits=2) for k in ("slot_occupancy", "occupancy_wall")
    ]
    stale = [_mean_over_steps(r, "staleness_mean") for r in rs.values()]
    # What the trajectory rate hides: a run whose trajectories got shorter (fewer tool calls) completes more a second
    # at the same sampling speed.
    toks = _rate_cells(rs, base, digits=1, key="decode_tokens")
    length = [_mean_over_steps(r, "response_len") for r in rs.values()]
    out += (
      f"| {name} | {len(rs)} | {' | '.join(cells)} | {' | '.join(occ)} | {_fmt(*_ci(stale), digits=2)} | {toks} | "
      f"{_fmt(*_ci(length), digits=1)} |"
    )
    if full_from > 2:
      out += f" {_rate_cells(rs, base, from_step=full_from)} |"
      out += f" {_rate_cells(rs, base, digits=1, key='decode_tokens', from_step=full_from)} |"
    out += "\n"
  return out


def _band(ax, records, key, color, label, x_of=None, ls="-"):
  """Mean over seeds with the min-max range shaded, per step."""
  steps = sorted({s for r in records for s in (x_of(r) if x_of else r["steps"])})
  rows = []
  for r in records:
    xs = x_of(r) if x_of else r["steps"]
    ys = [e.get("accuracy") for e in r["evaluations"]] if x_of else (r.get(key) or [None] * len(xs))
    d = dict(zip(xs, ys))
    rows.append([d.get(s) if d.get(s) is not None else np.nan for s in steps])
  a = np.asarray(rows, np.float64)
  if a.size == 0 or np.all(np.isnan(a)):
    return
  mean = np.nanmean(a, axis=0)
  ax.plot(steps, mean, marker="o", ms=3, color=color, ls=ls, label=f"{label} (n={len(records)})")
  ax.fill_between(steps, np.nanmin(a, axis=0), np.nanmax(a, axis=0), color=color, alpha=0.15, lw=0)


def occupancy_profile(rec: dict, slots: bool = False):
  """[10] mean share of slots sampling in each tenth of a step's rollout wall time, over the run's steps after the
  first (which compiles; all of them for a one-step run), or None when the run did not log it. slots=True: in
  slots (the share times the engine's slots, where the run logged them)."""
  n = len(rec.get("steps") or [])
  cols = [rec.get(k) or [None] * n for k in OCCUPANCY_TENTHS]
  if slots:
    cols.append([1.0 if x is None else x for x in rec.get("engine_slots") or [None] * n])
  rows = [r for r in (list(zip(*cols))[1:] if n > 1 else zip(*cols)) if None not in r]
  if not rows:
    return None
  a = np.asarray(rows, np.float64)
  return (a[:, :-1] * a[:, -1:] if slots else a).mean(axis=0)


def short_labels(names: list[str]) -> dict:
  """Legend labels: each name's `+` parts less those every name shares, one part per line."""
  parts = [n.split("+") for n in names]
  common = set(parts[0]).intersection(*parts[1:]) if len(parts) > 1 else set()
  return {n: "\n+".join([q for q in p if q not in common] or p) for n, p in zip(names, parts)}


def plot_labels(names: list[str]) -> tuple:
  """(legend labels, bar-axis ticks): the short labels, and as ticks too where they are short; else the ticks are
  numbers, which the legend labels then start with (long variant names overlapped under the bars)."""
  labels = short_labels(names)
  if not any("\n" in v or len(v) > 14 for v in labels.values()):
    return labels, dict(labels)
  ticks = {n: f"({i + 1})" for i, n in enumerate(names)}
  return {n: f"{ticks[n]} {labels[n]}" for n in names}, ticks


def plot(records: list[dict], path: str) -> None:
  from matplotlib.figure import Figure
  from matplotlib.lines import Line2D
  from matplotlib.ticker import MaxNLocator

  by = defaultdict(list)
  for r in records:
    by[r["algorithm"]].append(r)
  colors = dict(zip(by, ["tab:gray", "tab:blue", "tab:red", "tab:green", "tab:purple", "tab:orange", "tab:brown"]))
  labels, ticks = plot_labels(list(by))
  fig = Figure(figsize=(20, 8.5), constrained_layout=True)
  axes = fig.subplots(2, 4)
  panels = [
    (axes[0, 0], None, "held-out accuracy (greedy)"),
    (axes[0, 1], "reward", "train reward"),
    (axes[0, 2], "policy_entropy", "policy entropy of the update batch"),
    (axes[1, 0], "tool_calls_per_traj", "tool calls per trajectory"),
    (
      axes[1, 1],
      "token_entropy_after_tool",
      "sampler entropy per token: first 20 after tool results (solid), elsewhere (dashed)",
    ),
  ]
  for ax, key, title in panels:
    for algo, rs in by.items():
      if key is None:
        _band(ax, rs, None, colors[algo], labels[algo], x_of=lambda r: [e["step"] for e in r["evaluations"]])
      else:
        _band(ax, rs, key, colors[algo], labels[algo])
      if key == "token_entropy_after_tool":
        _band(ax, rs, "token_entropy_elsewhere", colors[algo], f"{labels[algo]} elsewhere", ls="--")
    ax.set_title(title)
    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
  axes[1, 3].axis("off")  # the legend's own panel: the names of a sweep's variants are long
  handles = [Line2D([], [], color=colors[a], marker="o", ms=3) for a in by]
  names_ = [f"{labels[a]} (n={len(rs)})" for a, rs in by.items()]
  axes[1, 3].legend(handles, names_, loc="center", fontsize=8, title="mean over seeds; band: seed range")
  ax = axes[0, 3]
  xs = np.arange(10) * 10 + 5
  for algo, rs in by.items():
    prof = [p for p in (occupancy_profile(r, slots=True) for r in rs) if p is not None]
    if prof:
      a = np.asarray(prof)
      ax.plot(xs, a.mean(axis=0), marker="o", ms=3, color=colors[algo])
      ax.fill_between(xs, a.min(axis=0), a.max(axis=0), color=colors[algo], alpha=0.15, lw=0)
  ax.set_title("slots sampling over a step's rollout (steps 2..)")
  ax.set_xlabel("% of the step's rollout wall time")
  ax.set_ylabel("slots sampling (mean over each tenth)")
  ax.set_xlim(0, 100)
  ax.set_ylim(bottom=0)
  ax.grid(alpha=0.3)
  ax = axes[1, 2]
  names = list(by)
  x = np.arange(len(names))
  for j, (key, label) in enumerate(
    [("top3_branch_share", "top-3 share"), ("consecutive_branch_share", "consecutive share")]
  ):
    per_seed = [[v for v in (_mean_over_steps(r, key) for r in by[n]) if v is not None] or [0.0] for n in names]
    means = [np.mean(v) for v in per_seed]
    err = np.array([[m - min(v) for m, v in zip(means, per_seed)], [max(v) - m for m, v in zip(means, per_seed)]])
    err = np.maximum(err, 0.0)  # a mean of equal values may round past them
    ax.bar(x + (j - 0.5) * 0.38, means, 0.38, yerr=err, capsize=3, label=label, color=["tab:olive", "tab:cyan"][j])
  ax.set_xticks(x, [ticks[n] for n in names], fontsize=8)
  ax.set_ylim(0, 1.05)
  ax.set_title("branch concentration (mean over steps)")
  ax.set_ylabel("share of branches (whiskers: seed range)")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3, axis="y")
  fig.savefig(path, dpi=110)


def parse_windows(text: str) -> list[tuple[int, int]]:
  """'5-12,13-20' -> [(5, 12), (13, 20)]: RL step windows, 1-based, both ends included; a bad one is named."""
  windows = []
  for part in filter(None, (p.strip() for p in (text or "").split(","))):
    m = re.fullmatch(r"(\d+)-(\d+)", part)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
      raise SystemExit(f"--windows: {part!r} is not a step window FIRST-LAST (1 <= FIRST <= LAST), e.g. 5-12,13-20.")
    windows.append((int(m.group(1)), int(m.group(2))))
  return windows


def window_table(records: list[dict], windows: list[tuple[int, int]]) -> str:
  """Per arm and step window: trajectories and sampled tokens per rollout second over those steps, as ratios to the
  first arm's run of the same seed, seed by seed and their mean (the per-seed figures a short window scatters), and
  the mean staleness per token (`rollout/staleness_mean`) over those steps, seed by seed."""
  by, names, base = _by_arm(records)
  seeds = sorted(base)
  head = " / ".join(f"seed {s}" for s in seeds)
  out = (
    f"| algorithm | steps | trajectories per rollout second vs {names[0]} ({head}) | mean | sampled tokens per "
    f"rollout second vs {names[0]} ({head}) | mean | staleness per token, mean over the steps ({head}) |\n"
    + "|---" * 7
    + "|\n"
  )

  def per_seed(values: dict, digits: int = 2) -> str:
    return " / ".join("n/a" if values.get(s) is None else f"{values[s]:.{digits}f}" for s in seeds)

  def ratio_cells(rs: dict, **kw) -> str:
    _, ratio = _rates(rs, base, **kw)
    return f"{per_seed(ratio)} | " + (f"{np.mean(list(ratio.values())):.2f}" if ratio else "n/a")

  for name in names:
    rs = by[name]
    for first, last in windows:
      kw = dict(from_step=first, to_step=last)
      stale = {s: _mean_over_steps(r, "staleness_mean", window=(first, last)) for s, r in rs.items()}
      out += (
        f"| {name} | {first}-{last} | {ratio_cells(rs, **kw)} | {ratio_cells(rs, key='decode_tokens', **kw)} | "
        f"{per_seed(stale)} |\n"
      )
  return out


def tables_from(path: str, windows: list[tuple[int, int]] = ()) -> str:
  """The report's two tables from a saved results.json (its 'records'), or an error naming the file; with windows,
  also the per-seed table of those step windows (window_table)."""
  try:
    with open(path) as f:
      records = json.load(f)["records"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise SystemExit(f"{path}: not a results.json of bench/compare_algorithms.py ({type(e).__name__}: {e}).") from e
  if not records:
    return f"{path}: no finished RL run in its records."
  return _tables(records) + ("\n" + window_table(records, windows) if windows else "")


def _tables(records: list[dict]) -> str:
  return table(records) + "\n" + throughput_table(records)


def write(out: str, runs: list[dict], spec: dict) -> list[str]:
  records = [read_run(r) for r in runs]
  paths = []
  path = os.path.join(out, "results.json")
  with open(path, "w") as f:
    json.dump({"sweep": {k: v for k, v in spec.items() if k != "out"}, "records": records}, f, indent=1)
  paths.append(path)
  md = os.path.join(out, "results.md")
  with open(md, "w") as f:
    f.write(_tables(records) if records else "no finished RL run yet\n")
  paths.append(md)
  if records:
    os.makedirs(os.path.join(out, "plots"), exist_ok=True)
    png = os.path.join(out, "plots", "algorithms.png")
    plot(records, png)
    paths.append(png)
  return paths
