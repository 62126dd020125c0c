r"""ARPO on Qwen3-14B for deep search (GAIA + HLE validation): the official ARPO 14B deep-search run.

Command:  python launch/tpu_pod.py --config=configs/arpo_gaia.py:released --config.workdir=gs://BUCKET/arpo_gaia \
              --config.model.name=gs://BUCKET/models/Qwen3-14B-SFT
          (':paper' for our corrected rollout quirks and a global token-mean; ':cold_start' as in
          configs/aepo_gaia.py)
Hardware: as configs/aepo_gaia.py (a v5p-64 / v4-128 class TPU slice).
Compiled with `python launch/compile.py --config=configs/arpo_gaia.py --topology=v5p:4x4x2`
  (2026-12-01): update step 24.33 GB per chip of 95 (`--programs=update`);
  log-prob, prefill and decode are configs/aepo_gaia.py's programs (the same model and rollout shapes).
Needs: a Qwen3-14B cold-start SFT checkpoint (HF directory); hard_search_1k, gaia_test, hle_test (bundled).
Time: 85 RL steps, about a day.
Expected: ARPO README: Qwen3-14B + ARPO Pass@5 GAIA 61.2, HLE 24.0 (LLM-judge evaluation, spec §2.5), with
  about half of GRPO's tool calls during training (`rollout/tool_calls_mean`).
ARPO = GRPO advantage + dual-clip PPO (ε = 0.2, c = 3, token-mean) + entropy-based adaptive branching
(n = 12, N0 = 6, w = 0.2, τ = 0.5, Z = 2), spec §1 and §3.7. ARPO's tool retry count is 3 (AEPO: 4).
"""

from aepo_jax.train import load_sibling

common = load_sibling(__file__, "common")


def get_config(arg: str = "paper"):
  v = common.variants(arg, "configs/arpo_gaia.py")
  c = common.arpo(common.deep_search_14b())
  return common.apply(c, v, "gs://YOUR_BUCKET/models/Qwen3-14B")
