r"""ARPO on Qwen3-8B for deep search (GAIA + HLE validation): the official ARPO 8B deep-search run.

Command:  python launch/tpu_pod.py --config=configs/arpo_gaia_8b.py:released --config.workdir=gs://BUCKET/arpo_8b \
              --config.model.name=gs://BUCKET/models/Qwen3-8B-SFT
          (':paper' for our corrected rollout quirks and a global token-mean; ':cold_start' as in
          configs/aepo_gaia.py)
Hardware: a TPU v5p-64 slice (`v5p:4x4x2`, 32 chips), as configs/aepo_gaia_8b.py (the same programs without the
  entropy pass of AEPO's advantage, so at most its per-chip peaks).
Compiled with `python launch/compile.py --config=configs/arpo_gaia_8b.py --topology=v5p:4x4x2`
  (2026-12-01): update step 18.89 GB per chip of 95 (`--programs=update`);
  log-prob, prefill and decode are configs/aepo_gaia_8b.py's programs (the same model and rollout shapes).
Needs: a Qwen3-8B cold-start SFT checkpoint (HF directory); hard_search_1k, gaia_test, hle_test (bundled).
Time: 45 RL steps (5 epochs x 9 steps of 128 prompts x 16 rollouts of up to 10,000 tokens); about a day.
Expected: ARPO's 8B deep-search rows were not in the text available here (spec §2.5); the ARPO README reports
  about half of GRPO's tool calls in training (`rollout/tool_calls_mean`).
ARPO_8B_Deepsearch_1node.sh (spec §1.7): batch 128, mini-batch 16, n = 16, N0 = 8, L = 10,000, prompt 2,000, call
limit 6, w = 0.2, τ = 0.5, Z = 2, 5 epochs, lr 1e-6.
"""

from aepo_jax.train import load_sibling

common = load_sibling(__file__, "common")


def get_config(arg: str = "paper"):
  v = common.variants(arg, "configs/arpo_gaia_8b.py")
  c = common.arpo(common.deep_search_8b())
  return common.apply(c, v, "gs://YOUR_BUCKET/models/Qwen3-8B")
