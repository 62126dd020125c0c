"""One sampling step over a batch of logits: temperature, top-k, top-p, greedy, per-slot PRNG keys, and the
log-prob and entropies of the sampling distribution, all inside the caller's jitted function.

Log-probs and entropies are those of the distribution at the sampling temperature, p = softmax(logits / T),
before top-k / top-p truncation (what vLLM reports and what the trainer recomputes). Greedy (T = 0) reports them
at T = 1.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_NEG_INF = -1e30


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling settings (hashable: a static jit argument).

  temperature: 0.0 means greedy (argmax). top_p: nucleus mass in (0, 1]; 1 disables. top_k: 0 disables.
  """
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0 (0 means greedy).")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1].")
    if self.top_k < 0:
      raise ValueError(f"SamplingParams.top_k={self.top_k} must be >= 0 (0 disables top-k).")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def entropy_from_logits(z_sv, lse_s=None):
  """Exact entropy of softmax(z): logsumexp(z) - sum softmax(z) * z (spec §1.2 step 2.2, exact variant).
  lse_s: logsumexp(z) when the caller has it already (saves one pass over the vocabulary)."""
  if lse_s is None:
    lse_s = jax.nn.logsumexp(z_sv, axis=-1)
  p_sv = jnp.exp(z_sv - lse_s[:, None])
  return lse_s - jnp.sum(p_sv * z_sv, axis=-1)


def _iter_max(x_sn, k: int):
  """The k largest values per row by k max-and-mask passes (equal values are removed together)."""
  def body(x, _):
    m_s = jnp.max(x, axis=-1)
    return jnp.where(x >= m_s[:, None], -jnp.inf, x), m_s
  _, top_ks = jax.lax.scan(body, x_sn, None, length=k)
  return jnp.swapaxes(top_ks, 0, 1)


