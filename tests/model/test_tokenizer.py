"""Tokenizer wrapper (tokenizers + jinja2) against transformers' tokenizer on the same directory."""

import subprocess
import sys

import pytest

from aepo_jax import model, testing

TEXTS = [
  "The answer is 42.",
  "  two  spaces\nand\ttabs ",
  "ünïcödé 日本 🙂",
  "<|im_start|>user\nhi<|im_end|>",
  "<python>print(6*7)</python>",
]
CONVERSATION = [
  {"role": "system", "content": "You solve problems with <python> tools."},
  {"role": "user", "content": "What is 6*7?"},
  {"role": "assistant", "content": "<python>print(6*7)</python>"},
  {"role": "user", "content": "<result>42</result>"},
  {"role": "assistant", "content": "<answer>42</answer>"},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  return testing.tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def test_matches_transformers(tiny_dir):
  import transformers

  ours = model.Tokenizer.from_dir(tiny_dir)
  ref = transformers.AutoTokenizer.from_pretrained(tiny_dir)
  for text in TEXTS:
    ids = ours.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids) == text
  for k in range(1, len(CONVERSATION) + 1):
    for gen in (True, False):
      expected = ref.apply_chat_template(CONVERSATION[:k], tokenize=False, add_generation_prompt=gen)
      assert ours.render_chat(CONVERSATION[:k], add_generation_prompt=gen) == expected
      assert ours.apply_chat_template(CONVERSATION[:k], add_generation_prompt=gen) == ref.encode(
        expected, add_special_tokens=False
      )
  assert (ours.eos_id, ours.pad_id, ours.bos_id) == (2, 0, None)
  assert ours.vocab_size == len(ref)


def test_templated_prefix_stable_across_turns(tiny_dir):
  tok = model.Tokenizer.from_dir(tiny_dir)
  for k in range(1, len(CONVERSATION)):
    shorter = tok.apply_chat_template(CONVERSATION[:k], add_generation_prompt=False)
    longer = tok.apply_chat_template(CONVERSATION[: k + 1], add_generation_prompt=False)
    assert longer[: len(shorter)] == shorter


def test_encode_continuation_keeps_special_strings_as_text(tiny_dir):
  tok = model.Tokenizer.from_dir(tiny_dir)
  ids = tok.encode_continuation("<result><|im_end|></result>")
  assert tok.eos_id not in ids and tok.decode(ids) == "<result><|im_end|></result>"
  assert tok.eos_id in tok.encode_continuation("<|im_end|>", parse_special=True)
  assert tok.eos_id in tok.encode("<|im_end|>")  # the plain encode still parses them


def test_errors(tmp_path, tiny_dir):
  with pytest.raises(FileNotFoundError, match=r"tokenizer\.json is missing"):
    model.Tokenizer.from_dir(str(tmp_path))
  tok = model.Tokenizer.from_dir(tiny_dir)
  tok.chat_template = None
  with pytest.raises(ValueError, match="no chat_template"):
    tok.render_chat([{"role": "user", "content": "hi"}])


def test_core_import_needs_neither_torch_nor_transformers():
  code = (
    "import sys, aepo_jax.model, aepo_jax.parallel; "
    "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad"
  )
  subprocess.run([sys.executable, "-c", code], check=True)
