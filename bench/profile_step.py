"""Where the wall time of one SFT update step goes on CPU: an XLA:CPU trace attributed op by op.

  python bench/profile_step.py                    # SmolLM2-135M, 8 x 256 tokens, logit_fraction 0.5 (cpu_default)
  python bench/profile_step.py --rows 4 --len 128 --top 20

Traces one step (after a compile-and-run step) with `jax.profiler.trace(create_perfetto_trace=True)` and
`--xla_cpu_enable_xprof_traceme=true`, then splits every microsecond of wall time evenly between the XLA ops
running in it (two cores run independent ops concurrently, so summed op durations overstate the wall time), and
names each op by the `op_name` of the compiled HLO (forward or backward, which projection). Prints the wall share
per category (dots by projection, copies/transposes, other element-wise ops) and the top ops with their output
shapes. Caveat: dots that XLA runs through Eigen (`dot.N`, e.g. some weight gradients) execute asynchronously on
the Eigen pool; their time shows up inside the ops that run meanwhile and as "no op running".
Findings on the development VM: docs/performance.md, "Update step".
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import re
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from aepo_jax.parallel import use_cpu_xla_flags  # noqa: E402

use_cpu_xla_flags()
if "xla_cpu_enable_xprof_traceme" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from aepo_jax.train import _batch, _logprob, _step  # noqa: E402

_NOT_OPS = ("ThunkExecutor", "$", "PjitFunction", "SlinkyThreadPool", "Pjit", "Execute", "PythonRefManager")


def load_model():
  from aepo_jax.model import load_pretrained, preset, init_params

  try:
    return (*load_pretrained("smollm2-135m-instruct"), "SmolLM2-135M-Instruct")
  except Exception as e:  # noqa: BLE001 - the package is optional: random weights of the same shapes
    cfg = preset("smollm2-135m")
    return cfg, init_params(cfg, jax.random.PRNGKey(0)), f"random smollm2-135m weights ({type(e).__name__})"


_CONTAINER = re.compile(r"^(while|cond|conditional|call)(\.\d+)?$")


def wall_shares(events):
  """{event index: seconds of wall time}, each instant split evenly between the ops running in it; and the wall
  time in which at least one op ran. Control-flow ops (while, cond, call) span their bodies' ops: they get time only
  when none of those runs (loop bookkeeping, copies of the loop state), not a share of their children's."""
  points = sorted(
    [(e["ts"], 1, i) for i, e in enumerate(events)] + [(e["ts"] + e["dur"], -1, i) for i, e in enumerate(events)]
  )
  container = {i for i, e in enumerate(events) if _CONTAINER.match(e["name"])}
  share, active, last, busy = collections.defaultdict(float), set(), None, 0.0
  for t, kind, i in points:
    if last is not None and active:
      busy += t - last
      leaves = (active - container) or active
      for j in leaves:
        share[j] += (t - last) / len(leaves)
    last = t
    (active.add if kind == 1 else active.discard)(i)
  return {i: s / 1e6 for i, s in share.items()}, busy / 1e6


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--len", type=int, default=256)
  ap.add_argument("--logit-fraction", type=float, default=0.5)
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument(
    "--step",
    choices=("sft", "rl"),
    default="sft",
    help="sft: make_sft_step on SFT-like rows; rl: bench/train_step.py's PPO update step and batch",
  )
  args = ap.parse_args()

  cfg, params, what = load_model()
  opt = optax.adamw(1e-5)
  params, opt_state = _step.init_train_state(cfg, params, opt)
  if args.step == "rl":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_step import rl_batch  # the update-step benchmark's batch

    step = _step.make_update_step(cfg, loss_fn="ppo", optimizer=opt, micro_batches=1, logprob_chunk=128)
    batch = {k: jnp.asarray(v) for k, v in rl_batch(args.rows, args.len, cfg.vocab_size).items()}
  else:
    step = _step.make_sft_step(
      cfg,
      optimizer=opt,
      micro_batches=1,
      logit_capacity=_logprob.logit_capacity(args.logit_fraction, args.rows, args.len),
    )
    rng = np.random.default_rng(0)
    examples = []
    for _ in range(args.rows):
      n = int(rng.integers(args.len // 3, args.len))
      examples.append((rng.integers(0, cfg.vocab_size, n).tolist(), [0] * (n // 4) + [1] * (n - n // 4)))
    batch = {
      k: jnp.asarray(v)
      for k, v in _batch.sft_batch(examples, micro_batch_size=args.rows, pad_id=0, seq_len=args.len).items()
    }
  hlo = step.lower(params, opt_state, batch).compile().as_text()
  names = {
    m.group(1): (m.group(2), m.group(3))
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) .*?op_name=\"([^\"]+)\"", hlo, re.M)
  }
  t = time.perf_counter()
  params, opt_state, m = step(params, opt_state, batch)
  jax.block_until_ready(m)
  print(f"model: {what}; batch {args.rows} x {args.len}; first step (compile + run) {time.perf_counter() - t:.1f} s")

  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      t = time.perf_counter()
      params, opt_state, m = step(params, opt_state, batch)
      jax.block_until_ready(m)
      wall = time.perf_counter() - t
    trace = json.load(gzip.open(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]))
  events = [
    e
    for e in (trace["traceEvents"] if isinstance(trace, dict) else trace)
    if e.get("ph") == "X" and e.get("dur", 0) > 0 and not e["name"].startswith(_NOT_OPS)
  ]
  share, busy = wall_shares(events)
  by_op, calls = collections.defaultdict(float), collections.Counter()
  for i, s in share.items():
    by_op[events[i]["name"]] += s
    calls[events[i]["name"]] += 1

  def category(op):
    shape, op_name = names.get(op, ("?", "?"))
    side = "backward" if "transpose(jvp" in op_name else "forward"
    if op.startswith(("ynn_fusion", "dot")):
      return f"{side} dot {op_name.split('/')[-2]}"
    return f"{side} {'copy/transpose' if 'copy' in op or 'transpose' in op else 'other element-wise'}"

  by_cat = collections.defaultdict(float)
  for op, s in by_op.items():
    by_cat[category(op)] += s
  print(f"traced step {wall:.2f} s wall; some op running {busy:.2f} s; no op running {wall - busy:.2f} s")
  print(f"\n{'wall s':>7}  category")
  for c, s in sorted(by_cat.items(), key=lambda x: -x[1]):
    if s >= 0.01:
      print(f"{s:7.2f}  {c}")
  print(f"\n{'wall s':>7} {'calls':>5}  {'op':32s} {'output':36s} HLO op_name (end)")
  for op, s in sorted(by_op.items(), key=lambda x: -x[1])[: args.top]:
    shape, op_name = names.get(op, ("?", "?"))
    print(f"{s:7.2f} {calls[op]:5d}  {op:32s} {shape:36s} {op_name[-70:]}")


if __name__ == "__main__":
  main()
