r"""CISPO on Qwen3-14B deep search, a baseline of AEPO's comparison (spec §3.6).

Command:  python launch/tpu_pod.py --config=configs/cispo_gaia.py --config.workdir=gs://BUCKET/cispo_gaia \
              --config.model.name=gs://BUCKET/models/Qwen3-14B-SFT
Models and variants: `:qwen3-8b` or `:qwq-32b` for those models' deep-search settings (default Qwen3-14B), and the
  paper configs' `released` / `cold_start` / `calls3` (`common.baseline_config`).
Hardware, Needs, Time: those of configs/aepo_gaia.py (same model, data, budget and slice; `common.baseline`).
Compiled with `python launch/compile.py --config=configs/cispo_gaia.py --topology=v5p:4x4x2`
  (2026-12-01): update step 24.33 GB per chip of 95 (`--programs=update`);
  log-prob, prefill and decode are configs/aepo_gaia.py's programs (the same model and rollout shapes).
Expected: no per-baseline number is in the text available here (spec §2.5); run beside configs/aepo_gaia.py.
CISPO (MiniMax-M1): REINFORCE with a clipped, detached IS weight; no lower bound, ε_high 0.28 (AEPO's value is
unknown), token-level mean, no KL.
"""

from aepo_jax.train import load_sibling

common = load_sibling(__file__, "common")


def cispo(c):
  return common.baseline(c, "cispo", 1.0, 0.28, 0.0)  # no lower IS bound; ε_high unknown (§3.6)


def get_config(arg=None):
  return common.baseline_config(arg, "configs/cispo_gaia.py", "deep_search", cispo)
