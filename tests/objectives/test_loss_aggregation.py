"""Aggregation modes against verl's agg_loss, and exact gradient accumulation over micro-batches."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import objectives_reference as ref
from aepo_jax import objectives as obj


def _batch(seed=0, b=6, t=7):
  rng = np.random.default_rng(seed)
  loss = rng.normal(size=(b, t)).astype(np.float32)
  mask = (rng.random((b, t)) < 0.7).astype(np.float32)
  mask[:, 0] = 1
  return loss, mask


@pytest.mark.parametrize("mode", obj.AGG_MODES)
def test_modes_match_verl_agg_loss(mode):
  loss, mask = _batch()
  np.testing.assert_allclose(obj.aggregate(loss, mask, mode), ref.agg_loss(loss, mask, mode), rtol=1e-6)


def test_mode_definitions_by_hand():
  loss = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)
  mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
  np.testing.assert_allclose(obj.aggregate(loss, mask, "token-mean"), 7 / 3, rtol=1e-6)
  np.testing.assert_allclose(obj.aggregate(loss, mask, "seq-mean-token-sum"), (3 + 4) / 2)
  np.testing.assert_allclose(obj.aggregate(loss, mask, "seq-mean-token-mean"), (1.5 + 4) / 2)
  np.testing.assert_allclose(obj.aggregate(loss, mask, "seq-mean-token-sum-norm"), 7 / 3, rtol=1e-6)


def test_all_padding_rows_change_nothing():
  loss, mask = _batch()
  pad_loss = np.concatenate([loss, np.full((2, loss.shape[1]), np.nan, np.float32)])
  pad_mask = np.concatenate([mask, np.zeros((2, mask.shape[1]), np.float32)])
  for mode in obj.AGG_MODES:
    # The same terms summed in another order (other shape): 4 sqrt(n) ulps of the sum of |terms| (|loss| aggregated
    # the same way), not a relative bound on a result that may cancel. Measured: 6e-8; this allows ~2e-6.
    tol = 4 * np.finfo(np.float32).eps * np.sqrt(mask.size) * float(obj.aggregate(np.abs(loss), mask, mode))
    np.testing.assert_allclose(
      obj.aggregate(pad_loss, pad_mask, mode), obj.aggregate(loss, mask, mode), rtol=0, atol=tol, err_msg=mode
    )


# A tiny "policy": logits = hidden @ W.T, so the accumulated gradient is the one a trainer would apply
# to its parameters. (Dense logits keep compiles fast; test_logits covers the chunked helper.)
B, T, D, V = 8, 6, 5, 11


def _logp_entropy(hidden, w_vd, targets):
  logits = jnp.einsum("btd,vd->btv", hidden, w_vd)
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
  return logp, obj.entropy_from_logits(logits)


def _setup(seed=0):
  rng = np.random.default_rng(seed)
  w_vd = jnp.asarray(rng.normal(0, 0.5, (V, D)), jnp.float32)
  hidden = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, V, (B, T)))
  old = _logp_entropy(hidden, w_vd * 0.9, targets)[0]
  adv = jnp.asarray(np.repeat(rng.normal(size=(B, 1)), T, 1), jnp.float32)
  # Very different token counts per sequence, with holes.
  lengths = np.array([1, 6, 2, 5, 3, 6, 4, 2])
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
  mask[1, 2] = mask[3, 1] = 0
  return w_vd, hidden, targets, old, adv, jnp.asarray(mask)


def _loss(w_vd, hidden, targets, old, adv, mask, *, name, mode, normalizer=None, **hp):
  logp, ent = _logp_entropy(hidden, w_vd, targets)
  kw = {"entropy": ent} if name == "aepo" else {}
  return obj.policy_loss(name)(logp, old, adv, mask, agg=mode, normalizer=normalizer, **kw, **hp)[0]


@pytest.mark.parametrize(
  "name, mode",
  [("aepo", mode) for mode in obj.AGG_MODES]
  + [("ppo", "token-mean"), ("gspo", "seq-mean-token-mean"), ("cispo", "token-mean")],
)
def test_micro_batch_accumulation_reproduces_full_batch_gradient(name, mode):
  w, hidden, targets, old, adv, mask = _setup()
  hp = {}
  if name == "aepo":  # entropy statistics taken once over the whole mini-batch
    _, ent = _logp_entropy(hidden, w, targets)
    hp = dict(zip(("entropy_mean", "entropy_std"), obj.entropy_stats(ent, mask)))
  full = jax.jit(jax.grad(functools.partial(_loss, name=name, mode=mode, **hp)))(w, hidden, targets, old, adv, mask)
  normalizer = obj.loss_normalizer(mask, mode)
  micro_grad = jax.jit(jax.grad(functools.partial(_loss, name=name, mode=mode, **hp)))
  acc = jnp.zeros_like(w)
  for sl in (slice(0, 4), slice(4, 6), slice(6, 8)):  # uneven token counts, two shapes
    acc += micro_grad(w, hidden[sl], targets[sl], old[sl], adv[sl], mask[sl], normalizer=normalizer)
  np.testing.assert_allclose(acc, full, rtol=2e-5, atol=1e-7)


def test_verl_dynamic_bsz_weighting_is_a_sequence_weighted_mean_of_micro_token_means():
  """Spec §1.5: Σ_k token-mean_k · n_k/N; differs from the global token-mean when counts differ."""
  w, hidden, targets, old, adv, mask = _setup()
  loss = jax.jit(functools.partial(_loss, name="ppo", mode="token-mean"))
  micro = (slice(0, 4), slice(4, 8))
  n_total = obj.num_sequences(mask)
  verl = sum(
    loss(w, hidden[s], targets[s], old[s], adv[s], mask[s]) * obj.dynamic_bsz_scale(mask[s], n_total) for s in micro
  )
  logp, _ = _logp_entropy(hidden, w, targets)
  per_token, _ = obj.clipped_token_loss(jnp.exp(logp - old), adv, mask, clip_low=0.2, clip_high=0.2, clip_c=3.0)
  want = sum(obj.masked_mean(per_token[s], mask[s]) * mask[s].shape[0] / B for s in micro)
  np.testing.assert_allclose(verl, want, rtol=1e-5)
  assert abs(float(verl) - float(loss(w, hidden, targets, old, adv, mask))) > 1e-4


def test_normalizer_rejects_unknown_mode():
  with pytest.raises(ValueError, match="agg='token-sum'"):
    obj.loss_normalizer(np.ones((2, 2)), "token-sum")
