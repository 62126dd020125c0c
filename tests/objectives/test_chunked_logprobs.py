"""Chunked log-prob/entropy against a dense reference; gradients flow through the chunks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aepo_jax import objectives as obj

B, T, D, V = 3, 7, 16, 97
EPS32 = float(np.finfo(np.float32).eps)


def _tol(logits):
  """Float32 error bound of a log-prob or entropy over V logits: V-term sums whose terms reach max|logit|, each
  rounding ~1 ulp of it (random walk: sqrt(V) ulps), x4. Measured: ~3 ulps of max|logit|; this allows ~40."""
  return 4 * EPS32 * np.sqrt(V) * float(np.abs(np.asarray(logits, np.float64)).max())


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  emb = jnp.asarray(rng.normal(0, 0.4, (V, D)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, V, (B, T)))
  return hidden, emb, targets


def _dense(hidden, emb, targets, temperature=1.0):
  logits = jnp.einsum("btd,vd->btv", hidden, emb) / temperature
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
  p = jax.nn.softmax(logits)
  entropy = -jnp.sum(p * jax.nn.log_softmax(logits), -1)  # textbook −Σ p log p
  return logp, entropy


def test_entropy_from_logits_matches_definition():
  logits = np.random.default_rng(1).normal(0, 3, (4, 5, V)).astype(np.float32)
  z = logits.astype(np.float64)  # the definition in float64: the only float32 error left is the implementation's
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  np.testing.assert_allclose(obj.entropy_from_logits(logits), -(p * np.log(p)).sum(-1), rtol=0, atol=_tol(logits))
  np.testing.assert_allclose(obj.entropy_from_logits(np.zeros((1, V))), [np.log(V)], rtol=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_matches_dense(chunk_size, temperature):
  hidden, emb, targets = _inputs()
  logp, ent = obj.token_logprobs_and_entropy(hidden, emb, targets, temperature, chunk_size)
  want_logp, want_ent = _dense(hidden, emb, targets, temperature)
  tol = _tol(jnp.einsum("btd,vd->btv", hidden, emb) / temperature)  # ~4e-5 at temperature 0.6; measured 4.1e-6
  np.testing.assert_allclose(logp, want_logp, rtol=0, atol=tol)
  np.testing.assert_allclose(ent, want_ent, rtol=0, atol=tol)


def test_callable_unembed_equals_matrix():
  hidden, emb, targets = _inputs(2)
  a = obj.token_logprobs_and_entropy(hidden, emb, targets, chunk_size=2)
  b = obj.token_logprobs_and_entropy(hidden, lambda h: h @ emb.T, targets, chunk_size=2)
  tol = _tol(hidden @ emb.T)  # two matmul code paths round differently: ~3e-5; measured 2.1e-6
  np.testing.assert_allclose(a[0], b[0], rtol=0, atol=tol)
  np.testing.assert_allclose(a[1], b[1], rtol=0, atol=tol)


# The three ways to give the unembedding: [V, D] matrix, [D, V] kernel (both the custom-VJP path), a function
# (JAX's autodiff through the checkpointed chunk).
_HEADS = {
  "vd": lambda h, e, *a, **k: obj.token_logprobs_and_entropy(h, e, *a, **k),
  "dv": lambda h, e, *a, **k: obj.token_logprobs_and_entropy(h, e.T, *a, layout="dv", **k),
  "fn": lambda h, e, *a, **k: obj.token_logprobs_and_entropy(h, lambda x: x @ e.T, *a, **k),
  "vd_saved": lambda h, e, *a, **k: obj.token_logprobs_and_entropy(h, e, *a, max_saved_logits=B * T * V, **k),
  "dv_saved": lambda h, e, *a, **k: obj.token_logprobs_and_entropy(
    h, e.T, *a, layout="dv", max_saved_logits=B * T * V, **k
  ),
}


@pytest.mark.parametrize("head", sorted(_HEADS))
def test_gradients_match_dense(head):
  hidden, emb, targets = _inputs(3)
  w_logp = jnp.asarray(np.random.default_rng(4).normal(size=(B, T)), jnp.float32)
  w_ent = jnp.asarray(np.random.default_rng(5).normal(size=(B, T)), jnp.float32)

  def objective(fn):
    def f(h, e):
      logp, ent = fn(h, e)
      return jnp.sum(logp * w_logp) + jnp.sum(ent * w_ent)

    return f

  chunked = jax.jit(jax.grad(objective(lambda h, e: _HEADS[head](h, e, targets, 0.8, chunk_size=3)), argnums=(0, 1)))
  dense = jax.grad(objective(lambda h, e: _dense(h, e, targets, 0.8)), argnums=(0, 1))
  for got, want in zip(chunked(hidden, emb), dense(hidden, emb)):
    assert np.any(np.asarray(got) != 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_only_selected_positions_match_dense_values_and_gradients():
  """where_bt + capacity: values and gradients at the selected positions equal the dense ones, the other positions
  are 0; when more positions are selected than the capacity, the dense path gives every position."""
  hidden, emb, targets = _inputs(6)
  where = jnp.asarray(np.random.default_rng(7).random((B, T)) < 0.4)
  n = int(where.sum())
  assert 0 < n < B * T
  w = jnp.asarray(np.random.default_rng(8).normal(size=(B, T)), jnp.float32) * where

  def loss(h, e, capacity):
    logp, ent = obj.token_logprobs_and_entropy(h, e, targets, 0.8, chunk_size=4, where_bt=where, capacity=capacity)
    return jnp.sum(logp * w) + jnp.sum(ent * w), (logp, ent)

  want_logp, want_ent = _dense(hidden, emb, targets, 0.8)
  want_grads = jax.grad(
    lambda h, e: jnp.sum((lambda r: r[0] * w + r[1] * w)(_dense(h, e, targets, 0.8))), argnums=(0, 1)
  )(hidden, emb)
  for capacity in (n, n + 5):
    (_, (logp, ent)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)(
      hidden, emb, capacity
    )
    np.testing.assert_allclose(logp, jnp.where(where, want_logp, 0.0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, jnp.where(where, want_ent, 0.0), rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, want_grads):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  _, (logp, ent) = jax.jit(loss, static_argnums=2)(hidden, emb, n - 1)  # over capacity: dense path
  np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, want_ent, rtol=1e-5, atol=1e-5)


def test_saved_logits_skip_the_recompute():
  """With max_saved_logits >= B·T·V the backward has one LM-head matmul fewer (the logits come from the forward);
  one float fewer and it recomputes them."""
  hidden, emb, targets = _inputs()

  def dots(saved):
    f = jax.jit(
      jax.grad(
        lambda e: jnp.sum(obj.token_logprobs_and_entropy(hidden, e, targets, chunk_size=3, max_saved_logits=saved)[0])
      )
    )
    return f.lower(emb).as_text().count("dot_general")

  assert dots(B * T * V) == dots(B * T * V - 1) - 1


def test_peak_logits_are_one_chunk():
  """No [B, T, V] array appears in the compiled forward/backward: only [B, chunk, V]."""
  t, v, c = 64, 4099, 8
  hidden = jnp.zeros((1, t, 8))
  emb = jnp.zeros((v, 8))
  targets = jnp.zeros((1, t), jnp.int32)
  f = jax.jit(jax.grad(lambda e: jnp.sum(sum(obj.token_logprobs_and_entropy(hidden, e, targets, chunk_size=c)))))
  hlo = f.lower(emb).compile().as_text()
  assert f"[1,{t},{v}]" not in hlo and f"[{t},{v}]" not in hlo
  assert f"[1,{c},{v}]" in hlo or f"[{c},{v}]" in hlo


def test_bad_inputs_are_named():
  hidden, emb, targets = _inputs()
  with pytest.raises(ValueError, match=r"\[V, D=16\]"):
    obj.token_logprobs_and_entropy(hidden, emb.T, targets)
  with pytest.raises(ValueError, match=r"\[D=16, V\].*layout='dv'"):
    obj.token_logprobs_and_entropy(hidden, emb, targets, layout="dv")
  with pytest.raises(ValueError, match="layout='kv'"):
    obj.token_logprobs_and_entropy(hidden, emb, targets, layout="kv")
  with pytest.raises(ValueError, match="targets_bt"):
    obj.token_logprobs_and_entropy(hidden, emb, targets[:, :3])
  with pytest.raises(ValueError, match="temperature"):
    obj.token_logprobs_and_entropy(hidden, emb, targets, temperature=0.0)
