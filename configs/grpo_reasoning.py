r"""GRPO for reasoning (math + knowledge QA) on Qwen2.5-7B (default), Qwen2.5-3B or Llama-3.1-8B: a baseline of
the ARPO paper's reasoning comparison (spec §3.1), on the setting of configs/arpo_reasoning.py.

Command:  python launch/tpu_pod.py --config=configs/grpo_reasoning.py:qwen2.5-3b \
              --config.workdir=gs://BUCKET/grpo_reasoning_3b --config.model.name=gs://BUCKET/models/Qwen2.5-3B-Instruct
          (models: qwen2.5-3b | qwen2.5-7b | llama-3.1-8b; variants: released | cold_start, as in configs/aepo_gaia.py)
Hardware, Needs, Time: those of configs/arpo_reasoning.py (same model, data, budget and slice).
Compiled with `python launch/compile.py --config=configs/grpo_reasoning.py --topology=v5p:4x4x2 --programs=update`
  (2026-12-02, Qwen2.5-7B): update step 13.51 GB per chip of 95; log-prob, prefill and decode are
  configs/aepo_reasoning.py's programs (the same model and rollout shapes).
Expected: the ARPO paper's per-benchmark reasoning rows were not in the text available here (spec §2.5); run beside
  configs/arpo_reasoning.py on the same model and compare `eval/accuracy` on `valid`.
The loss settings: `common.grpo` (the same as configs/grpo_gaia.py's).
"""

from aepo_jax.train import load_sibling

common = load_sibling(__file__, "common")


def get_config(arg=None):
  return common.baseline_config(arg, "configs/grpo_reasoning.py", "reasoning", common.grpo)
