"""One sampling step over a batch of logits: repetition penalty, temperature, min-p, top-k, top-p, greedy,
per-slot PRNG keys, and the log-prob and entropies of the sampling distribution, all inside the caller's jitted
function.

Order (vLLM's): repetition penalty on the raw logits, then temperature, then the truncations min-p, top-k,
top-p. The settings are either static (`SamplingParams`, one for every row; a static jit argument) or per row
(`SlotSampling`, arrays [S]; the engine's per-slot mode, where each slot samples with its own request's settings).

Log-probs and entropies are those of the distribution p = softmax(penalised logits / T): after the repetition
penalty and the temperature, before min-p / top-k / top-p truncation. Without a penalty that is the policy at
the sampling temperature (what the trainer recomputes); with one it is the distribution the token was drawn
from before truncation. Greedy (T = 0) reports them at T = 1.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence, Union

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# The one exact-entropy function, shared with the trainer; objectives/ is pure jax, so importing it pulls nothing in.
from aepo_jax.objectives import entropy_from_logits

_NEG_INF = -1e30


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling settings (hashable: a static jit argument).

  temperature: 0.0 means greedy (argmax). top_p: nucleus mass in (0, 1]; 1 disables. top_k: 0 disables.
  min_p: keep tokens with probability >= min_p * the largest probability, in [0, 1]; 0 disables.
  repetition_penalty: > 0; 1 disables. Every token present in the row (prompt, generated and inserted tokens)
  has its logit divided by it when positive and multiplied by it when negative (transformers' and vLLM's rule).
  ignore_eos: keep decoding after an EOS token (vLLM's field; read by the engine's stop check, not the sampler).
  """

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  ignore_eos: bool = False

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0 (0 means greedy).")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1].")
    if self.top_k < 0:
      raise ValueError(f"SamplingParams.top_k={self.top_k} must be >= 0 (0 disables top-k).")
    if not 0.0 <= self.min_p <= 1.0:
      raise ValueError(f"SamplingParams.min_p={self.min_p} must be in [0, 1] (0 disables min-p).")
    if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
      raise ValueError(
        f"SamplingParams.repetition_penalty={self.repetition_penalty} must be a finite number > 0 (1 disables it)."
      )

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


@flax.struct.dataclass
class SlotSampling:
  """Per-slot sampling settings (each [S]; the meaning of `SamplingParams`' fields), held in the DecodeState."""

  temperature: jax.Array  # [S] float32, 0 = greedy
  top_p: jax.Array  # [S] float32, 1 disables
  top_k: jax.Array  # [S] int32, 0 disables
  min_p: jax.Array  # [S] float32, 0 disables
  repetition_penalty: jax.Array  # [S] float32, 1 disables
  ignore_eos: jax.Array  # [S] bool

  @classmethod
  def of(cls, params: Sequence[SamplingParams]) -> "SlotSampling":
    """Host (numpy) arrays, one entry per SamplingParams."""

    def col(name, dtype):
      return np.asarray([getattr(p, name) for p in params], dtype)

    return cls(
      temperature=col("temperature", np.float32),
      top_p=col("top_p", np.float32),
      top_k=col("top_k", np.int32),
      min_p=col("min_p", np.float32),
      repetition_penalty=col("repetition_penalty", np.float32),
      ignore_eos=col("ignore_eos", bool),
    )

  @classmethod
  def filled(cls, s: int, params: SamplingParams = SamplingParams()) -> "SlotSampling":
    """Device arrays [s] all holding `params` (a fresh buffer per field: the engine donates its state)."""

    def full(x, dtype):
      return jnp.full((s,), x, dtype)

    return cls(
      temperature=full(params.temperature, jnp.float32),
      top_p=full(params.top_p, jnp.float32),
      top_k=full(params.top_k, jnp.int32),
      min_p=full(params.min_p, jnp.float32),
      repetition_penalty=full(params.repetition_penalty, jnp.float32),
      ignore_eos=full(params.ignore_eos, bool),
    )


class Sample(NamedTuple):
  """What `sample_step` returns (all [S] unless noted)."""

  token: jax.Array  # int32
  logprob: jax.Array  # log p of the token (see the module docstring for which p)
  entropy: jax.Array  # exact entropy of p (0 when not requested)
  topk_entropy: jax.Array  # official top-k truncated entropy (0 when not requested)
  rng: jax.Array  # [S, 2] the rows' next keys
  top_ids: jax.Array  # [S, N] int32, the N most likely tokens under p, most likely first (N = top_logprobs)
  top_logprobs: jax.Array  # [S, N] their log-probs


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
  x_sbw, idx_sb = _top_blocks(x_sv, k, blocks)
  cand = jnp.take_along_axis(x_sbw, idx_sb[:, :, None], axis=1).reshape(x_sv.shape[0], -1)
  return _iter_max(cand, k)


