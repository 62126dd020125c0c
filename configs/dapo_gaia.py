r"""DAPO on Qwen3-14B deep search, a baseline of AEPO's comparison (spec §3.2).

Command:  python launch/tpu_pod.py --config=configs/dapo_gaia.py --config.workdir=gs://BUCKET/dapo_gaia \
              --config.model.name=gs://BUCKET/models/Qwen3-14B-SFT
Models and variants: `:qwen3-8b` or `:qwq-32b` for those models' deep-search settings (default Qwen3-14B), and the
  paper configs' `released` / `cold_start` / `calls3` (`common.baseline_config`).
Hardware, Needs, Time: those of configs/aepo_gaia.py (same model, data, budget and slice; `common.baseline`).
Compiled with `python launch/compile.py --config=configs/dapo_gaia.py --topology=v5p:4x4x2`
  (2026-12-01), per-chip peaks of 95 GB: update 24.33, logprob 7.8, prefill 31.4, decode 29.9 (96 slots per host,
  paged KV pool: the rollout programs of configs/aepo_gaia.py): fits.
Expected: no per-baseline number is in the text available here (spec §2.5); run beside configs/aepo_gaia.py.
DAPO: clip-higher (ε_low 0.2, ε_high 0.28; verl recipe c = 10), dynamic sampling (groups whose accuracy is all 0
or all 1 are dropped and generation continues, up to 10 batches), overlong shaping with verl's test-script buffer
of 512 tokens (the paper: 4,096 of 20,480), token-level mean, no KL.
"""

from aepo_jax.train import load_sibling

common = load_sibling(__file__, "common")


def get_config(arg=None):
  return common.baseline_config(arg, "configs/dapo_gaia.py", "deep_search", common.dapo)
