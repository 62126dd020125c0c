r"""ARPO on QwQ-32B for deep search (GAIA + HLE validation): the setting of the released QwQ-32B-ARPO.

Command:  python launch/tpu_pod.py --config=configs/arpo_gaia_qwq32b.py:released \
              --config.workdir=gs://BUCKET/arpo_qwq --config.model.name=gs://BUCKET/models/QwQ-32B-SFT
Hardware, Needs, Time: those of configs/aepo_gaia_qwq32b.py (the same programs but AEPO's entropy pass, so at most
  its per-chip peaks).
Compiled with `python launch/compile.py --config=configs/arpo_gaia_qwq32b.py --topology=v5p:4x4x2`
  (2026-12-01): update step 45.52 GB per chip of 95 (`--programs=update`);
  log-prob, prefill and decode are configs/aepo_gaia_qwq32b.py's programs (the same model and rollout shapes).
Expected: AEPO README (2025-12-20, spec §2.5): QwQ-32B-ARPO GAIA 51.5 / HLE 11.2
  (presumably Pass@1, LLM-judge evaluation); no QwQ script was released, the 14B deep-search one's values apply.
"""

from aepo_jax.train import load_sibling

common = load_sibling(__file__, "common")


def get_config(arg: str = "paper"):
  v = common.variants(arg, "configs/arpo_gaia_qwq32b.py")
  c = common.arpo(common.deep_search_qwq32b())
  return common.apply(c, v, "gs://YOUR_BUCKET/models/QwQ-32B")
