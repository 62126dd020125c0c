"""Logit parity with transformers (CPU torch, float32) on tiny random checkpoints of each family."""

import numpy as np
import pytest
import torch
import transformers

from aepo_jax import model, testing

F32_TOL = 1e-4  # max |Δlogits|, float32; measured ~2e-6 on logits of magnitude ~3
BF16_TOL = 0.15  # max |Δlogits|, bf16 params + compute (logits up to ~3); measured 0.061 vs f32, 0.059 vs HF bf16


def _hf_logits(path, tokens_bt, mask_bt=None, positions_bt=None, dtype=torch.float32):
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
  kw = {}
  if mask_bt is not None:
    kw = dict(attention_mask=torch.tensor(mask_bt), position_ids=torch.tensor(positions_bt))
  with torch.no_grad():
    return hf(torch.tensor(tokens_bt), **kw).logits.float().numpy()


def _tokens(b, t, seed=0):
  return np.random.RandomState(seed).randint(3, 320, (b, t)).astype(np.int32)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", testing.FAMILIES)
def test_logits_match_transformers(tiny_checkpoint, family, tie):
  path = tiny_checkpoint(family, tie)
  config, params = model.load_hf(path)
  assert config.tie_word_embeddings == tie and ("lm_head" in params) == (not tie)
  tokens = _tokens(2, 24)
  ref = _hf_logits(path, tokens)
  ours = np.asarray(model.forward(config, params, tokens))
  assert ours.dtype == np.float32 and ours.shape == ref.shape
  assert np.abs(ours - ref).max() <= F32_TOL


@pytest.mark.parametrize("family", ["llama_rope", "qwen2", "qwen3"])
def test_padded_batch_matches_transformers(tiny_checkpoint, family):
  """One batch with a full row, a left-padded row and a right-padded row; explicit position_ids to HF."""
  path = tiny_checkpoint(family)
  config, params = model.load_hf(path)
  t = 16
  tokens = _tokens(3, t, seed=1)
  mask = np.ones((3, t), np.int32)
  mask[1, :7] = 0  # left padding: 9 valid tokens
  mask[2, 4:] = 0  # right padding: 4 valid tokens
  tokens = np.where(mask == 1, tokens, 0)
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  ref = _hf_logits(path, tokens, mask, positions)
  ours = np.asarray(model.forward(config, params, tokens, positions, mask))
  valid = mask.astype(bool)
  assert np.abs(ours - ref)[valid].max() <= F32_TOL
  # The default positions (running count of valid tokens) are the ones passed to HF above.
  ours_default = np.asarray(model.forward(config, params, tokens, attention_mask=mask))
  np.testing.assert_array_equal(ours_default[valid], ours[valid])
  # Padding changes nothing for a row's valid tokens: compare each padded row with itself unpadded.
  for b in (1, 2):
    alone = np.asarray(model.forward(config, params, tokens[b][valid[b]][None]))
    assert np.abs(alone[0] - ours[b][valid[b]]).max() <= F32_TOL


@pytest.mark.slow  # XLA's CPU bf16 path compiles and runs slowly
def test_bfloat16_tolerance(tiny_checkpoint):
  """bf16 params + bf16 compute against our float32 logits and against transformers in bf16."""
  path = tiny_checkpoint("qwen3")
  tokens = _tokens(2, 16, seed=2)
  config32, params32 = model.load_hf(path)
  config16, params16 = model.load_hf(path, dtype="bfloat16")
  assert config16.dtype == config16.param_dtype == "bfloat16"
  assert all(x.dtype == np.dtype("bfloat16") for x in __import__("jax").tree.leaves(params16))
  ours32 = np.asarray(model.forward(config32, params32, tokens))
  ours16 = np.asarray(model.forward(config16, params16, tokens))
  ref16 = _hf_logits(path, tokens, dtype=torch.bfloat16)
  assert np.abs(ours16 - ours32).max() <= BF16_TOL
  assert np.abs(ours16 - ref16).max() <= BF16_TOL
  assert np.abs(ours16 - ours32).max() > F32_TOL  # really computed in bf16
