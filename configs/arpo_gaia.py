r"""ARPO on Qwen3-14B for deep search (GAIA + HLE validation): the official ARPO 14B deep-search run.

Command:  python launch/tpu_pod.py --config=configs/arpo_gaia.py --config.workdir=gs://BUCKET/arpo_gaia \
              --config.model.name=gs://BUCKET/models/Qwen3-14B-SFT
Hardware: as configs/aepo_gaia.py (a v5p-64 / v4-128 class TPU slice).
Needs: a Qwen3-14B cold-start SFT checkpoint (HF directory); hard_search_1k, gaia_test, hle_test (bundled).
Time: 85 RL steps, about a day.
Expected: ARPO README: Qwen3-14B + ARPO Pass@5 GAIA 61.2, HLE 24.0 (LLM-judge evaluation, spec §2.5), with
  about half of GRPO's tool calls during training (`rollout/tool_calls_mean`).
ARPO = GRPO advantage + dual-clip PPO (ε = 0.2, c = 3, token-mean) + entropy-based adaptive branching
(n = 12, N0 = 6, w = 0.2, τ = 0.5, Z = 2), spec §1 and §3.7. ARPO's tool retry count is 3 (AEPO: 4).
"""
import importlib.util
import pathlib


def _common():
  """configs/common.py, loaded by path (configs/ is a folder of files, not a package)."""
  spec = importlib.util.spec_from_file_location("configs_common", pathlib.Path(__file__).with_name("common.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(arg=None):
  del arg
  c = _common().deep_search_14b()
  c.rollout.policy = "arpo"
  c.rollout.enable_dynamic_rollouts = False
  c.tools.retry_count = 3
  c.algo.loss = "arpo"  # = dual-clip PPO
  c.algo.entropy_advantage_coef = 0.0
  c.algo.preserve_high_clip_grad = False
  return c
