r"""DAPO on Qwen3-14B deep search, a baseline of AEPO's comparison (spec §3.2).

Command:  python launch/tpu_pod.py --config=configs/dapo_gaia.py --config.workdir=gs://BUCKET/dapo_gaia \
              --config.model.name=gs://BUCKET/models/Qwen3-14B-SFT
Hardware, Needs, Time: those of configs/aepo_gaia.py (same model, data, budget and slice; `baseline_14b`).
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
  del arg
  c = common.baseline_14b("dapo", 0.2, 0.28, 10.0)  # clip-higher; verl recipe c = 10
  c.algo.filter_groups = True  # dynamic sampling: drop all-0 / all-1 groups
  c.algo.max_num_gen_batches = 10
  c.algo.overlong_buffer = 512  # verl test script buffer; the paper uses 4096 of 20480
  c.algo.overlong_factor = 1.0
  return c
