"""The tiny ModelConfig the tests share: small enough to initialise and compile in seconds on a CPU."""

from __future__ import annotations

TINY_MODEL = dict(  # every size of the tiny config; a test that needs another one passes it as an override
  vocab_size=97,
  hidden_size=32,
  intermediate_size=64,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
)


def tiny_model_config(family: str = "llama", **overrides):
  """An `aepo_jax.model.ModelConfig` of `family` with the TINY_MODEL sizes (Qwen3 with its q/k norm), then
  `overrides` (any ModelConfig field: vocab_size=, eos_token_ids=, pad_token_id=, attention_bias=, ...)."""
  from aepo_jax.model import ModelConfig  # jax is imported only by the tests that build a model

  fields = dict(TINY_MODEL, family=family, qk_norm=family == "qwen3")
  fields.update(overrides)
  return ModelConfig(**fields)