def _top_values(x_sv, k: int, blocks: int = 256):
  """The k largest values per row. Inside the sampling step XLA:CPU rewrites lax.top_k into a full-vocabulary
  sort (~100x slower), so: the top-k values lie in the k blocks with the largest maxima; find those blocks,
  then the top k among their entries. Exact up to ties (measure-zero for real logits)."""
  s, v = x_sv.shape
  blocks = min(blocks, v)
  width = -(-v // blocks)
  x_sbw = jnp.pad(x_sv, ((0, 0), (0, blocks * width - v)), constant_values=-jnp.inf).reshape(s, blocks, width)
  bmax_sb = jnp.max(x_sbw, axis=-1)
  kb = min(k, blocks)
  def pick(bm, _):
    i_s = jnp.argmax(bm, axis=-1)
    return bm.at[jnp.arange(s), i_s].set(-jnp.inf), i_s
  _, idx_ks = jax.lax.scan(pick, bmax_sb, None, length=kb)
  cand = jnp.take_along_axis(x_sbw, jnp.swapaxes(idx_ks, 0, 1)[:, :, None], axis=1).reshape(s, kb * width)
  return _iter_max(cand, k)


def topk_entropy(z_sv, lse_s, chosen_logp_s, k: int):
  """The official truncated entropy -sum exp(l) * l over the top-k log-probs plus the sampled token when it is
  outside them (ARPO code, spec §1.2 step 2.2; vLLM `logprobs=k`). Not normalised by ln|V|.
  chosen_logp_s is the sampled token's log-prob (passed in: a second gather here is slow on XLA:CPU)."""
  top_sk = _top_values(z_sv, k) - lse_s[:, None]  # top-k of log-softmax = top-k of logits, shifted
  outside_s = chosen_logp_s < top_sk[:, -1]  # ties count as inside (vLLM returns the chosen token once)
  h_s = -jnp.sum(jnp.where(jnp.isfinite(top_sk), jnp.exp(top_sk) * top_sk, 0.0), axis=-1)
  return h_s + jnp.where(outside_s, -jnp.exp(chosen_logp_s) * chosen_logp_s, 0.0)


def _truncate(z_sv, params: SamplingParams):
  """Mask logits outside the top-k and outside the top-p nucleus (the token crossing p stays in)."""
  if params.top_k > 0 and params.top_k < z_sv.shape[-1]:
    kth_s = jax.lax.top_k(z_sv, params.top_k)[0][:, -1]
    z_sv = jnp.where(z_sv < kth_s[:, None], _NEG_INF, z_sv)
  if params.top_p < 1.0:
    sorted_sv = jnp.sort(z_sv, axis=-1)[:, ::-1]
    probs_sv = jax.nn.softmax(sorted_sv, axis=-1)
    mass_before_sv = jnp.cumsum(probs_sv, axis=-1) - probs_sv
    keep_sv = mass_before_sv < params.top_p
    cutoff_s = jnp.min(jnp.where(keep_sv, sorted_sv, jnp.inf), axis=-1)
    z_sv = jnp.where(z_sv < cutoff_s[:, None], _NEG_INF, z_sv)
  return z_sv


def _categorical(key_s2, z_sv, blocks: int = 256):
  """One draw per row from softmax(z) by a two-level inverse CDF: one uniform per row, a cumulative sum over
  `blocks` block masses, then within the chosen block. Exact up to float rounding; ~15x faster on XLA:CPU than
  jax.random.categorical, which draws one Gumbel per vocabulary entry."""
  s, v = z_sv.shape
  width = -(-v // blocks)
  p_sv = jnp.exp(z_sv - jnp.max(z_sv, axis=-1, keepdims=True))
  p_sbw = jnp.pad(p_sv, ((0, 0), (0, blocks * width - v))).reshape(s, blocks, width)
  cum_sb = jnp.cumsum(jnp.sum(p_sbw, axis=-1), axis=-1)
  u_s = jax.vmap(lambda k: jax.random.uniform(k, ()))(key_s2) * cum_sb[:, -1]
  b_s = jnp.minimum(jnp.sum(cum_sb < u_s[:, None], axis=-1), blocks - 1)
  before_s = jnp.where(b_s > 0, jnp.take_along_axis(cum_sb, jnp.maximum(b_s - 1, 0)[:, None], 1)[:, 0], 0.0)
  inner_sw = jnp.take_along_axis(p_sbw, b_s[:, None, None], 1)[:, 0]
  cum_sw = jnp.cumsum(inner_sw, axis=-1) + before_s[:, None]
  j_s = jnp.minimum(jnp.sum(cum_sw < u_s[:, None], axis=-1), width - 1)
  token_s = (b_s * width + j_s).astype(jnp.int32)
  # Rounding can land on a zero-mass entry (padding, or a token cut by top-k/top-p): take the mode then.
  chosen_p = jnp.take_along_axis(inner_sw, j_s[:, None], 1)[:, 0]
  return jnp.where(chosen_p > 0, token_s, jnp.argmax(z_sv, axis=-1).astype(jnp.int32))


def sample_step(logits_sv, rng_s2, params: SamplingParams, *, with_entropy: bool = True, topk: int = 0):
  """Sample one token per row. Returns (token [S] int32, logprob [S], entropy [S], topk_entropy [S], new rng).

  rng_s2 holds one raw uint32[2] key per row; each row's key is split once per step, so a row's stream does not
  depend on the other rows (a forked slot given its parent's key reproduces the parent's continuation).
  """
  logits_sv = logits_sv.astype(jnp.float32)
  z_sv = logits_sv if params.greedy else logits_sv / params.temperature
  split = jax.vmap(lambda k: jax.random.split(k, 2))(rng_s2)
  new_rng_s2, draw_s2 = split[:, 0], split[:, 1]
  if params.greedy:
    token_s = jnp.argmax(z_sv, axis=-1).astype(jnp.int32)
  else:
    zt_sv = _truncate(z_sv, params)
    token_s = _categorical(draw_s2, zt_sv)
  lse_s = jax.nn.logsumexp(z_sv, axis=-1)
  chosen_s = jnp.take_along_axis(z_sv, token_s[:, None], axis=-1)[:, 0]
  logprob_s = chosen_s - lse_s
  zeros = jnp.zeros_like(logprob_s)
  entropy_s = entropy_from_logits(z_sv, lse_s) if with_entropy else zeros
  topk_s = topk_entropy(z_sv, lse_s, logprob_s, topk) if (with_entropy and topk > 0) else zeros
  return token_s, logprob_s, entropy_s, topk_s, new_rng_s2
