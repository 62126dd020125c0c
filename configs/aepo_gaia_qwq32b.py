r"""AEPO on QwQ-32B for deep search (GAIA + HLE validation): the setting of the released QwQ-32B-AEPO-DeepSearch.

Command:  python launch/tpu_pod.py --config=configs/aepo_gaia_qwq32b.py --config.workdir=gs://BUCKET/aepo_qwq \
              --config.model.name=gs://BUCKET/models/QwQ-32B-SFT
          (':released' / ':cold_start' as in configs/aepo_gaia.py)
Hardware: a TPU v5p-64 slice (`v5p:4x4x2`, 32 chips; fsdp 8 x tensor 4).
  Compiled for v5p:4x4x2 with launch/compile.py (2026-12-01; 48 slots x 8,192 tokens per host, rollout.max_slots
  half the 96 trajectories a host holds): per-chip peaks update 45.7 GB, logprob 16.0 GB, prefill 58.1 GB,
  decode 56.1 GB of 95 GB (the paged KV pool, 393,216 tokens per host, is 25.8 GB of it: rollout.kv_tokens).
Needs: a QwQ-32B cold-start SFT checkpoint (HF directory; model.shape 'qwq-32b' = the Qwen2.5-32B architecture);
  hard_search_1k, gaia_test, hle_test (bundled); a search backend.
Time: 85 RL steps (5 epochs x 17 steps of 64 prompts x 12 rollouts); one to two days.
Expected: AEPO README (2025-12-20, spec §2.5): QwQ-32B-AEPO-DeepSearch GAIA 53.4 / HLE 12.8 (presumably Pass@1,
  LLM-judge evaluation), against QwQ-32B-ARPO 51.5 / 11.2 (configs/arpo_gaia_qwq32b.py).
No script for QwQ-32B was released: the 14B deep-search script's values (configs/common.py deep_search_14b).
"""

from aepo_jax.train import load_sibling

common = load_sibling(__file__, "common")


def get_config(arg: str = "paper"):
  v = common.variants(arg, "configs/aepo_gaia_qwq32b.py")
  c = common.aepo(common.deep_search_qwq32b())
  return common.apply(c, v, "gs://YOUR_BUCKET/models/QwQ-32B")
