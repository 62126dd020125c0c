r"""GRPO on Qwen3-14B for deep search (GAIA + HLE validation): a baseline of AEPO's comparison (spec §3.1).

Command:  python launch/tpu_pod.py --config=configs/grpo_gaia.py --config.workdir=gs://BUCKET/grpo_gaia \
              --config.model.name=gs://BUCKET/models/Qwen3-14B-SFT
Hardware: as configs/aepo_gaia.py (a v5p-64 / v4-128 class TPU slice).
Needs: a Qwen3-14B cold-start SFT checkpoint (HF directory); hard_search_1k, gaia_test, hle_test (bundled).
Time: 85 RL steps, about a day.
Expected: not reported per baseline in the available text (spec §2.5); compare against configs/aepo_gaia.py on the same hardware.
Rollout: plain group sampling (policy 'none', n = 12), as the baselines have no branching. How the AEPO
authors ran this baseline is unknown (spec §3); the values are the original paper's / upstream verl's.
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
  c = _common().baseline_14b("grpo", 0.2, 0.2, 3.0)  # verl adds the dual clip
  c.algo.advantage = "grpo"
  return c
