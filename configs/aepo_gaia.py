r"""AEPO on Qwen3-14B for deep search (GAIA + HLE validation): the official AEPO deep-search run.

Command (every host of the pod):
  python launch/tpu_pod.py --config=configs/aepo_gaia.py --config.workdir=gs://BUCKET/aepo_gaia \
      --config.model.name=gs://BUCKET/models/Qwen3-14B-SFT
  # the released configuration instead of the paper's full method:
  python launch/tpu_pod.py --config=configs/aepo_gaia.py:released ...
Hardware: a TPU v5p-64 or v4-128 class slice (14B policy, fsdp over all chips; rollouts of 6,192 tokens).
Needs: a Qwen3-14B cold-start SFT checkpoint (ARPO-SFT-54K, spec §2.4) as an HF directory; ARPO's
  hard_search_1k (train) and gaia_test + hle_test (validation), bundled; a search backend (default: replay
  of ARPO's search_cache.json; misses return "No search results found.").
Time: 85 RL steps (5 epochs x 17 steps of 64 prompts x 12 rollouts); about a day on such a slice.
Expected: the AEPO paper reports GAIA Pass@1 47.6 and HLE Pass@1 11.2 for Qwen3-14B (spec §2.5, with
  LLM-judge evaluation); the training-time validation here uses the F1 reward, so numbers are not comparable.

Variants (`get_config(arg)`), spec §2.6:
  'paper' (default): the full method: dynamic entropy pre-monitoring (`rollout.enable_dynamic_rollouts`) and
    the entropy-aware advantage (`algo.entropy_advantage_coef=0.2`) are ON.
  'released': what the released script actually ran: ENABLE_DYNAMIC_ROLLOUTS=False (m = initial_rollouts=6,
    no probe trajectory) and the entropy-aware advantage inactive (the actor never passed the entropy because
    entropy_coeff=0), i.e. only the stop-gradient high clip and the consecutive-branch penalty are active.
"""
import importlib.util
import pathlib


def _common():
  """configs/common.py, loaded by path (configs/ is a folder of files, not a package)."""
  spec = importlib.util.spec_from_file_location("configs_common", pathlib.Path(__file__).with_name("common.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(arg: str = "paper"):
  if arg not in ("paper", "released"):
    raise ValueError(f"configs/aepo_gaia.py:{arg}: use 'paper' (full method) or 'released' (official script).")
  c = _common().deep_search_14b()
  c.rollout.policy = "aepo"
  c.rollout.consecutive_penalty = 0.05  # P̂(l) = 0.05·l, hard-coded in the official code (spec §2.1)
  c.rollout.premonitor_beta = 0.5  # β, hard-coded (spec §2.1)
  c.rollout.probe_tokens = 50
  c.rollout.penalize_refills = True
  c.algo.loss = "aepo"
  c.algo.preserve_high_clip_grad = True  # stop-gradient high clip (spec §2.2)
  released = arg == "released"
  c.rollout.enable_dynamic_rollouts = not released  # ENABLE_DYNAMIC_ROLLOUTS=False in the script
  c.algo.entropy_advantage_coef = 0.0 if released else 0.2  # inactive in the released run (spec §2.3)
  return c
