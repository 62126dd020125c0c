r"""AEPO on Qwen2.5-7B for reasoning (math + knowledge QA): the official AEPO 7B run (spec §2.4).

Command:  python launch/tpu_pod.py --config=configs/aepo_reasoning.py --config.workdir=gs://BUCKET/aepo_7b \
              --config.model.name=gs://BUCKET/models/Qwen2.5-7B-Instruct
          (':released' for the released configuration, as in configs/aepo_gaia.py)
Hardware: a TPU v5p-32 / v4-64 class slice.
Needs: Qwen2.5-7B-Instruct as an HF directory; ARPO's train_10k (train) and valid (validation), bundled;
  python + search tools (search: replay of search_cache.json or a retrieval server).
Time: 2 epochs x 79 steps of 128 prompts x 16 rollouts; about a day.
Expected: the per-benchmark reasoning table of the AEPO paper could not be read (spec §2.5); the released
  Qwen2.5-7B-AEPO checkpoint is the reference. `eval/accuracy` on `valid` should rise over training.
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
    raise ValueError(f"configs/aepo_reasoning.py:{arg}: use 'paper' or 'released'.")
  c = _common().reasoning_7b()
  c.rollout.policy = "aepo"
  c.algo.loss = "aepo"
  c.algo.preserve_high_clip_grad = True
  released = arg == "released"
  c.rollout.enable_dynamic_rollouts = not released  # ENABLE_DYNAMIC_ROLLOUTS=False in the script (spec §2.6)
  c.algo.entropy_advantage_coef = 0.0 if released else 0.2  # inactive in the released run (spec §2.3)
  return c
