r"""GSPO on Qwen3-14B deep search, a baseline of AEPO's comparison (spec §3.3).

Command:  python launch/tpu_pod.py --config=configs/gspo_gaia.py --config.workdir=gs://BUCKET/gspo_gaia \
              --config.model.name=gs://BUCKET/models/Qwen3-14B-SFT
Models and variants: `:qwen3-8b` or `:qwq-32b` for those models' deep-search settings (default Qwen3-14B), and the
  paper configs' `released` / `cold_start` / `calls3` (`common.baseline_config`).
Hardware, Needs, Time: those of configs/aepo_gaia.py (same model, data, budget and slice; `common.baseline`).
Compiled with `python launch/compile.py --config=configs/gspo_gaia.py --topology=v5p:4x4x2`
  (2026-12-01), per-chip peaks of 95 GB: update 24.33, logprob 7.8, prefill 31.4, decode 29.9 (96 slots per host,
  paged KV pool: the rollout programs of configs/aepo_gaia.py): fits.
Expected: no per-baseline number is in the text available here (spec §2.5); run beside configs/aepo_gaia.py.
GSPO: sequence-level ratio (GSPO-token form, as verl), ε_l = 3e-4 / ε_h = 4e-4 (paper), no dual clip,
seq-mean-token-mean; a large clipped fraction is by design.
"""

from aepo_jax.train import load_sibling

common = load_sibling(__file__, "common")


def gspo(c):
  common.baseline(c, "gspo", 3e-4, 4e-4, 0.0)  # paper; no dual clip
  c.algo.agg = "seq-mean-token-mean"
  return c


def get_config(arg=None):
  return common.baseline_config(arg, "configs/gspo_gaia.py", "deep_search", gspo)
