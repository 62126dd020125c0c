r"""AEPO on Qwen2.5-7B for reasoning (math + knowledge QA): the official AEPO 7B run (spec §2.4).

Command:  python launch/tpu_pod.py --config=configs/aepo_reasoning.py --config.workdir=gs://BUCKET/aepo_7b \
              --config.model.name=gs://BUCKET/models/Qwen2.5-7B-Instruct
          (':released' for the released configuration, ':cold_start' for SFT first, as in configs/aepo_gaia.py)
Hardware: a TPU v5p-64 slice (`v5p:4x4x2`, 32 chips; fsdp 8 x tensor 4; each host's 4 chips roll out its prompts).
  Compiled with `python launch/compile.py --config=configs/aepo_reasoning.py --topology=v5p:4x4x2` (2026-12-01;
  256 slots x 5,632 tokens per host), per-chip peaks of 95 GB: update 11.5, logprob 4.3, prefill 30.3, decode 27.6
  (a paged KV pool of every slot's full length).
Needs: Qwen2.5-7B-Instruct as an HF directory; ARPO's train_10k (train) and valid (validation), bundled;
  python + search tools (search: replay of search_cache.json or a retrieval server).
Time: 2 epochs x 79 steps of 128 prompts x 16 rollouts; about a day.
Expected: the per-benchmark reasoning table of the AEPO paper could not be read (spec §2.5); the released
  Qwen2.5-7B-AEPO checkpoint is the reference. `eval/accuracy` on `valid` should rise over training.
"""

from aepo_jax.train import load_sibling

common = load_sibling(__file__, "common")


def get_config(arg: str = "paper"):
  v = common.variants(arg, "configs/aepo_reasoning.py")
  c = common.aepo(common.reasoning("qwen2.5-7b"))
  c.tools.call_limit = 6  # the AEPO script's (spec §2.4), where ARPO's reasoning script has 3
  return common.apply(c, v, "gs://YOUR_BUCKET/models/Qwen2.5-7B-Instruct")
