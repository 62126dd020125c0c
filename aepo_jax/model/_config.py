"""Model configuration for the Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder family, and presets for published sizes.

`ModelConfig` is a frozen (hashable) dataclass so it can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
MOE_IMPLS = ("auto", "gmm", "ragged", "dense", "gather")
GMM_DTYPES = ("float32", "bfloat16")  # the compute dtypes moe_impl='gmm' takes (the Pallas TPU kernel's operands)
ATTENTION_IMPLS = ("auto", "xla", "cpu_kernel", "splash")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  family: str  # 'llama' | 'qwen2' | 'qwen3' | 'qwen3_moe'
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
  # Mixture of experts (Qwen3-MoE; num_experts=0: every layer dense). A sparse layer replaces the SwiGLU MLP by a
  # softmax router over `num_experts` SwiGLU experts of width `moe_intermediate_size`, each token going to its
  # top `num_experts_per_tok`, their probabilities renormalised to sum to 1 when `norm_topk_prob` (HF's switch).
  # Layer i is sparse unless i is in `mlp_only_layers` or (i + 1) % decoder_sparse_step != 0 (HF's rule); dense
  # layers keep the `intermediate_size` MLP.
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple = ()
  # Weight of the Switch-style load-balancing loss (`model.load_balancing_loss`). Off (0) for RL: the RL papers
  # this project follows put no balancing term in their objectives (the balance was set in pre-training), and a term
  # that moves the router shifts which experts the rollout's tokens went through between sampling and the update,
  # the routing drift that GSPO (arXiv 2507.18071, §5.3) names as a source of instability for MoE policies.
  # HF checkpoints carry 0.001 (pre-training's value): `from_hf_config` does not read it, `to_hf_config` writes it
  # back. > 0 (e.g. `--config.model.overrides.router_aux_loss_coef=0.001` for an SFT of a MoE model): the SFT and
  # RL update steps add this weight times the mean over micro-batches of each one's balance loss over its valid
  # tokens (`_balance.balance_loss`), reported as sft/router_aux_loss and actor/router_aux_loss.
  router_aux_loss_coef: float = 0.0
  # Expert computation: 'gmm' (tokens sorted by expert, the grouped matmul of JAX's Pallas TPU library: dropless, k
  # of E experts' FLOPs; float32 or bfloat16; interpret mode off TPU, slow), 'ragged' (the same sorted rows through
  # `jax.lax.ragged_dot`), 'dense' (every expert on every token, combined by the gates: E / k times the FLOPs, no
  # sort or gather), 'gather' (each token's k experts' weights gathered: reads only the chosen experts, for a decode
  # step's few tokens), 'auto' (on CPU 'gather' when 2 N k <= E and 'dense' otherwise, as measured,
  # docs/performance.md; 'gmm' on TPU, 'ragged' there for other dtypes and elsewhere; model/_experts.py).
  # Execution only: parameters are the same.
  moe_impl: str = "auto"
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
    object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))  # hashable
    self._check_moe()
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

  def _check_moe(self):
    if self.moe_impl not in MOE_IMPLS:
      raise ValueError(f"ModelConfig.moe_impl={self.moe_impl!r}: use one of {MOE_IMPLS}.")
    if self.num_experts < 0:
      raise ValueError(f"ModelConfig.num_experts={self.num_experts}: must be >= 0 (0: no experts).")
    if (self.family == "qwen3_moe") != (self.num_experts > 0):
      raise ValueError(
        f"ModelConfig: family={self.family!r} with num_experts={self.num_experts}; experts (num_experts > 0) "
        "come with family 'qwen3_moe' and only with it."
      )
    if not self.num_experts:
      return
    if not 1 <= self.num_experts_per_tok <= self.num_experts:
      raise ValueError(
        f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok}: must be in [1, num_experts={self.num_experts}]."
      )
    if self.moe_intermediate_size <= 0:
      raise ValueError(f"ModelConfig.moe_intermediate_size={self.moe_intermediate_size}: must be > 0.")
    if self.moe_impl == "gmm" and self.dtype not in GMM_DTYPES:
      raise ValueError(
        f"ModelConfig.moe_impl='gmm' takes dtype in {GMM_DTYPES}, not dtype={self.dtype!r}: use moe_impl 'ragged' or "
        "'dense' (or 'auto')."
      )
    if self.decoder_sparse_step < 1:
      raise ValueError(f"ModelConfig.decoder_sparse_step={self.decoder_sparse_step}: must be >= 1.")
    bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
    if bad:
      raise ValueError(f"ModelConfig.mlp_only_layers has {bad}, outside [0, num_layers={self.num_layers}).")

  @property
  def moe_layers(self) -> tuple:
    """Per layer: True where the layer's MLP is the sparse expert block (HF's Qwen3MoeDecoderLayer rule)."""
    return tuple(
      self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
      for i in range(self.num_layers)
    )

  @property
  def has_dense_mlp(self) -> bool:
    """Some layer has the dense SwiGLU MLP (its parameters are stacked over every layer)."""
    return not all(self.moe_layers)

  @property
  def has_experts(self) -> bool:
    return any(self.moe_layers)

  @property
  def rope_scaling_dict(self) -> Optional[dict]:
    return dict(self.rope_scaling) if self.rope_scaling else None

  @property
  def num_params(self) -> int:
    """Parameters of the checkpoint (every expert counted)."""
    return self._count(self.num_experts)

  @property
  def num_active_params(self) -> int:
    """Parameters a token goes through (its top `num_experts_per_tok` experts; = num_params for a dense model)."""
    return self._count(self.num_experts_per_tok)

  def _count(self, experts: int) -> int:
    d, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
    q = d * self.num_heads * self.head_dim
    kv = 2 * d * self.num_kv_heads * self.head_dim
    o = self.num_heads * self.head_dim * d
    bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.attention_bias else 0
    norms = 2 * d + (2 * self.head_dim if self.qk_norm else 0)
    sparse = sum(self.moe_layers)
    mlps = (self.num_layers - sparse) * 3 * d * i + sparse * (
      d * self.num_experts + experts * 3 * d * self.moe_intermediate_size
    )
    embed = v * d * (1 if self.tie_word_embeddings else 2)
    return self.num_layers * (q + kv + o + bias + norms) + mlps + embed + d

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
  # Qwen3-MoE (Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json): 128 experts, top 8 renormalised, every
  # layer sparse. Shapes for compile plans and memory estimates; 30.5B / 235.1B parameters, 3.3B / 22.1B active.
  "qwen3-30b-a3b": ModelConfig(
    family="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    qk_norm=True,
    max_position_embeddings=40960,
    eos_token_ids=(151645, 151643),
    pad_token_id=151643,
  ),
  "qwen3-235b-a22b": ModelConfig(
    family="qwen3_moe",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=94,
    num_heads=64,
    num_kv_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=1536,
    norm_topk_prob=True,
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
