r"""The RL step of a pod config on paper: FLOPs and HBM bytes from the shapes, a slice's peaks, and the step time
they imply at a given MFU, plus the decode roofline of one host. Estimates, not measurements (no TPU here).

  python bench/pod_estimate.py --config=configs/aepo_gaia.py --chip=v5p --chips=32 --host_chips=4
  python bench/pod_estimate.py --config=configs/aepo_gaia.py --compiled=docs/results/compiled/aepo_gaia@v5p_4x4x2.json

Assumptions (printed): every trajectory at its full length (prompt + max response: an upper bound on the work),
no prefix sharing between forks, bfloat16 weights and KV cache, causal attention over the average context, the
update at 3x the forward FLOPs (model FLOPs; remat's recompute is not counted, as MFU conventions go) plus one
forward for the old log-probs (and one for the reference when a KL term is on).
"""

import os
import sys

from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (configs/*.py[:arg]).")
_CHIP = flags.DEFINE_enum("chip", "v5p", ["v4", "v5e", "v5p", "v6e"], "TPU generation.")
_CHIPS = flags.DEFINE_integer("chips", 32, "Chips in the slice.")
_HOST_CHIPS = flags.DEFINE_integer("host_chips", 4, "Chips per host (each host decodes its own prompts).")
_MFU = flags.DEFINE_list("mfu", ["0.3", "0.5"], "MFU values to turn the FLOPs into step times.")
_COMPILED = flags.DEFINE_string(
  "compiled",
  "",
  "A JSON of bench/compile_table.py (docs/results/compiled/CONFIG@TOPOLOGY.json): also bound each compiled "
  "program's call by its HBM bytes, and the step by the programs' calls.",
)


def estimate(config, chip: str, chips: int, host_chips: int, mfus) -> list:
  from aepo_jax.train import _compile
  from aepo_jax.train._compile import PEAKS

  cfg = _compile.model_config(config)
  r, d = config.rollout, config.data
  flops_peak, hbm_bw = PEAKS[chip]
  n = cfg.num_params
  embed = cfg.vocab_size * cfg.hidden_size
  n_matmul = n - (0 if cfg.tie_word_embeddings else embed)  # the input embedding is a lookup, not a matmul
  seq = r.max_prompt_len + r.max_response_len
  trajectories = d.prompts_per_step * r.n
  tokens = trajectories * seq
  # Attention: QK^T and PV, 2 x 2 FLOPs per (query, key, head, dim); causal: keys = context / 2 on average.
  attn_fwd_per_token = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (seq / 2)
  fwd_per_token = 2 * n_matmul + attn_fwd_per_token
  passes = 3 + 1 + (1 if (config.algo.kl.coef > 0 or config.algo.kl.use_in_reward) else 0)
  train_flops = tokens * fwd_per_token * passes
  rollout_tokens = trajectories * seq  # prefill + decode, each token one forward
  rollout_flops = rollout_tokens * fwd_per_token
  kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bf16
  hosts = chips // host_chips
  slots = r.max_slots or -(-d.prompts_per_step // hosts) * r.n
  weight_bytes = 2 * n  # bf16 rollout copy, read once per decode step by the host's chips together
  avg_ctx = r.max_prompt_len + r.max_response_len / 2
  step_read = weight_bytes + slots * avg_ctx * kv_per_token
  step_s = step_read / (host_chips * hbm_bw)
  response_steps = r.max_response_len  # decode steps per host if all its slots decode in lock-step
  lines = [
    f"model {cfg.num_params / 1e9:.2f}B parameters ({n_matmul / 1e9:.2f}B in matmuls), {cfg.num_layers} layers; "
    f"{trajectories} trajectories x {seq} tokens = {tokens / 1e6:.2f}M tokens per step (upper bound)",
    f"slice: {chips} x {chip} ({flops_peak / 1e12:.0f} TFLOP/s bf16, {hbm_bw / 1e9:.0f} GB/s HBM per chip), "
    f"{hosts} hosts x {host_chips} chips",
    f"training FLOPs per step: {train_flops / 1e15:.1f} PFLOP ({passes} forward-equivalents: update 3 + old "
    f"log-probs 1{' + reference 1' if passes == 5 else ''}); rollout FLOPs {rollout_flops / 1e15:.1f} PFLOP",
  ]
  for mfu in mfus:
    t = train_flops / (chips * flops_peak * mfu)
    lines.append(f"  at MFU {mfu:.0%}: update + log-probs {t:.0f} s per step")
  lines += [
    f"decode roofline per host: {slots} slots; each step reads the bf16 weights ({weight_bytes / 1e9:.1f} GB) and "
    f"the slots' KV at an average context of {avg_ctx:.0f} tokens ({slots * avg_ctx * kv_per_token / 1e9:.1f} GB) "
    f"over {host_chips} chips: >= {step_s * 1e3:.1f} ms per step, <= {slots / step_s:.0f} tokens/s per host",
    f"  {response_steps} decode steps (every slot to its full response) >= {response_steps * step_s:.0f} s of "
    f"rollout per step; decode compute per step {slots * fwd_per_token / (host_chips * flops_peak) * 1e3:.2f} ms "
    "at peak (bandwidth-bound while that is smaller)",
  ]
  return lines


def from_compiled(config, report: dict) -> list:
  """The bandwidth floor of each compiled program's call (its HBM bytes per chip over the chip's HBM bandwidth)
  and what the step's calls of them add up to: update (mini-batch updates per step), logprob (one), weight copy
  (one), decode (every slot to its full response, the paged engine's one step per call)."""
  from aepo_jax.train._compile import PEAKS

  gen = report["topology"].split(":")[0]
  flops_peak, hbm_bw = PEAKS[gen]
  t, r, d = config.train, config.rollout, config.data
  calls = {
    "update": t.ppo_epochs * (d.prompts_per_step // t.ppo_mini_batch_size),
    "logprob": 2 if (config.algo.kl.coef > 0 or config.algo.kl.use_in_reward) else 1,
    "weight_cast": 1,
    "weight_copy": 1,
    "decode": r.max_response_len // report.get("rollout", {}).get("decode_steps", 1),
  }
  lines = [
    f"from the compiled programs ({report['topology']}, compiled {report.get('date', '?')}): HBM bytes per call "
    f"per chip over {hbm_bw / 1e9:.0f} GB/s"
  ]
  total = 0.0
  for name, p in report["programs"].items():
    floor = p.get("hbm_gb", 0.0) * 1e9 / hbm_bw
    n = calls.get(name, 0)
    total += n * floor
    lines.append(
      f"  {name:<15} {p.get('hbm_gb', 0.0):9.2f} GB per call -> >= {floor * 1e3:9.2f} ms"
      + (f" x {n} calls per step = {n * floor:7.1f} s" if n else "")
    )
  lines.append(f"  the step's calls of those programs: >= {total:.0f} s at the HBM roofline (tools and rewards aside)")
  return lines


def main(argv):
  del argv
  lines = estimate(_CONFIG.value, _CHIP.value, _CHIPS.value, _HOST_CHIPS.value, [float(m) for m in _MFU.value])
  if _COMPILED.value:
    import json

    with open(_COMPILED.value) as f:
      lines += from_compiled(_CONFIG.value, json.load(f))
  print("\n".join(lines))


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
