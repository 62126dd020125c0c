"""A tiny byte-level BPE tokenizer with a ChatML chat template (trained in well under a second)."""

from __future__ import annotations

import json
import os

CHATML_TEMPLATE = (
  "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
  "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
  "The quick brown fox jumps over the lazy dog.",
  "What is 12 times 34? Let me think step by step: 12 * 34 = 408.",
  "<think>I should run some code.</think><python>print(6 * 7)</python><result>42</result>",
  "<answer>\\boxed{42}</answer> The answer is 42.",
  "def f(x):\n    return x + 1\n\nprint(f(41))",
  "Search the web for the capital of France: Paris is the capital.",
]


def tiny_tokenizer(path, vocab_size: int = 300) -> str:
  """Writes tokenizer.json + tokenizer_config.json (ChatML, eos '<|im_end|>', pad '<|endoftext|>') to `path`.

  Special ids: 0 '<|endoftext|>', 1 '<|im_start|>', 2 '<|im_end|>'; byte-level, so any text encodes.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=_SPECIALS,
    show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator(_CORPUS * 4, trainer)
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(
      {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 4096,
      },
      f,
      indent=2,
    )
  return path
