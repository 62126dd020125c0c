r"""AEPO on Qwen3-14B for deep search (GAIA + HLE validation): the official AEPO deep-search run.

Command (every host of the pod):
  python launch/tpu_pod.py --config=configs/aepo_gaia.py --config.workdir=gs://BUCKET/aepo_gaia \
      --config.model.name=gs://BUCKET/models/Qwen3-14B-SFT
  # what the released script ran instead of the paper's full method:
  python launch/tpu_pod.py --config=configs/aepo_gaia.py:released ...
  # from the base model: cold-start SFT on ARPO-SFT-54K traces (sft.source), then RL:
  python launch/tpu_pod.py --config=configs/aepo_gaia.py:cold_start --config.model.name=gs://BUCKET/Qwen3-14B \
      --config.sft.source=gs://BUCKET/data/ARPO-SFT-54K.jsonl ...
Hardware: a TPU v5p-64 (`v5p:4x4x2`, 32 chips) or a v6e-64 (`v6e:8x8`): fsdp x tensor 4 over all chips for the
  update; each host (4 chips) rolls out its own prompts with the weights in bfloat16 over its chips.
Memory: every program of the run compiled at full depth (`python bench/compile_table.py`, through
  `launch/compile.py`): docs/compiled.md, per-chip peaks and the HBM and collective bytes per call (prompt 2,000 +
  response 6,192 tokens; splash attention in update and logprob; a paged KV pool of 393,216 tokens per host,
  decode through the Pallas paged-attention kernel). Both fit there: v5p:4x4x2, and v6e:8x8 (32 GB per chip; update
  15.1, logprob 3.8, prefill 27.3, decode 26.7 GB, 48 slots per host).
  Longer trajectories fit too (20,480 tokens, `--config.rollout.max_response_len=18432`, on v6e:8x8; 32,768 on
  v5p:4x4x2): docs/performance.md, section "Paged KV cache".
Needs: a Qwen3-14B cold-start SFT checkpoint (ARPO-SFT-54K, spec §2.4) as an HF directory; ARPO's
  hard_search_1k (train) and gaia_test + hle_test (validation), bundled; a search backend (default: replay
  of ARPO's search_cache.json; misses return "No search results found.").
Time: 85 RL steps (5 epochs x 17 steps of 64 prompts x 12 rollouts); about a day on such a slice.
Expected: the AEPO paper reports GAIA Pass@1 47.6 / Pass@5 65.0 and HLE Pass@1 11.2 / Pass@5 26.0 for
  Qwen3-14B (abstract, spec §2.5, with LLM-judge evaluation: launch/evaluate.py --judge_url). The training-time
  validation uses the F1 reward unless eval.judge_url is set, so its numbers are not those.

Variants (configs/common.py), spec §2.6:
  'paper' (default): the full method: dynamic entropy pre-monitoring (`rollout.enable_dynamic_rollouts`) and
    the entropy-aware advantage (`algo.entropy_advantage_coef=0.2`) on, our corrected rollout quirks
    (`rollout.mode='corrected'`) and one global token-mean (`algo.aggregation='global'`).
  'released': what the released script ran: ENABLE_DYNAMIC_ROLLOUTS=False (m = initial_rollouts = 6, no probe
    trajectory), the entropy-aware advantage inactive (the actor never passed the entropy: entropy_coeff=0), the
    official rollout quirks (`rollout.mode='faithful'`, top-10 entropy) and verl's per-micro-batch loss weighting
    (`algo.aggregation='verl'`): only the stop-gradient high clip and the consecutive-branch penalty of AEPO.
  'cold_start': the cold-start SFT (15,000-token cutoff, lr 7e-6, 3 epochs) from the base model first.
"""

from aepo_jax.train import load_sibling

common = load_sibling(__file__, "common")


def get_config(arg: str = "paper"):
  v = common.variants(arg, "configs/aepo_gaia.py")
  c = common.aepo(common.deep_search_14b())
  return common.apply(c, v, "gs://YOUR_BUCKET/models/Qwen3-14B")
