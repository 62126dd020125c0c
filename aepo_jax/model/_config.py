"""Model configuration for the Llama / Qwen2 / Qwen3 decoder family, and presets for published sizes.

`ModelConfig` is a frozen (hashable) dataclass so it can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

FAMILIES = ("llama", "qwen2", "qwen3")
ATTENTION_IMPLS = ("auto", "xla", "cpu_kernel", "splash")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  family: str  # 'llama' | 'qwen2' | 'qwen3'
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  # Hashable rope scaling: a tuple of sorted (key, value) pairs, e.g. (('factor', 8.0), ('rope_type', 'llama3'), ...).
  rope_scaling: Optional[tuple] = None
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  attention_bias: bool = False  # Qwen2: biases on q/k/v projections.
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE.
  max_position_embeddings: int = 32768
  bos_token_id: Optional[int] = None
  eos_token_ids: tuple = ()
  pad_token_id: Optional[int] = None
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"
  remat: bool = False  # rematerialise each layer in the backward pass (training)
  # Full-sequence attention: 'xla' (jnp ops, any backend and mesh), 'cpu_kernel' (the C++ kernel of
  # model/_cpu_attention.py: float32, one CPU device), 'splash' (JAX's Pallas splash-attention kernel,
  # model/_splash.py: TPU; interpret mode elsewhere), 'auto' ('xla', except where a training or scoring step
  # resolves it with `resolve_attention_impl(config, mesh)`: 'cpu_kernel' on one CPU device, 'splash' on TPU).
  # Execution only: parameters are the same.
  attention_impl: str = "auto"
  # Splash attention's query and key/value blocks (tokens, multiples of 128; forward and both backward kernels),
  # capped at the row length. 512 compiles for Qwen3-14B's 8,192- and 20,480-token rows (docs/performance.md).
  splash_block_q: int = 512
  splash_block_kv: int = 512
  # Layers of the scanned layer loop per loop iteration (nn.scan's `unroll`; num_layers = fully unrolled). On CPU
  # a full unroll made the SmolLM2 8 x 256 update step ~5% faster and its compile ~12 s longer
  # (docs/performance.md). Execution only: parameters are the same.
  scan_unroll: int = 1

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"ModelConfig.family={self.family!r} is not supported; choose one of {FAMILIES}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"ModelConfig: num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}."
      )
    if not 1 <= self.scan_unroll:
      raise ValueError(f"ModelConfig.scan_unroll={self.scan_unroll}: must be >= 1 (num_layers unrolls fully).")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"ModelConfig.attention_impl={self.attention_impl!r}: use one of {ATTENTION_IMPLS}.")
    for name in ("splash_block_q", "splash_block_kv"):
      block = getattr(self, name)
      if not (isinstance(block, int) and block >= 128 and block % 128 == 0):
        raise ValueError(f"ModelConfig.{name}={block!r}: must be a positive multiple of 128 (the TPU lane width).")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16", "float16", "float64"):
        raise ValueError(
          f"ModelConfig.{name}={getattr(self, name)!r}: use 'float32', 'bfloat16' or 'float16' "
          "('float64' is a reference mode for numerics checks; it needs jax.enable_x64)."
        )

  @property
  def rope_scaling_dict(self) -> Optional[dict]:
    return dict(self.rope_scaling) if self.rope_scaling else None

  @property
  def num_params(self) -> int:
    d, i, v, l = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
    q = d * self.num_heads * self.head_dim
    kv = 2 * d * self.num_kv_heads * self.head_dim
    o = self.num_heads * self.head_dim * d
    bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.attention_bias else 0
    norms = 2 * d + (2 * self.head_dim if self.qk_norm else 0)
    per_layer = q + kv + o + bias + 3 * d * i + norms
    embed = v * d * (1 if self.tie_word_embeddings else 2)
    return l * per_layer + embed + d

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)


def _scaling(**kw) -> tuple:
  return tuple(sorted(kw.items()))


# Published sizes (values from the checkpoints' config.json files; eos ids from the instruct models'
# generation_config.json). tests/model/test_config.py checks them against those files' contents.
PRESETS = {
  "smollm2-135m": ModelConfig(
    family="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    bos_token_id=1,
    eos_token_ids=(2,),
    pad_token_id=2,
  ),
  "llama-3.1-8b": ModelConfig(
    family="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    rope_scaling=_scaling(
      rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    ),
    max_position_embeddings=131072,
    bos_token_id=128000,
    eos_token_ids=(128001, 128008, 128009),
  ),
  "qwen2.5-0.5b": ModelConfig(
    family="qwen2",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_bias=True,
    max_position_embeddings=32768,
    eos_token_ids=(151645, 151643),
    pad_token_id=151643,
  ),
  "qwen2.5-3b": ModelConfig(
    family="qwen2",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=11008,
    num_layers=36,
    num_heads=16,
    num_kv_heads=2,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_bias=True,
    max_position_embeddings=32768,
    eos_token_ids=(151645, 151643),
    pad_token_id=151643,
  ),
  "qwen2.5-7b": ModelConfig(
    family="qwen2",
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    attention_bias=True,
    max_position_embeddings=32768,
    eos_token_ids=(151645, 151643),
    pad_token_id=151643,
  ),
  "qwen2.5-14b": ModelConfig(
    family="qwen2",
    vocab_size=152064,
    hidden_size=5120,
    intermediate_size=13824,
    num_layers=48,
    num_heads=40,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-5,
    attention_bias=True,
    max_position_embeddings=32768,
    eos_token_ids=(151645, 151643),
    pad_token_id=151643,
  ),
  # QwQ-32B has the Qwen2.5-32B architecture (Qwen/QwQ-32B config.json).
  "qwq-32b": ModelConfig(
    family="qwen2",
    vocab_size=152064,
    hidden_size=5120,
    intermediate_size=27648,
    num_layers=64,
    num_heads=40,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-5,
    attention_bias=True,
    max_position_embeddings=40960,
    eos_token_ids=(151645, 151643),
    pad_token_id=151643,
  ),
  "llama-3.2-1b": ModelConfig(
    family="llama",
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    rope_scaling=_scaling(
      rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    ),
    tie_word_embeddings=True,
    max_position_embeddings=131072,
    bos_token_id=128000,
    eos_token_ids=(128001, 128008, 128009),
  ),
  "llama-3.2-3b": ModelConfig(
    family="llama",
    vocab_size=128256,
    hidden_size=3072,
    intermediate_size=8192,
    num_layers=28,
    num_heads=24,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    rope_scaling=_scaling(
      rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    ),
    tie_word_embeddings=True,
    max_position_embeddings=131072,
    bos_token_id=128000,
    eos_token_ids=(128001, 128008, 128009),
  ),
  "qwen3-4b": ModelConfig(
    family="qwen3",
    vocab_size=151936,
    hidden_size=2560,
    intermediate_size=9728,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    qk_norm=True,
    max_position_embeddings=40960,
    eos_token_ids=(151645, 151643),
    pad_token_id=151643,
  ),
  "qwen3-0.6b": ModelConfig(
    family="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    qk_norm=True,
    max_position_embeddings=40960,
    eos_token_ids=(151645, 151643),
    pad_token_id=151643,
  ),
  "qwen3-8b": ModelConfig(
    family="qwen3",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    qk_norm=True,
    max_position_embeddings=40960,
    eos_token_ids=(151645, 151643),
    pad_token_id=151643,
  ),
  "qwen3-14b": ModelConfig(
    family="qwen3",
    vocab_size=151936,
    hidden_size=5120,
    intermediate_size=17408,
    num_layers=40,
    num_heads=40,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    qk_norm=True,
    max_position_embeddings=40960,
    eos_token_ids=(151645, 151643),
    pad_token_id=151643,
  ),
}


def preset(name: str, **overrides) -> ModelConfig:
  if name not in PRESETS:
    raise ValueError(f"Unknown model preset {name!r}; known presets: {sorted(PRESETS)}.")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
