"""Hugging Face `config.json` <-> `ModelConfig`.

Reads both forms transformers has written: v4 (`rope_theta` + `rope_scaling` at the top level, as published
checkpoints have it) and v5 (`rope_parameters` = {rope_theta, rope_type, ...}). Writes the v4 form, which
transformers 4.45+, transformers 5 and vLLM all read.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from aepo_jax.model._config import ModelConfig

# HF architecture name -> (our family, HF model_type).
ARCHITECTURES = {
  "LlamaForCausalLM": ("llama", "llama"),
  "Qwen2ForCausalLM": ("qwen2", "qwen2"),
  "Qwen3ForCausalLM": ("qwen3", "qwen3"),
  "Qwen3MoeForCausalLM": ("qwen3_moe", "qwen3_moe"),
}
_MODEL_TYPES = {model_type: arch for arch, (_, model_type) in ARCHITECTURES.items()}
_FAMILY_ARCH = {family: arch for arch, (family, _) in ARCHITECTURES.items()}


def _architecture(hf: Mapping[str, Any], source: str) -> str:
  archs = hf.get("architectures") or []
  for arch in archs:
    if arch in ARCHITECTURES:
      return arch
  if not archs and hf.get("model_type") in _MODEL_TYPES:  # configs built in code carry no 'architectures'
    return _MODEL_TYPES[hf["model_type"]]
  raise ValueError(
    f"{source}: unsupported architecture {archs or hf.get('model_type')!r}; aepo_jax supports "
    f"{sorted(ARCHITECTURES)} (the 'architectures' entry of config.json)."
  )


def _rope(hf: Mapping[str, Any]) -> tuple[float, Optional[tuple]]:
  params = hf.get("rope_parameters")
  if params:  # transformers 5
    params = dict(params)
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
  else:  # transformers 4
    theta = hf.get("rope_theta", 10000.0)
    params = dict(hf.get("rope_scaling") or {})
  if "type" in params and "rope_type" not in params:  # the oldest spelling
    params["rope_type"] = params.pop("type")
  params.pop("type", None)
  if params.get("rope_type", "default") == "default":
    return float(theta), None
  return float(theta), tuple(sorted(params.items()))


def _moe_fields(hf: Mapping[str, Any]) -> dict:
  """The expert fields of a Qwen3-MoE config.json (transformers 5 also writes `num_experts` as `num_local_experts`)."""
  return dict(
    num_experts=int(hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]),
    num_experts_per_tok=int(hf["num_experts_per_tok"]),
    moe_intermediate_size=int(hf["moe_intermediate_size"]),
    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
    mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
  )


def from_hf_config(hf: Mapping[str, Any], *, dtype: str = "float32", source: str = "config.json") -> ModelConfig:
  """A `ModelConfig` from the dict of an HF `config.json` (`source` names the file in errors)."""
  arch = _architecture(hf, source)
  family = ARCHITECTURES[arch][0]
  unsupported = []
  if hf.get("mlp_bias"):
    unsupported.append("mlp_bias=true")
  if family != "qwen2" and hf.get("attention_bias"):  # Llama/Qwen3 put a bias on o_proj too
    unsupported.append("attention_bias=true")
  if hf.get("use_sliding_window"):
    unsupported.append("use_sliding_window=true")
  if hf.get("hidden_act", "silu") != "silu":
    unsupported.append(f"hidden_act={hf['hidden_act']!r}")
  if unsupported:
    raise ValueError(f"{source}: {', '.join(unsupported)} is not supported by the aepo_jax decoder ({arch}).")
  try:
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    theta, scaling = _rope(hf)
    eos = hf.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    default_head_dim = hidden // heads if family in ("llama", "qwen2") else 128  # Qwen3(Moe)Config's default: 128
    return ModelConfig(
      family=family,
      vocab_size=int(hf["vocab_size"]),
      hidden_size=hidden,
      intermediate_size=int(hf["intermediate_size"]),
      num_layers=int(hf["num_hidden_layers"]),
      num_heads=heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(hf.get("head_dim") or default_head_dim),
      rope_theta=theta,
      rope_scaling=scaling,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      attention_bias=family == "qwen2",
      qk_norm=family in ("qwen3", "qwen3_moe"),
      **(_moe_fields(hf) if family == "qwen3_moe" else {}),
      max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
      bos_token_id=hf.get("bos_token_id"),
      eos_token_ids=eos,
      pad_token_id=hf.get("pad_token_id"),
      dtype=dtype,
      param_dtype=dtype,
    )
  except KeyError as e:
    raise ValueError(f"{source}: required key {e.args[0]!r} is missing.") from None


def to_hf_config(config: ModelConfig, *, torch_dtype: Optional[str] = None) -> dict:
  """The `config.json` dict (transformers-4 form) describing `config`."""
  arch = _FAMILY_ARCH[config.family]
  eos = list(config.eos_token_ids)
  hf = {
    "architectures": [arch],
    "model_type": ARCHITECTURES[arch][1],
    "vocab_size": config.vocab_size,
    "hidden_size": config.hidden_size,
    "intermediate_size": config.intermediate_size,
    "num_hidden_layers": config.num_layers,
    "num_attention_heads": config.num_heads,
    "num_key_value_heads": config.num_kv_heads,
    "head_dim": config.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": config.max_position_embeddings,
    "rms_norm_eps": config.rms_norm_eps,
    "rope_theta": config.rope_theta,
    "rope_scaling": config.rope_scaling_dict,
    "tie_word_embeddings": config.tie_word_embeddings,
    "bos_token_id": config.bos_token_id,
    "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    "pad_token_id": config.pad_token_id,
    "torch_dtype": torch_dtype or config.param_dtype,
    "use_cache": True,
  }
  if config.family == "llama":
    hf.update(attention_bias=False, mlp_bias=False)
  elif config.family == "qwen2":
    hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_layers)
  else:
    hf.update(attention_bias=False, use_sliding_window=False, sliding_window=None, max_window_layers=config.num_layers)
  if config.family == "qwen3_moe":
    hf.update(
      num_experts=config.num_experts,
      num_experts_per_tok=config.num_experts_per_tok,
      moe_intermediate_size=config.moe_intermediate_size,
      norm_topk_prob=config.norm_topk_prob,
      decoder_sparse_step=config.decoder_sparse_step,
      mlp_only_layers=list(config.mlp_only_layers),
      # the checkpoint's pre-training value is not kept (ModelConfig.router_aux_loss_coef); HF's default
      router_aux_loss_coef=0.001,
      output_router_logits=False,
    )
  return hf
