r"""AEPO on Qwen3-8B for deep search (GAIA + HLE validation): the setting of the released Qwen3-8B-AEPO-DeepSearch.

Command:  python launch/tpu_pod.py --config=configs/aepo_gaia_8b.py --config.workdir=gs://BUCKET/aepo_gaia_8b \
              --config.model.name=gs://BUCKET/models/Qwen3-8B-SFT
          (':released' / ':cold_start' as in configs/aepo_gaia.py)
Hardware: a TPU v5p-64 slice (`v5p:4x4x2`, 32 chips; fsdp 8 x tensor 4; each host's 4 chips roll out its prompts).
  Compiled for v5p:4x4x2 with launch/compile.py (2026-12-01; 128 slots x 12,000 tokens per host, rollout.max_slots
  below the 256 trajectories a host holds, as 256 would need 113 GB of KV cache per chip): per-chip peaks update
  18.9 GB, logprob 5.2 GB, prefill 72.2 GB, decode 64.3 GB of 95 GB (a paged KV pool of every slot's
  full length, 56.8 GB per chip; decode through the Pallas paged-attention kernel).
Needs: a Qwen3-8B cold-start SFT checkpoint (ARPO-SFT-54K) as an HF directory; hard_search_1k, gaia_test,
  hle_test (bundled); a search backend (default: replay of search_cache.json).
Time: 45 RL steps (5 epochs x 9 steps of 128 prompts x 16 rollouts of up to 10,000 tokens); about a day.
Expected: the AEPO README releases this model; its per-benchmark rows (AEPO main table) were not in the text
  available here (spec §2.5), so compare against configs/arpo_gaia_8b.py on the same slice and against the
  released checkpoint evaluated with launch/evaluate.py --judge_url.
No AEPO script for 8B was released: ARPO_8B_Deepsearch_1node.sh's values (batch 128, mini-batch 16, n = 16,
N0 = 8, L = 10,000, call limit 6, spec §1.7) with AEPO's switches (spec §2).
"""

from aepo_jax.train import load_sibling

common = load_sibling(__file__, "common")


def get_config(arg: str = "paper"):
  v = common.variants(arg, "configs/aepo_gaia_8b.py")
  c = common.aepo(common.deep_search_8b())
  return common.apply(c, v, "gs://YOUR_BUCKET/models/Qwen3-8B")
