r"""Render a run's curves to PNG: reward, accuracy, entropy, clip fractions, KL, grad norm, branches, tools, slot
occupancy (over steps, and over the rollout phase of a few steps).

  python launch/plot.py --workdir=/tmp/aepo_cpu            # -> /tmp/aepo_cpu/plots/*.png (+ overview.png)
  python launch/plot.py --workdir=gs://BUCKET/run --out=/tmp/plots

Reads `metrics.jsonl` (and `histograms.jsonl` for the entropy distribution); panels whose metrics the run
did not log are left out.
"""

import os
import re
import sys

from absl import app, flags

if not __package__:  # run as a script from a checkout (not as `python -m aepo_jax.launch.NAME`)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_WORKDIR = flags.DEFINE_string("workdir", None, "The run's work directory (local or gs://).")
_OUT = flags.DEFINE_string("out", None, "Output folder (default: <workdir>/plots; local only).")

# panel name -> regexes of the metric names it shows
PANELS = {
  "reward": [r"^reward/mean$"],
  "format_errors": [r"^reward/format_errors$"],
  "accuracy": [r"^eval/.*accuracy$"],
  "entropy": [r"^actor/entropy_mean$", r"^rollout/sampler_entropy_mean$", r"^rollout/entropy_(initial|after_tool)$"],
  "clip_fractions": [r"^actor/.*clipfrac.*$"],
  "kl": [r"^actor/ppo_kl$", r"^actor/kl_loss$", r"^mismatch/logprob_abs_diff_mean$"],
  "grad_norm": [r"^train/grad_norm$", r"^sft/grad_norm$"],
  "branches": [
    r"^rollout/branches_per_prompt$",
    r"^rollout/(top3|consecutive)_branch_share$",
    r"^rollout/tree_depth_mean$",
  ],
  "tool_calls": [
    r"^rollout/tool_calls.*$",
    r"^tools/.*(calls|timeouts|failures|errors).*$",
    r"^rollout/tool_failures$",
  ],
  "slot_occupancy": [r"^rollout/slot_occupancy$", r"^rollout/occupancy_wall$"],
  "sft_nll": [r"^sft/nll$"],
  "throughput": [r"^perf/tokens_per_s$"],
  "time": [r"^perf/(rollout|reward|logprob|update|step)_s$"],
}


# y-axis label of each panel
UNITS = {
  "reward": "reward",
  "format_errors": "fraction of answers",
  "accuracy": "accuracy",
  "entropy": "nats",
  "clip_fractions": "fraction of tokens",
  "kl": "nats",
  "grad_norm": "L2 norm",
  "branches": "count",
  "tool_calls": "calls",
  "slot_occupancy": "share of slots sampling",
  "sft_nll": "nats per token",
  "throughput": "tokens / s",
  "time": "seconds per step",
}


def _is_sft(record) -> bool:
  return "sft/step" in record or any(k.startswith("sft/") for k in record)


def global_steps(records) -> list:
  """x of each record on one axis for the whole run: SFT steps 1..S, then RL step r at S + r (evaluations before
  RL at S), so a metric both phases log (throughput, step time) never jumps back."""
  sft_total = max((int(r["step"]) for r in records if _is_sft(r)), default=0)
  return [int(r["step"]) if _is_sft(r) else sft_total + int(r["step"]) for r in records]


def series(records, name, xs_all=None):
  """(xs, ys) of one metric on the global step axis, sorted by x (a step logged twice: the last record wins), so
  no line ever runs back in x whatever order the phases wrote their records in."""
  xs_all = global_steps(records) if xs_all is None else xs_all
  by_x = {}
  for r, x in zip(records, xs_all):
    v = r.get(name)
    if v is not None:
      by_x[x] = v
  xs = sorted(by_x)
  return xs, [by_x[x] for x in xs]


def _draw(ax, xs, ys, name, small=False):
  """Evaluations (a handful of points) as markers only; training series as lines (markers while short)."""
  if name.startswith("eval/"):
    ax.plot(xs, ys, ls="none", marker="D", ms=5, label=name)
  else:
    ax.plot(xs, ys, marker="o" if len(xs) < 30 and not small else None, ms=3, label=name)


def _phase_marker(ax, records, xs_all):
  """A dashed line where SFT ends and RL begins (when the run has both), labelled inside the axes, below the title."""
  sft = [x for r, x in zip(records, xs_all) if _is_sft(r)]
  if sft and len(sft) < len(records):
    x = max(sft) + 0.5
    ax.axvline(x, color="grey", ls="--", lw=0.8)
    style = dict(transform=ax.get_xaxis_transform(), fontsize=7, va="bottom", color="grey")
    ax.text(x, 0.02, " RL", **style)
    ax.text(x, 0.02, "SFT ", ha="right", **style)


