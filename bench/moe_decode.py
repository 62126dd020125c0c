"""A decode step's expert block on CPU: which computation reads the fewest expert weights in the least time.

  python bench/moe_decode.py                      # Qwen3-30B-A3B's layer: D 2048, E 128, k 8, F 768, float32
  python bench/moe_decode.py --tokens 1,8,32 --repeats 5

At decode each slot brings one token, so a step routes N x k (token, expert) pairs and touches at most that many of
the E experts; all E experts' weights (Qwen3-30B-A3B: 2.4 GB per layer in float32) dwarf the few activations.
`ModelConfig.moe_impl`'s computations, each on the same random router and inputs (one sparse block, jitted, forward
only, as decode runs it):
  dense   every expert on every token (reads all E experts' weights)
  ragged  the pairs sorted by expert through `jax.lax.ragged_dot` (XLA:CPU expands it to a masked [E, N k, D] operand)
  gather  each token's k experts' weights gathered (reads the touched experts' weights only)
The bound is the touched experts' weights (3 D F floats each) read once at the machine's read bandwidth, measured in
the same run (a jitted sum over an array the size of all E experts' weights, best of the repeats); `x bound` is each
computation's median time over that. The outputs are compared first (max |difference| to `dense`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from aepo_jax.parallel import use_cpu_xla_flags  # noqa: E402

use_cpu_xla_flags()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from aepo_jax.model import _moe  # noqa: E402
from aepo_jax.model._config import ModelConfig  # noqa: E402

IMPLS = ("dense", "ragged", "gather")


def _read_bandwidth(num_floats: int, repeats: int) -> float:
  """Bytes per second a jitted sum reads from an array of `num_floats` float32 (best of `repeats`)."""
  a = jnp.ones((num_floats // 1024, 1024), jnp.float32)
  total = jax.jit(jnp.sum)
  total(a).block_until_ready()
  best = min(_timed(lambda: total(a)) for _ in range(repeats))
  return num_floats * 4 / best


def _timed(fn) -> float:
  t = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--hidden", type=int, default=2048, help="D")
  ap.add_argument("--experts", type=int, default=128, help="E")
  ap.add_argument("--top_k", type=int, default=8, help="k")
  ap.add_argument("--expert_dim", type=int, default=768, help="F (moe_intermediate_size)")
  ap.add_argument("--tokens", default="1,4,16,64", help="decode batch sizes N (comma-separated)")
  ap.add_argument("--impls", default=",".join(IMPLS))
  ap.add_argument("--repeats", type=int, default=7)
  args = ap.parse_args(argv)
  d, e, k, f = args.hidden, args.experts, args.top_k, args.expert_dim
  impls = [i for i in args.impls.split(",") if i]
  config = ModelConfig(
    family="qwen3_moe", vocab_size=128, hidden_size=d, intermediate_size=f, num_layers=1, num_heads=1,
    num_kv_heads=1, head_dim=d, num_experts=e, num_experts_per_tok=k, moe_intermediate_size=f,
  )  # fmt: skip
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  scale = d**-0.5
  p = {
    "gate": {"kernel": jax.random.normal(keys[0], (d, e)) * scale},
    "experts": {
      "gate_proj": {"kernel": jax.random.normal(keys[1], (e, d, f)) * scale},
      "up_proj": {"kernel": jax.random.normal(keys[2], (e, d, f)) * scale},
      "down_proj": {"kernel": jax.random.normal(keys[3], (e, f, d)) * f**-0.5},
    },
  }
  per_expert = 3 * d * f * 4
  bandwidth = _read_bandwidth(e * 3 * d * f, args.repeats)
  print(f"one sparse block: D {d}, E {e}, k {k}, F {f}, float32; all experts' weights {e * per_expert / 1e9:.2f} GB")
  print(f"read bandwidth (jitted sum over {e * per_expert / 1e9:.2f} GB, same run): {bandwidth / 1e9:.1f} GB/s")
  print(f"{'N':>5} {'touched':>8} {'bound ms':>9}  " + "  ".join(f"{i + ' ms':>11} {'x bound':>7}" for i in impls))
  for n in [int(t) for t in args.tokens.split(",")]:
    x = jax.random.normal(jax.random.fold_in(keys[4], n), (n, d))
    _, experts = _moe.route(config, _moe.router_logits(p, x))
    touched = len(np.unique(np.asarray(experts)))
    bound = touched * per_expert / bandwidth
    fns = {i: jax.jit(lambda p, x, i=i: _moe.moe(config, p, x, i)) for i in impls}
    outs = {i: np.asarray(fn(p, x)) for i, fn in fns.items()}
    ref = outs.get("dense", next(iter(outs.values())))
    for i, out in outs.items():
      err = float(np.abs(out - ref).max())
      assert err <= 1e-3 * max(float(np.abs(ref).max()), 1e-6), (i, n, err)
    times = {i: [] for i in impls}
    for _ in range(args.repeats):  # alternating rounds: this VM's speed drifts within minutes
      for i, fn in fns.items():
        times[i].append(_timed(lambda fn=fn: fn(p, x)))
    cells = "  ".join(
      f"{statistics.median(times[i]) * 1e3:11.2f} {statistics.median(times[i]) / bound:7.2f}" for i in impls
    )
    print(f"{n:5d} {touched:8d} {bound * 1e3:9.2f}  {cells}", flush=True)


if __name__ == "__main__":
  main()
