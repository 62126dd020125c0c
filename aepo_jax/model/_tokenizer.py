"""Tokenizer of a checkpoint directory: `tokenizers` for the vocabulary and jinja2 for the chat template.

Rendering follows transformers' `apply_chat_template` (sandboxed jinja2, trim_blocks, lstrip_blocks,
loopcontrols, `raise_exception`, `tojson`, `strftime_now`), without importing transformers (slow to import).
Multi-turn rollouts append tokens (`encode_continuation`); they never re-encode earlier turns.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Optional, Sequence


@functools.lru_cache(maxsize=None)
def _template(source: str):
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(source)


class Tokenizer:
  """Encode/decode and chat templating for one checkpoint directory."""

  def __init__(self, tokenizer, config: dict, eos_token_ids: Sequence[int] = ()):
    self._tok = tokenizer
    self.config = config
    self.chat_template: Optional[str] = config.get("chat_template")
    self.add_bos_token = bool(config.get("add_bos_token", False))
    self.bos_token, self.eos_token, self.pad_token = (
      _content(config.get(k)) for k in ("bos_token", "eos_token", "pad_token")
    )
    self.bos_id = self.token_id(self.bos_token)
    self.eos_id = self.token_id(self.eos_token)
    pad = self.token_id(self.pad_token)
    self.pad_id = self.eos_id if pad is None else pad
    # Every id that ends a generation: the tokenizer's eos plus the model's generation_config eos ids.
    self.eos_ids = tuple(dict.fromkeys([i for i in (self.eos_id, *eos_token_ids) if i is not None]))

  @classmethod
  def from_dir(cls, path: str) -> "Tokenizer":
    from tokenizers import Tokenizer as _Tok

    path = os.fspath(path)
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
      raise FileNotFoundError(f"Tokenizer: {tok_file} is missing; save the checkpoint's fast tokenizer there.")
    config = {}
    cfg_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_file):
      with open(cfg_file) as f:
        config = json.load(f)
    template_file = os.path.join(path, "chat_template.jinja")  # transformers >= 4.43 may store it apart
    if not config.get("chat_template") and os.path.isfile(template_file):
      with open(template_file) as f:
        config["chat_template"] = f.read()
    eos = ()
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
      with open(gen_file) as f:
        e = json.load(f).get("eos_token_id")
      eos = () if e is None else tuple(e) if isinstance(e, list) else (e,)
    return cls(_Tok.from_file(tok_file), config, eos)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def token_id(self, token: Optional[str]) -> Optional[int]:
    return None if token is None else self._tok.token_to_id(token)

  def encode(self, text: str, add_bos: Optional[bool] = None) -> list[int]:
    """Token ids of `text`; special-token strings in it become special tokens. BOS as the config says."""
    ids = self._tok.encode(text, add_special_tokens=False).ids
    add_bos = self.add_bos_token if add_bos is None else add_bos
    return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

  def encode_continuation(self, text: str, parse_special: bool = False) -> list[int]:
    """Ids to append after existing tokens (e.g. a tool result): no BOS; by default special-token strings
    in `text` are encoded as plain text, so a tool's output can never forge '<|im_end|>'."""
    tok = self._tok if parse_special else self._literal
    return tok.encode(text, add_special_tokens=False).ids

  @functools.cached_property
  def _literal(self):
    """A copy that encodes special-token strings as text (a copy, so no shared flag flips under threads)."""
    tok = type(self._tok).from_str(self._tok.to_str())
    tok.encode_special_tokens = True
    return tok

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs) -> str:
    """The chat template applied to `messages` ([{'role', 'content'}]), as text."""
    if not self.chat_template:
      raise ValueError("Tokenizer: this checkpoint has no chat_template in tokenizer_config.json.")
    return _template(self.chat_template).render(
      messages=list(messages),
      add_generation_prompt=add_generation_prompt,
      bos_token=self.bos_token or "",
      eos_token=self.eos_token or "",
      **kwargs,
    )

  def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
    """Token ids of the templated conversation (the template writes any BOS itself)."""
    return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs), add_bos=False)


def _content(token):
  return token.get("content") if isinstance(token, dict) else token


# Everything transformers' AutoTokenizer reads from a checkpoint directory (chat template included).
TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "added_tokens.json",
  "vocab.json",
  "merges.txt",
  "tokenizer.model",
  "chat_template.jinja",
  "chat_template.json",
)


def copy_tokenizer_files(src: str, dst: str) -> list[str]:
  """Copy the tokenizer files of directory `src` to `dst` (each local or gs://); returns the names copied.

  Raises FileNotFoundError when `src` has no tokenizer.json (the one file every loader needs).
  """
  from etils import epath

  src_dir, dst_dir = epath.Path(src), epath.Path(dst)
  if not (src_dir / "tokenizer.json").exists():
    raise FileNotFoundError(f"{src_dir / 'tokenizer.json'} does not exist; the tokenizer directory needs it.")
  dst_dir.mkdir(parents=True, exist_ok=True)
  copied = []
  for name in TOKENIZER_FILES:
    if (src_dir / name).exists():
      (dst_dir / name).write_bytes((src_dir / name).read_bytes())  # a few MB at most
      copied.append(name)
  return copied
