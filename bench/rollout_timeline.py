r"""Where a rollout's wall time goes, engine op by engine op: the synchronous step against partial rollouts.

  python bench/rollout_timeline.py --init=/tmp/partial/sft/seed0/work/checkpoints/sft --steps=5 \
      --arms=config+train.max_staleness=0,config+train.max_staleness=1+algo.off_policy=decoupled+rollout.max_slots=32

Each arm (an algorithm label of bench/compare_algorithms.py on --config: `config` or a preset, `+KEY=VALUE...`) trains --steps RL steps in this
process, from --init (an SFT run's checkpoint; without it the config's own model.init), with no evaluation. Every
engine call (add = prompt prefill, extend = tool results, copy_slots = forks, decode, the small state edits) is
timed with `jax.block_until_ready` on what it returns, exclusive of the calls nested in it (the CPU decode kernel's
weight transposes at a new policy version are their own line), and so is every wait for a tool with no slot
decoding. Per arm, over the rollout calls after the first (compiles excluded): seconds per call in each, tokens,
decode steps and calls, the rows sampling a step and the rows computed a step (the row sizes `Engine._decode_rows`
chose; every row computes through the call's steps); then each arm's sampled tokens per rollout second against the
first arm's, measured in this run. The rest of a call ("host") is the agent loop's Python: parsing, tokenising
results, bookkeeping.

Caveat: blocking after each call serialises the host's Python with the device's work, which JAX's asynchronous
dispatch would otherwise overlap (on CPU both share the same cores, so little is lost); the trainer's own
`perf/rollout_s` of these runs includes that. Findings: docs/results.md, "Where a rollout's time goes".
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from aepo_jax.parallel import use_cpu_xla_flags  # noqa: E402

use_cpu_xla_flags()

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_algorithms  # noqa: E402  (its algorithm labels: presets, `config`, +KEY=VALUE)

OTHER_OPS = ("truncate", "release", "set_segment", "resume", "host_info")  # small state edits: one line together
OPS = ("add", "extend", "copy_slots", "decode") + OTHER_OPS


class Timeline:
  """Exclusive seconds per op within the current rollout call, plus tokens, decode steps and rows."""

  def __init__(self):
    self.calls: list = []  # one dict per rollout call
    self._stack: list = []
    self.current = None

  def begin(self):
    self.current = collections.defaultdict(float)
    self.current["_t0"] = time.perf_counter()

  def end(self):
    if self.current is not None:
      self.current["wall"] = time.perf_counter() - self.current.pop("_t0")
      self.calls.append(dict(self.current))
    self.current = None

  def timed(self, name, fn, count=None):
    def wrapper(*args, **kwargs):
      if self.current is None:
        return fn(*args, **kwargs)
      self._stack.append(0.0)
      t0 = time.perf_counter()
      out = fn(*args, **kwargs)
      jax.block_until_ready(out)
      dt = time.perf_counter() - t0
      nested = self._stack.pop()
      self.current[name + "_s"] += dt - nested
      if self._stack:
        self._stack[-1] += dt
      if count is not None:
        for key, value in count(args, kwargs, out).items():
          self.current[key] += value
      return out

    return wrapper


def _tokens(op):  # add / extend (self, params, state, slots, token_lists, ...)
  return lambda args, kwargs, out: {"tokens_" + op: sum(len(t) for t in args[4])}


_LAST_ROWS = {"rows": None}  # rows of the decode call in progress, as Engine._decode_rows chose them (None: every slot)


def _decode_count(args, kwargs, out):
  valid = np.asarray(jax.device_get(out[1].valid), bool)  # [S, steps]
  steps = int(valid.any(axis=0).sum())
  rows = _LAST_ROWS.pop("rows", None) or valid.shape[0]
  return {"tokens_decode": int(valid.sum()), "decode_steps": steps, "decode_calls": 1, "row_steps": rows * steps}


def _recording_rows(fn):
  def wrapper(*args, **kwargs):
    rows = fn(*args, **kwargs)
    _LAST_ROWS["rows"] = None if rows is None else int(rows.shape[0])
    return rows

  return wrapper


def install(timeline: Timeline) -> None:
  from aepo_jax.rollout import _agent, _compiled, _engine, _partial

  cls = _engine.Engine
  for op in OPS:
    count = {"add": _tokens("add"), "extend": _tokens("extend"), "decode": _decode_count}.get(op)
    setattr(cls, op, timeline.timed(op, getattr(cls, op), count))
  cls._decode_rows = _recording_rows(cls._decode_rows)
  pw = _compiled.prepared_weights
  pw.get = timeline.timed("weights_transpose", pw.get)
  # concurrent.futures.wait is the agent loop's only blocking wait on tools (process-wide patch: a bench process)
  concurrent.futures.wait = timeline.timed("tool_wait", concurrent.futures.wait)

  def call_boundary(fn):
    def wrapper(*args, **kwargs):
      timeline.begin()
      try:
        return fn(*args, **kwargs)
      finally:
        timeline.end()

    return wrapper

  _agent.AgentLoop.rollout = call_boundary(_agent.AgentLoop.rollout)
  _partial.PartialRollouts.__call__ = call_boundary(_partial.PartialRollouts.__call__)


def arm_config(args, arm: str, workdir: str):
  from aepo_jax import train

  path, _, carg = args.config.partition(":")
  c, _ = compare_algorithms.algorithm_config(train.load_config(path, carg or None), arm)
  c.mode = "rl"
  c.train.steps = args.steps
  c.eval.before_rl = c.eval.after_rl = False
  c.train.eval_every = 0
  c.metrics.progress = False
  c.checkpoint.every_steps = 10**6  # only the final save
  c.checkpoint.best_metric = ""
  c.train.seed = c.sft.seed = c.data.seed = args.seed
  if args.init:
    c.model.init, c.model.name = "checkpoint", args.init
  c.workdir = workdir
  return c


def summarize(calls: list) -> dict:
  keys = sorted({k for c in calls for k in c})
  mean = {k: float(np.mean([c.get(k, 0.0) for c in calls])) for k in keys}
  ops = sum(v for k, v in mean.items() if k.endswith("_s"))
  mean["host_s"] = max(mean["wall"] - ops, 0.0)
  return mean


def report(results: dict) -> str:
  lines = []
  rows = [
    ("wall", "seconds per rollout call"),
    ("decode_s", "  decode"),
    ("weights_transpose_s", "  weight transposes (CPU kernel, new version)"),
    ("add_s", "  prefill of prompts (add)"),
    ("extend_s", "  prefill of tool results (extend)"),
    ("copy_slots_s", "  forks (copy_slots)"),
    ("tool_wait_s", "  waiting for tools, nothing decoding"),
    ("other_ops_s", "  truncate, release, set_segment, resume, host_info"),
    ("host_s", "  host (agent loop's Python)"),
    ("tokens_decode", "sampled tokens per call"),
    ("decode_steps", "decode steps per call"),
    ("rows", "rows per decode step"),
    ("decode_calls", "decode calls (chunks) per call"),
    ("rows_run", "rows computed per decode step (the calls' row sizes)"),
    ("ms_step", "ms per decode step"),
    ("tokens_add", "prompt tokens prefilled per call"),
    ("tokens_extend", "tool-result tokens prefilled per call"),
    ("ms_prefill_token", "ms per prefilled token (add + extend)"),
    ("tok_s", "sampled tokens per rollout second"),
    ("decode_share", "share of the call in decode"),
  ]
  for m in results.values():
    m["other_ops_s"] = sum(m.get(op + "_s", 0.0) for op in OTHER_OPS)
    m["rows"] = m.get("tokens_decode", 0.0) / max(m.get("decode_steps", 0.0), 1.0)
    m["rows_run"] = m.get("row_steps", 0.0) / max(m.get("decode_steps", 0.0), 1.0)
    m["ms_step"] = 1e3 * m.get("decode_s", 0.0) / max(m.get("decode_steps", 0.0), 1.0)
    pre = m.get("tokens_add", 0.0) + m.get("tokens_extend", 0.0)
    m["ms_prefill_token"] = 1e3 * (m.get("add_s", 0.0) + m.get("extend_s", 0.0)) / max(pre, 1.0)
    m["tok_s"] = m.get("tokens_decode", 0.0) / max(m["wall"], 1e-9)
    m["decode_share"] = (m.get("decode_s", 0.0) + m.get("weights_transpose_s", 0.0)) / max(m["wall"], 1e-9)
  names = list(results)
  lines.append("| | " + " | ".join(f"arm {i}" for i in range(len(names))) + " |")
  lines.append("|---" * (len(names) + 1) + "|")
  for key, label in rows:
    lines.append(f"| {label} | " + " | ".join(f"{results[n].get(key, 0.0):.3g}" for n in names) + " |")
  base = results[names[0]]["tok_s"]
  lines.append(
    "| sampled tokens per rollout second, vs arm 0 | "
    + " | ".join(f"{results[n]['tok_s'] / max(base, 1e-9):.2f}x" for n in names)
    + " |"
  )
  lines.append("")
  lines += [f"arm {i}: {n} ({int(results[n]['calls'])} calls)" for i, n in enumerate(names)]
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--config", default="configs/cpu_default.py")
  p.add_argument("--init", default="", help="checkpoint to start RL from (an SFT run's checkpoints/sft)")
  p.add_argument(
    "--arms",
    default="config+train.max_staleness=0,config+train.max_staleness=1+algo.off_policy=decoupled+rollout.max_slots=32",
    help="comma-separated labels, as bench/compare_algorithms.py's --algorithms takes them",
  )
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args()
  from aepo_jax import logs, train

  logs.setup()
  timeline = Timeline()
  install(timeline)
  results = {}
  for arm in args.arms.split(","):
    with tempfile.TemporaryDirectory(prefix="aepo_timeline_") as work:
      timeline.calls = []
      train.run(arm_config(args, arm, work))
      calls = timeline.calls[1:]  # the first call compiles
      if not calls:
        raise SystemExit(f"--steps={args.steps}: arm {arm!r} made {len(timeline.calls)} rollout call(s); use >= 2.")
      results[arm] = summarize(calls)
      results[arm]["calls"] = len(calls)
      print(f"{arm}: {len(calls)} calls timed", flush=True)
  print(report(results))


if __name__ == "__main__":
  main()
