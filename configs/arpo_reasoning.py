r"""ARPO for reasoning (math + knowledge QA) on Qwen2.5-3B, Qwen2.5-7B (default) or Llama-3.1-8B: the ARPO paper's
reasoning setting (spec §1.7, ARPO_7B_Reasoning_1node.sh).

Command:  python launch/tpu_pod.py --config=configs/arpo_reasoning.py:qwen2.5-3b,released \
              --config.workdir=gs://BUCKET/arpo_3b --config.model.name=gs://BUCKET/models/Qwen2.5-3B-Instruct
          (models: qwen2.5-3b | qwen2.5-7b | llama-3.1-8b; variants: paper | released | cold_start, as in
          configs/aepo_gaia.py)
Hardware: a TPU v5p-64 slice (`v5p:4x4x2`, 32 chips; fsdp 8 x tensor 4, the 3B model fsdp 16 x tensor 2).
  Compiled for v5p:4x4x2 with launch/compile.py (2026-12-01; 256 slots x 5,632 tokens per host; splash attention
  in update and logprob), per-chip peaks:
    llama-3.1-8b: update 12.5 GB, logprob 4.2 GB, prefill 57.8 GB, decode 54.7 GB of 95 GB (paged KV pool).
    qwen2.5-3b: update 5.1 GB, logprob 1.8 GB, prefill 18.0 GB, decode 18.0 GB, with tensor 2 for training and a
      rollout mesh of 2 x 2, because its 2 KV heads cannot split over 4 chips (with tensor 4 every chip holds the
      whole cache and prefill and decode do not fit: the dated compile is in docs/benchmarks.md); its slots split
      over 2 chips keep the dense KV cache (a paged pool is per host: rollout.kv_layout='auto').
    qwen2.5-7b: update 11.5 GB (`--programs=update`); logprob 4.3, prefill 30.3, decode 27.6 GB are the programs of
      configs/aepo_reasoning.py (the same model and rollout shapes).
Needs: the instruct model as an HF directory; ARPO's train_10k (train) and valid (validation), bundled; python +
  search tools (search: replay of search_cache.json or a retrieval server).
Time: 2 epochs x 79 steps of 128 prompts x 16 rollouts of up to 4,096 tokens; half a day to a day.
Expected: the ARPO paper's per-benchmark reasoning rows (13 datasets) were not in the text available here
  (spec §2.5); `eval/accuracy` on `valid` should rise over training. Compare ARPO with GRPO on the same slice.
The released script is the 7B one; the 3B and Llama-3.1-8B runs use its values (batch 128, mini-batch 16, n = 16,
N0 = 8, L = 4,096, prompt 1,536, call limit 3, 2 epochs, lr 1e-6).
"""

from aepo_jax.train import load_sibling

common = load_sibling(__file__, "common")


def get_config(arg: str = "qwen2.5-7b"):
  v = common.variants(arg, "configs/arpo_reasoning.py", models=common.REASONING_MODELS)
  model = v["model"] or "qwen2.5-7b"
  c = common.arpo(common.reasoning(model))
  return common.apply(c, v, common.REASONING_MODELS[model])
