"""Tiny random Hugging Face checkpoints of each supported family, built with transformers + CPU torch."""

from __future__ import annotations

import os

# Dims divide the mesh axes used in tests (fsdp up to 4, tensor up to 4).
_BASE = dict(
  vocab_size=320,
  hidden_size=64,
  intermediate_size=128,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  max_position_embeddings=256,
  rms_norm_eps=1e-5,
  tie_word_embeddings=False,
  bos_token_id=1,
  eos_token_id=2,
  pad_token_id=0,
)

FAMILIES = ("llama", "llama_rope", "qwen2", "qwen3")
MOE_FAMILIES = ("qwen3_moe",)  # tiny_hf_config / tiny_hf_model / tiny_hf_checkpoint build them too

_FAMILY = {
  "llama": ("LlamaForCausalLM", "llama", dict(rope_theta=10000.0)),
  # Llama-3 rope scaling with a short original context, so the scaled low frequencies matter.
  "llama_rope": (
    "LlamaForCausalLM",
    "llama",
    dict(
      rope_theta=50000.0,
      rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
      ),
    ),
  ),
  "qwen2": ("Qwen2ForCausalLM", "qwen2", dict(rope_theta=1000000.0)),  # q/k/v biases are built in
  "qwen3": ("Qwen3ForCausalLM", "qwen3", dict(rope_theta=1000000.0)),  # q/k RMSNorm
  # 3 layers, the middle one dense (mlp_only_layers); 8 experts of width 32, top 2 renormalised.
  "qwen3_moe": (
    "Qwen3MoeForCausalLM",
    "qwen3_moe",
    dict(
      rope_theta=1000000.0,
      num_hidden_layers=3,
      num_experts=8,
      num_experts_per_tok=2,
      moe_intermediate_size=32,
      norm_topk_prob=True,
      decoder_sparse_step=1,
      mlp_only_layers=[1],
    ),
  ),
}


def tiny_hf_config(family: str, **overrides) -> dict:
  """A transformers-4 style config.json dict (`rope_theta`/`rope_scaling` at the top level)."""
  if family not in _FAMILY:
    raise ValueError(f"tiny_hf_config: unknown family {family!r}; choose one of {FAMILIES + MOE_FAMILIES}.")
  arch, model_type, extra = _FAMILY[family]
  return {"architectures": [arch], "model_type": model_type, **_BASE, **extra, **overrides}


def tiny_hf_model(family: str, seed: int = 0, **overrides):
  """A transformers model with random weights large enough that every parameter moves the logits."""
  import torch
  import transformers

  hf = tiny_hf_config(family, **overrides)
  config = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"})
  config.architectures = hf["architectures"]
  torch.manual_seed(seed)
  model = getattr(transformers, hf["architectures"][0])(config).to(torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.1)
  return model


def tiny_hf_checkpoint(family: str, path, seed: int = 0, max_shard_size=None, **overrides) -> str:
  """Saves `tiny_hf_model(family, seed, **overrides)` into `path` (safetensors; sharded if max_shard_size)."""
  path = os.fspath(path)
  model = tiny_hf_model(family, seed, **overrides)
  kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
  model.save_pretrained(path, **kw)
  return path
