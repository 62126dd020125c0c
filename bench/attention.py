"""Training attention on CPU: the C++ kernel vs the XLA path vs torch's SDPA, forward and forward + backward, same run.

  python bench/attention.py                 # SmolLM2-135M's attention: 8 x 256, 9 query / 3 KV heads, head_dim 64
  python bench/attention.py --pad 0.25      # rows left-padded by up to a quarter of the length
  python bench/attention.py --len 1024 --batch 2 --repeats 3

One layer's attention, jitted, on random float32 inputs with a causal mask (`--pad`: each row also left-padded by
a random amount up to that fraction of T, as the trainer's batches are). Variants, timed in alternating rounds
(this VM's speed drifts by +-10% within minutes) and reported as medians:
  kernel  `aepo_jax.model._cpu_attention.attention` (`ModelConfig.attention_impl='cpu_kernel'`)
  xla     `_decoder._attend_recompute` (the XLA path, `attention_impl='xla'`)
  torch   `torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)` with the same boolean mask
          (skipped with `--no-torch` or when torch is not installed)
GFLOP/s count the useful work only: 4·D flops per (query, allowed key) pair forward, 3x that forward + backward
(recomputing the scores in the backward is not counted), against the 2048³ float32 matmul peak measured in the
same run on all cores; the last columns are forward + backward time ratios (xla/this, torch/this). The kernel's and the XLA path's outputs and q/k/v gradients are compared first.
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

from aepo_jax.model import _cpu_attention, _decoder  # noqa: E402


def _mask(batch: int, length: int, pad: float, rng) -> np.ndarray:
  causal = np.tril(np.ones((length, length), bool))
  mask = np.repeat(causal[None], batch, 0)
  for b in range(batch):
    p = int(rng.integers(0, int(pad * length) + 1)) if pad > 0 else 0
    mask[b, :, :p] = False  # left padding: no query attends to the pad keys (pad queries have empty rows)
  return mask


def _peak() -> float:
  a = jnp.ones((2048, 2048), jnp.float32)
  mm = jax.jit(lambda x: x @ x)
  mm(a).block_until_ready()
  best = float("inf")
  for _ in range(3):
    t = time.perf_counter()
    mm(a).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2 * 2048**3 / best / 1e9


def _timer(fn, *args):
  """A call of fn(*args) -> its wall seconds, after its result is ready (jax arrays; torch runs synchronously)."""

  def run():
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t

  return run


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--len", type=int, default=256)
  ap.add_argument("--heads", type=int, default=9)
  ap.add_argument("--kv-heads", type=int, default=3)
  ap.add_argument("--head-dim", type=int, default=64)
  ap.add_argument("--pad", type=float, default=0.0, help="max left padding per row, as a fraction of --len")
  ap.add_argument("--repeats", type=int, default=5, help="alternating rounds")
  ap.add_argument("--inner", type=int, default=5, help="calls per variant per round")
  ap.add_argument("--no-torch", action="store_true")
  args = ap.parse_args()
  B, T, H, KH, D = args.batch, args.len, args.heads, args.kv_heads, args.head_dim
  if H % KH or D % 16 or not 0 <= args.pad < 1:
    sys.exit("bench/attention.py: --heads must be a multiple of --kv-heads, --head-dim of 16, 0 <= --pad < 1")
  if not _cpu_attention.available():
    sys.exit(f"bench/attention.py: the CPU training-attention kernel is unavailable: {_cpu_attention.reason()}")
  rng = np.random.default_rng(0)
  q, do = (rng.standard_normal((B, T, H, D), np.float32) for _ in range(2))
  k, v = (rng.standard_normal((B, T, KH, D), np.float32) for _ in range(2))
  mask = _mask(B, T, args.pad, rng)
  pairs = float(mask.sum()) * H  # (query head, allowed key) pairs
  jq, jk, jv, jm, jdo = map(jnp.asarray, (q, k, v, mask, do))

  def xla_attn(q, k, v, m):
    return _decoder._attend_recompute(q.reshape(B, T, KH, H // KH, D), k, v, m).reshape(B, T, H, D)

  def fwd_bwd(f):
    def run(q, k, v, m, g):
      out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, m), q, k, v)
      return out, vjp(g)

    return jax.jit(run)

  variants = {
    "kernel": (jax.jit(_cpu_attention.attention), fwd_bwd(_cpu_attention.attention)),
    "xla": (jax.jit(xla_attn), fwd_bwd(xla_attn)),
  }
  ref_out, ref_grads = variants["xla"][1](jq, jk, jv, jm, jdo)
  out, grads = variants["kernel"][1](jq, jk, jv, jm, jdo)
  rel = lambda a, b: float(jnp.abs(a - b).max() / (jnp.abs(b).max() + 1e-30))
  print(
    f"attention B={B} T={T} H={H} KH={KH} D={D} pad<={args.pad}: kernel vs xla max relative error: out "
    f"{rel(out, ref_out):.1e}, dq/dk/dv {', '.join(f'{rel(a, b):.1e}' for a, b in zip(grads, ref_grads))}"
  )

  timers = {name: (_timer(f, jq, jk, jv, jm), _timer(fb, jq, jk, jv, jm, jdo)) for name, (f, fb) in variants.items()}
  if not args.no_torch:
    try:
      import torch
      import torch.nn.functional as F

      torch.set_num_threads(os.cpu_count() or 1)
      tq, tk, tv, tdo = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v, do))  # [B, H, T, D]
      tm = torch.from_numpy(mask)[:, None]
      # rows with no allowed key would give NaN in SDPA; let them attend everywhere (their output is unused)
      tm = tm | ~tm.any(-1, keepdim=True)

      def torch_fwd():
        with torch.no_grad():
          return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, enable_gqa=True)

      def torch_fwd_bwd():
        qq, kk, vv = (x.detach().requires_grad_() for x in (tq, tk, tv))
        F.scaled_dot_product_attention(qq, kk, vv, attn_mask=tm, enable_gqa=True).backward(tdo)
        return qq.grad

      timers["torch"] = (_timer(torch_fwd), _timer(torch_fwd_bwd))
    except ImportError:
      print("torch not installed: no torch baseline")
  peak_start = _peak()
  for f, fb in timers.values():  # compile and warm up
    f(), fb()
  times = {name: ([], []) for name in timers}
  for r in range(args.repeats):
    for name, (f, fb) in timers.items():
      times[name][0].append(statistics.median(f() for _ in range(args.inner)))
      times[name][1].append(statistics.median(fb() for _ in range(args.inner)))
    print(
      f"[bench] round {r + 1}: "
      + ", ".join(f"{n} {t[0][-1] * 1e3:.1f}/{t[1][-1] * 1e3:.1f} ms" for n, t in times.items()),
      flush=True,
    )
  peak = max(peak_start, _peak())
  flops_f, flops_fb = 4 * D * pairs, 12 * D * pairs
  print(
    f"matmul peak {peak:.1f} GFLOP/s (best of start and end); useful GFLOP: forward {flops_f / 1e9:.2f}, "
    f"forward + backward {flops_fb / 1e9:.2f}"
  )
  base = {n: statistics.median(times[n][1]) for n in ("xla", "torch") if n in times}
  print(
    f"{'variant':>8} {'fwd ms':>8} {'GFLOP/s':>8} {'% peak':>7} {'fwd+bwd ms':>11} {'GFLOP/s':>8} {'% peak':>7} "
    + " ".join(f"{n + '/this':>10}" for n in base)
  )
  for name, (tf, tfb) in times.items():
    mf, mfb = statistics.median(tf), statistics.median(tfb)
    print(
      f"{name:>8} {mf * 1e3:8.2f} {flops_f / mf / 1e9:8.1f} {flops_f / mf / 1e9 / peak:7.1%} {mfb * 1e3:11.2f} "
      f"{flops_fb / mfb / 1e9:8.1f} {flops_fb / mfb / 1e9 / peak:7.1%} "
      + " ".join(f"{b / mfb:9.2f}x" for b in base.values())
    )


if __name__ == "__main__":
  main()