def plot_run(workdir: str, out: str) -> list[str]:
  """Write one PNG per panel with data, plus overview.png; returns the written paths."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from aepo_jax.train import HISTOGRAMS_FILE, read_metrics

  records = read_metrics(workdir)
  names = sorted({k for r in records for k in r if k not in ("step", "time")})
  os.makedirs(out, exist_ok=True)
  panels = {}
  for panel, patterns in PANELS.items():
    chosen = [n for n in names if any(re.match(p, n) for p in patterns)]
    # SFT and RL steps share the axis in one file; keep SFT-only curves apart from RL ones by prefix.
    if chosen:
      panels[panel] = chosen
  written = []
  xs_all = global_steps(records)
  xlabel = "step (SFT, then RL)" if any(_is_sft(r) for r in records) else "step"
  for panel, chosen in panels.items():
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for n in chosen:
      _draw(ax, *series(records, n, xs_all), n)
    _phase_marker(ax, records, xs_all)
    ax.set_title(panel.replace("_", " "))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(UNITS.get(panel, ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, f"{panel}.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
  sft_total = max((int(r["step"]) for r in records if _is_sft(r)), default=0)
  written += _entropy_histograms(workdir, out, plt, HISTOGRAMS_FILE, read_metrics, sft_total)
  written += _occupancy_profiles(records, out, plt, sft_total)
  if panels:
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3 * rows), squeeze=False)
    for ax, (panel, chosen) in zip(axes.ravel(), panels.items()):
      for n in chosen:
        _draw(ax, *series(records, n, xs_all), n, small=True)
      _phase_marker(ax, records, xs_all)
      ax.set_title(panel.replace("_", " "))
      ax.set_xlabel(xlabel, fontsize=7)
      ax.set_ylabel(UNITS.get(panel, ""), fontsize=7)
      ax.legend(fontsize=6)
      ax.grid(alpha=0.3)
    for ax in axes.ravel()[len(panels) :]:
      ax.axis("off")
    fig.tight_layout()
    path = os.path.join(out, "overview.png")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    written.append(path)
  return written


def _entropy_histograms(workdir, out, plt, hist_file, read_metrics, sft_total=0):
  """The token-entropy distribution at a few RL steps (first, middle, last), from histograms.jsonl, labelled with
  the same global step numbers as the curves (RL step r is step sft_total + r)."""
  try:
    hists = [h for h in read_metrics(workdir, hist_file) if h.get("name") == "actor/entropy" and h.get("count")]
  except FileNotFoundError:
    return []
  if not hists:
    return []
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for h in _first_middle_last(hists):
    edges = h["edges"]
    centers = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
    total = max(sum(h["counts"]), 1)
    ax.plot(centers, [c / total for c in h["counts"]], label=f"step {sft_total + int(h['step'])} (RL {h['step']})")
  ax.set_title("token entropy distribution")
  ax.set_xlabel("entropy (nats)")
  return _save(fig, ax, plt, out, "entropy_histogram.png")


def _first_middle_last(rows: list) -> list:
  return list({id(r): r for r in (rows[0], rows[len(rows) // 2], rows[-1])}.values())


def _save(fig, ax, plt, out, name) -> list:
  """The legend, then the figure as out/name; [its path]."""
  ax.legend(fontsize=7)
  fig.tight_layout()
  path = os.path.join(out, name)
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return [path]


def _occupancy_profiles(records, out, plt, sft_total=0):
  """The share of rollout slots sampling over each RL step's rollout phase (rollout/occupancy_t00 .. t90, tenths of
  its wall time) at a few steps (first, middle, last): the tail, where a few trajectories finish while the rest
  of the slots wait, is the drop at the right."""
  keys = sorted(k for k in {k for r in records for k in r} if re.match(r"^rollout/occupancy_t\d\d$", k))
  rows = [r for r in records if not _is_sft(r) and all(k in r for k in keys)] if keys else []
  if not rows:
    return []
  xs = [int(k[-2:]) + 50 / len(keys) for k in keys]  # the middle of each bin, in % of the phase
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for r in _first_middle_last(rows):
    ax.plot(xs, [r[k] for k in keys], marker="o", ms=3, label=f"step {sft_total + int(r['step'])} (RL {r['step']})")
  ax.set(title="slot occupancy over the rollout phase", xlabel="% of the step's rollout time", xlim=(0, 100))
  ax.set_ylabel("share of slots sampling")
  ax.set_ylim(bottom=0)
  ax.grid(alpha=0.3)
  return _save(fig, ax, plt, out, "occupancy_profile.png")


def main(argv):
  del argv
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required")
  out = _OUT.value or os.path.join(_WORKDIR.value, "plots")
  if out.startswith("gs://"):
    raise app.UsageError("--out must be a local folder when --workdir is on gs://")
  for path in plot_run(_WORKDIR.value, out):
    print(path)


if __name__ == "__main__":
  app.run(main)
