"""Shared pieces of the update-step tests: a tiny model, a reproducible RL batch and a reference loss
computed the plain way (full [B, T, V] logits, log_softmax, one big batch)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from aepo_jax import objectives
from aepo_jax.model import forward, init_params
from aepo_jax.testing import tiny_model_config
from aepo_jax.train._batch import micro_batches

# Dims divide every mesh axis used in the tests (fsdp up to 8, tensor 2).
CFG = tiny_model_config(vocab_size=128, tie_word_embeddings=True, rope_theta=10000.0)
M, MB, T = 4, 2, 16
TEMPERATURE = 0.7


def sgd():
  """lr 1: new params = params − grads, so parameter differences are gradient differences."""
  return optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)


@functools.lru_cache(maxsize=None)
def host_params(seed=0, config=CFG):
  return jax.tree.map(np.asarray, init_params(config, jax.random.PRNGKey(seed)))


def rl_arrays(seed=0, n=M * MB, t=T, vocab=CFG.vocab_size):
  """[N, T] RL arrays with uneven prompt and response lengths (so micro-batches hold different token
  counts) and old log-probs near the current policy's (ratios near 1, some clipped)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, vocab, (n, t)).astype(np.int32)
  attn = np.zeros((n, t), np.int32)
  loss_mask = np.zeros((n, t), np.int32)
  for i in range(n):
    prompt = int(rng.integers(2, 5))
    total = int(rng.integers(prompt + 2, t + 1))
    attn[i, :total] = 1
    loss_mask[i, prompt:total] = 1
    if total > prompt + 4:  # a tool result inside the response: attended, not trained
      loss_mask[i, prompt + 2 : prompt + 4] = 0
    tokens[i, total:] = 0
  adv = np.repeat(rng.normal(size=(n, 1)), t, axis=1).astype(np.float32) * loss_mask
  ref_lp = np.asarray(reference_logprobs(host_params(), tokens, attn))
  old_lp = (ref_lp + 0.3 * rng.normal(size=(n, t))).astype(np.float32) * loss_mask
  return {"tokens": tokens, "attention_mask": attn, "loss_mask": loss_mask, "advantages": adv, "old_log_prob": old_lp}


def rl_batch(micro, seed=0, n=M * MB):
  arrays = rl_arrays(seed, n=n)
  return micro_batches(arrays, micro_batch_size=arrays["tokens"].shape[0] // micro, pad_id=0, seq_len=T)


@functools.partial(jax.jit, static_argnames=("temperature", "config"))
def reference_logprobs(params, tokens_bt, attn_bt, temperature=TEMPERATURE, config=CFG):
  """Token-aligned log π(token t | < t) from the full logits (column 0 is 0)."""
  logits_btv = forward(config, params, tokens_bt, None, attn_bt) / temperature
  logp_btv = jax.nn.log_softmax(logits_btv, axis=-1)
  lp = jnp.take_along_axis(logp_btv[:, :-1], tokens_bt[:, 1:, None], axis=-1)[..., 0]
  return jnp.concatenate([jnp.zeros_like(lp[:, :1]), lp], axis=1)


def reference_entropy(params, tokens_bt, attn_bt, temperature=TEMPERATURE, config=CFG):
  logits_btv = forward(config, params, tokens_bt, None, attn_bt) / temperature
  ent = objectives.entropy_from_logits(logits_btv[:, :-1])
  return jnp.concatenate([jnp.zeros_like(ent[:, :1]), ent], axis=1)


@functools.partial(jax.jit, static_argnames=("loss", "weights", "kl_coef", "config"))
def reference_grads(params, arrays, loss="ppo", weights=None, kl_coef=0.0, config=CFG):
  """Gradient of the loss over the whole batch in one piece. `weights`: a tuple of row-slices defining
  micro-batches for verl's sequence-weighted per-micro-batch token-mean. kl_coef: add
  kl_coef · token-mean(low_var_kl(log_prob, ref_log_prob))."""

  def total(p):
    lp = reference_logprobs(p, arrays["tokens"], arrays["attention_mask"], config=config)
    kw = {}
    if loss == "aepo":
      kw["entropy"] = jax.lax.stop_gradient(reference_entropy(p, arrays["tokens"], arrays["attention_mask"]))[:, 1:]
    fn = objectives.policy_loss(loss)
    args = (lp[:, 1:], arrays["old_log_prob"][:, 1:], arrays["advantages"][:, 1:], arrays["loss_mask"][:, 1:])
    if weights is None:
      out = fn(*args, **kw)[0]
      if kl_coef:
        out = out + kl_coef * objectives.kl_loss(
          lp[:, 1:], arrays["ref_log_prob"][:, 1:], args[3], estimator="low_var_kl"
        )
      return out
    mask = arrays["loss_mask"][:, 1:]
    n_seq = objectives.num_sequences(mask)
    out = 0.0
    for lo, hi in weights:
      part = [a[lo:hi] for a in args]
      out = out + fn(*part)[0] * objectives.num_sequences(mask[lo:hi]) / n_seq
    return out

  return jax.grad(total)(params)


def max_abs_diff(a, b):
  return max(
    float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


def float32_spread(arrays, loss="ppo", seeds=3, config=CFG):
  """How far float32 rounding alone moves the reference gradient: the largest change of `reference_grads` when
  every parameter is moved by one ulp (relative eps, random sign), over a few draws. Two float32 evaluations of the
  same gradient that differ only in summation order (chunked vs full logits, fused vs not) differ by about this
  much; tolerances are a small multiple of it, so they scale with the computation's own conditioning (AEPO's
  entropy standardisation amplifies rounding ~100x over plain PPO) instead of one machine's observed error."""
  ref = reference_grads(host_params(config=config), arrays, loss, config=config)
  eps = np.float32(np.finfo(np.float32).eps)
  spread = 0.0
  for seed in range(seeds):
    rng = np.random.default_rng(1000 + seed)
    moved = jax.tree.map(lambda x: (x * (1 + eps * rng.choice([-1, 1], x.shape))).astype(x.dtype), host_params())
    spread = max(spread, max_abs_diff(reference_grads(moved, arrays, loss, config=config), ref))
  scale = max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(ref))
  return max(spread, float(eps) * scale)  # never below one ulp of the largest gradient entry