def topk_entropy(z_sv, lse_s, chosen_logp_s, k: int):
  """The official truncated entropy -sum exp(l) * l over the top-k log-probs plus the sampled token when it is
  outside them (ARPO code, spec §1.2 step 2.2; vLLM `logprobs=k`). Not normalised by ln|V|.
  chosen_logp_s is the sampled token's log-prob (passed in: a second gather here is slow on XLA:CPU)."""
  top_sk = _top_values(z_sv, k) - lse_s[:, None]  # top-k of log-softmax = top-k of logits, shifted
  outside_s = chosen_logp_s < top_sk[:, -1]  # ties count as inside (vLLM returns the chosen token once)
  h_s = -jnp.sum(jnp.where(jnp.isfinite(top_sk), jnp.exp(top_sk) * top_sk, 0.0), axis=-1)
  return h_s + jnp.where(outside_s, -jnp.exp(chosen_logp_s) * chosen_logp_s, 0.0)


def _top_blocks(x_sv, k: int, blocks: int):
  """x as [S, blocks, width] (padded with -inf) and, per row, the indices [S, min(k, blocks)] of the blocks with
  the largest maxima: the k largest entries of a row lie in those blocks."""
  s, v = x_sv.shape
  blocks = min(blocks, v)
  width = -(-v // blocks)
  x_sbw = jnp.pad(x_sv, ((0, 0), (0, blocks * width - v)), constant_values=-jnp.inf).reshape(s, blocks, width)
  bmax_sb = jnp.max(x_sbw, axis=-1)

  def pick(bm, _):
    i_s = jnp.argmax(bm, axis=-1)
    return bm.at[jnp.arange(s), i_s].set(-jnp.inf), i_s

  _, idx_ks = jax.lax.scan(pick, bmax_sb, None, length=min(k, blocks))
  return x_sbw, jnp.swapaxes(idx_ks, 0, 1)


def top_entries(x_sv, k: int, blocks: int = 256):
  """The k largest entries per row and their indices ([S, k] each, largest first), without lax.top_k (a full
  sort on XLA:CPU, see _top_values): candidates from the top blocks, then k argmax-and-mask passes over them."""
  s = x_sv.shape[0]
  x_sbw, idx_sb = _top_blocks(x_sv, k, blocks)
  width = x_sbw.shape[-1]
  cand_sc = jnp.take_along_axis(x_sbw, idx_sb[:, :, None], axis=1).reshape(s, -1)
  ids_sc = (idx_sb[:, :, None] * width + jnp.arange(width)[None, None, :]).reshape(s, -1).astype(jnp.int32)

  def body(c, _):
    j_s = jnp.argmax(c, axis=-1)
    val_s = jnp.take_along_axis(c, j_s[:, None], 1)[:, 0]
    return c.at[jnp.arange(s), j_s].set(-jnp.inf), (val_s, jnp.take_along_axis(ids_sc, j_s[:, None], 1)[:, 0])

  _, (val_ks, id_ks) = jax.lax.scan(body, cand_sc, None, length=k)
  return jnp.swapaxes(val_ks, 0, 1), jnp.swapaxes(id_ks, 0, 1)


def present_tokens(tokens_sl, length_s, vocab: int):
  """[S, V] bool: token v occurs in tokens[s, :length[s]]."""
  s, l = tokens_sl.shape
  idx_sl = jnp.where(jnp.arange(l)[None, :] < length_s[:, None], tokens_sl, vocab)  # vocab -> dropped
  return jnp.zeros((s, vocab), bool).at[jnp.arange(s)[:, None], idx_sl].set(True, mode="drop")


def apply_repetition_penalty(logits_sv, tokens_sl, length_s, penalty_s):
  """The logits of tokens present in the row's context divided by the penalty when positive, multiplied when
  negative (transformers' RepetitionPenaltyLogitsProcessor, vLLM's apply_penalties). penalty_s: [S] or scalar."""
  pen = jnp.broadcast_to(jnp.asarray(penalty_s, jnp.float32), logits_sv.shape[:1])[:, None]
  seen_sv = present_tokens(tokens_sl, length_s, logits_sv.shape[-1])
  return jnp.where(seen_sv, jnp.where(logits_sv < 0, logits_sv * pen, logits_sv / pen), logits_sv)


def _truncate(z_sv, params: SamplingParams):
  """Mask logits below min-p, outside the top-k and outside the top-p nucleus (the token crossing p stays in)."""
  if params.min_p > 0:
    z_sv = jnp.where(z_sv - jnp.max(z_sv, axis=-1, keepdims=True) < math.log(params.min_p), _NEG_INF, z_sv)
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


def _truncate_rows(z_sv, top_k_s, top_p_s, min_p_s):
  """`_truncate` with per-row settings (one descending sort serves top-k and top-p)."""
  v = z_sv.shape[-1]
  log_min_p = jnp.log(jnp.maximum(min_p_s, 1e-38))[:, None]
  z_sv = jnp.where((min_p_s > 0)[:, None] & (z_sv - jnp.max(z_sv, axis=-1, keepdims=True) < log_min_p), _NEG_INF, z_sv)
  sorted_sv = jnp.sort(z_sv, axis=-1)[:, ::-1]
  k_s = jnp.where((top_k_s > 0) & (top_k_s < v), top_k_s, v)
  kth_s = jnp.take_along_axis(sorted_sv, (k_s - 1)[:, None], axis=1)
  z_sv = jnp.where(z_sv < kth_s, _NEG_INF, z_sv)
  sorted_sv = jnp.where(sorted_sv < kth_s, _NEG_INF, sorted_sv)
  probs_sv = jax.nn.softmax(sorted_sv, axis=-1)
  mass_before_sv = jnp.cumsum(probs_sv, axis=-1) - probs_sv
  keep_sv = (mass_before_sv < top_p_s[:, None]) | (top_p_s[:, None] >= 1.0)  # 1 keeps all despite rounding
  cutoff_s = jnp.min(jnp.where(keep_sv, sorted_sv, jnp.inf), axis=-1)
  return jnp.where(z_sv < cutoff_s[:, None], _NEG_INF, z_sv)


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


def _process(logits_sv, params, tokens_sl, length_s):
  """Penalised and temperature-scaled logits z (the distribution reported), the truncated logits to draw from
  (None: draw from z) and the greedy rows ([S] bool, or a Python bool for static settings)."""
  if isinstance(params, SamplingParams):
    if params.repetition_penalty != 1.0:
      logits_sv = apply_repetition_penalty(logits_sv, tokens_sl, length_s, params.repetition_penalty)
    if params.greedy:
      return logits_sv, None, True
    z_sv = logits_sv / params.temperature
    return z_sv, _truncate(z_sv, params), False
  pen_s = params.repetition_penalty
  logits_sv = jax.lax.cond(
    jnp.any(pen_s != 1.0), lambda x: apply_repetition_penalty(x, tokens_sl, length_s, pen_s), lambda x: x, logits_sv
  )
  greedy_s = params.temperature <= 0.0
  z_sv = logits_sv / jnp.where(greedy_s, 1.0, params.temperature)[:, None]
  cut = jnp.any((params.top_k > 0) | (params.top_p < 1.0) | (params.min_p > 0.0))
  zt_sv = jax.lax.cond(cut, lambda z: _truncate_rows(z, params.top_k, params.top_p, params.min_p), lambda z: z, z_sv)
  return z_sv, zt_sv, greedy_s


def sample_step(
  logits_sv,
  rng_s2,
  params: Union[SamplingParams, SlotSampling],
  *,
  with_entropy: bool = True,
  topk: int = 0,
  tokens_sl=None,
  length_s=None,
  top_logprobs: int = 0,
) -> Sample:
  """Sample one token per row (see `Sample` for the outputs).

  params: static settings for every row, or per-row `SlotSampling`. tokens_sl [S, L] / length_s [S]: each row's
  context (`DecodeState.tokens` / `length`), needed for a static repetition penalty and for per-row settings.
  top_logprobs: also return the N most likely tokens and their log-probs.

  rng_s2 holds one raw uint32[2] key per row; each row's key is split once per step, so a row's stream does not
  depend on the other rows (a forked slot given its parent's key reproduces the parent's continuation).
  """
  logits_sv = logits_sv.astype(jnp.float32)
  penalised = (params.repetition_penalty != 1.0) if isinstance(params, SamplingParams) else True
  if penalised and tokens_sl is None:
    raise ValueError(
      "sample_step: a repetition penalty (and per-row settings) needs each row's tokens (tokens_sl and length_s)."
    )
  z_sv, zt_sv, greedy = _process(logits_sv, params, tokens_sl, length_s)
  split = jax.vmap(lambda k: jax.random.split(k, 2))(rng_s2)
  new_rng_s2, draw_s2 = split[:, 0], split[:, 1]
  if greedy is True:
    token_s = jnp.argmax(z_sv, axis=-1).astype(jnp.int32)
  elif greedy is False:
    token_s = _categorical(draw_s2, zt_sv)
  else:  # per-row settings: skip the draw when every row is greedy
    argmax_s = jnp.argmax(z_sv, axis=-1).astype(jnp.int32)
    token_s = jax.lax.cond(
      jnp.all(greedy), lambda: argmax_s, lambda: jnp.where(greedy, argmax_s, _categorical(draw_s2, zt_sv))
    )
  lse_s = jax.nn.logsumexp(z_sv, axis=-1)
  chosen_s = jnp.take_along_axis(z_sv, token_s[:, None], axis=-1)[:, 0]
  logprob_s = chosen_s - lse_s
  zeros = jnp.zeros_like(logprob_s)
  entropy_s = entropy_from_logits(z_sv, lse_s) if with_entropy else zeros
  topk_s = topk_entropy(z_sv, lse_s, logprob_s, topk) if (with_entropy and topk > 0) else zeros
  if top_logprobs > 0:
    top_val_sn, top_id_sn = top_entries(z_sv, top_logprobs)
    top_lp_sn = top_val_sn - lse_s[:, None]
  else:
    top_lp_sn, top_id_sn = jnp.zeros((z_sv.shape[0], 0), jnp.float32), jnp.zeros((z_sv.shape[0], 0), jnp.int32)
  return Sample(token_s, logprob_s, entropy_s, topk_s, new_rng_s2, top_id_sn, top_lp_sn)
