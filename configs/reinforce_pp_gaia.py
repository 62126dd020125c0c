r"""REINFORCE++ (baseline form) on Qwen3-14B deep search, a baseline of AEPO's comparison (spec §3.4).

Command:  python launch/tpu_pod.py --config=configs/reinforce_pp_gaia.py --config.workdir=gs://BUCKET/reinforce_pp_gaia \
              --config.model.name=gs://BUCKET/models/Qwen3-14B-SFT
Models and variants: `:qwen3-8b` or `:qwq-32b` for those models' deep-search settings (default Qwen3-14B), and the
  paper configs' `released` / `cold_start` / `calls3` (`common.baseline_config`).
Hardware, Needs, Time: those of configs/aepo_gaia.py (same model, data, budget and slice; `common.baseline`).
Compiled with `python launch/compile.py --config=configs/reinforce_pp_gaia.py --topology=v5p:4x4x2`
  (2026-12-01): update step 26.18 GB per chip of 95 (`--programs=update`);
  log-prob, prefill and decode are configs/aepo_gaia.py's programs (the same model and rollout shapes).
Expected: no per-baseline number is in the text available here (spec §2.5); run beside configs/aepo_gaia.py.
REINFORCE++-baseline: R minus the group mean, whitened over the batch's valid tokens; PPO clip 0.2; the KL
enters the reward (k1, verl's default coefficient 0.001). Which variant and β AEPO ran is unknown.
"""

from aepo_jax.train import load_sibling

common = load_sibling(__file__, "common")


def get_config(arg=None):
  return common.baseline_config(arg, "configs/reinforce_pp_gaia.py", "deep_search", common.reinforce_pp)
