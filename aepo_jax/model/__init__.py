"""The policy model: config and presets, the Flax decoder (Llama / Qwen2 / Qwen3) and its functional surface.

Public API:
  ModelConfig, PRESETS, preset(name)            configuration (hashable, a static jit argument)
  init_params(config, rng)                      random parameters (nested dict, layers stacked)
  forward(config, params, tokens, positions=None, attention_mask=None) -> float32 logits [B,T,V]
  forward_hidden / unembed                      the same split in two (for chunked log-prob/entropy)
  init_cache / forward_cached                   per-row KV cache used by the rollout engine
  param_logical_axes(config)                    logical axis names of every parameter (for sharding)
"""
from aepo_jax.model._config import FAMILIES, PRESETS, ModelConfig, preset
from aepo_jax.model._functional import (CACHE_LOGICAL_AXES, default_positions, forward, forward_cached,
                                        forward_hidden, init_cache, init_params, param_logical_axes, unembed)
