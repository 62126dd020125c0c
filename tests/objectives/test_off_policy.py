"""Off-policy corrections (decoupled PPO, truncated IS) on hand-computed weights, as the identity when behaviour and
proximal log-probs agree, and as a per-token weight on every registered loss's gradient."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aepo_jax import objectives as obj

LOSSES = ("ppo", "dapo", "gppo", "aepo", "cispo", "reinforce", "gspo")


def _tokens():
  """4 tokens with π_prox / π_behav = 1, 2, 10, 1/4 (and one masked token with an absurd ratio)."""
  prox = jnp.asarray([[0.0, math.log(2.0), math.log(10.0), -math.log(4.0), 50.0]], jnp.float32) - 1.0
  behav = jnp.full_like(prox, -1.0)
  mask = jnp.asarray([[1, 1, 1, 1, 0]], jnp.float32)
  return prox, behav, mask


def test_decoupled_drops_tokens_over_the_cap_and_weights_the_rest():
  prox, behav, mask = _tokens()
  w, keep, m = obj.off_policy("decoupled")(prox, behav, mask, cap=5.0)
  np.testing.assert_allclose(w[0, :4], [1.0, 2.0, 0.0, 0.25], rtol=1e-6)
  np.testing.assert_array_equal(keep[0], [1, 1, 0, 1, 0])  # the 10x token leaves the loss (AReaL's filter)
  kept = np.array([1.0, 2.0, 0.25])
  assert m["offpolicy/ess"] == pytest.approx(kept.sum() ** 2 / (3 * (kept**2).sum()), rel=1e-6)
  assert m["offpolicy/capped_frac"] == pytest.approx(0.25)
  assert m["offpolicy/weight_max"] == pytest.approx(2.0)


def test_tis_truncates_and_keeps_every_token():
  prox, behav, mask = _tokens()
  w, keep, m = obj.off_policy("tis")(prox, behav, mask, cap=2.0)
  np.testing.assert_allclose(w[0, :4], [1.0, 2.0, 2.0, 0.25], rtol=1e-6)
  np.testing.assert_array_equal(keep[0], [1, 1, 1, 1, 0])
  w4 = np.array([1.0, 2.0, 2.0, 0.25])
  assert m["offpolicy/ess"] == pytest.approx(w4.sum() ** 2 / (4 * (w4**2).sum()), rel=1e-6)  # 0.7603
  assert m["offpolicy/capped_frac"] == pytest.approx(0.25)
  assert np.isfinite(np.asarray(w)).all()  # the masked 50-nat log-ratio never overflows


def test_caps_that_make_no_sense_are_refused():
  with pytest.raises(ValueError, match="cap=0.5 must be >= 1"):
    obj.apply_off_policy(obj.policy_loss("ppo"), "tis", cap=0.5)
  with pytest.raises(ValueError, match="must be > 1 or None"):
    obj.apply_off_policy(obj.policy_loss("ppo"), "decoupled", cap=1.0)
  with pytest.raises(ValueError, match="unknown off-policy correction 'vtrace'"):
    obj.apply_off_policy(obj.policy_loss("ppo"), "vtrace")
  assert obj.list_off_policy() == ["decoupled", "none", "tis"]


def _batch(seed=0, b=3, t=6):
  rng = np.random.default_rng(seed)
  old = jnp.asarray(rng.normal(-1.5, 0.5, (b, t)), jnp.float32)
  logp = old + jnp.asarray(rng.normal(0, 0.3, (b, t)), jnp.float32)  # ratios around 1, some clipped
  adv = jnp.asarray(np.repeat(rng.normal(size=(b, 1)), t, 1), jnp.float32)
  mask = jnp.asarray(rng.random((b, t)) < 0.8, jnp.float32)
  ent = jnp.asarray(rng.gamma(2.0, 0.5, (b, t)), jnp.float32)
  behav = old + jnp.asarray(rng.normal(0, 0.4, (b, t)), jnp.float32)
  return logp, old, adv, mask, ent, behav


def _call(fn, logp, old, adv, mask, ent, **kw):
  return fn(logp, old, adv, mask, entropy=ent, agg="token-mean", normalizer=1.0, **kw)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("name,hp", [("decoupled", {"cap": 5.0}), ("tis", {"cap": 2.0})])
def test_identity_when_behaviour_equals_proximal(loss, name, hp):
  """max_staleness 0 with identical numerics: every weight 1, the loss and its gradient bit for bit."""
  logp, old, adv, mask, ent, _ = _batch()
  base = obj.policy_loss(loss)
  corrected = obj.apply_off_policy(base, name, **hp)
  ref, ref_grad = jax.value_and_grad(lambda lp: _call(base, lp, old, adv, mask, ent)[0])(logp)
  val, grad = jax.value_and_grad(lambda lp: _call(corrected, lp, old, adv, mask, ent, behaviour_log_prob=old)[0])(logp)
  assert float(val) == float(ref)
  np.testing.assert_array_equal(np.asarray(grad), np.asarray(ref_grad))


@pytest.mark.parametrize("loss", [x for x in LOSSES if x != "gspo"])
@pytest.mark.parametrize("name,hp", [("decoupled", {"cap": 1.5}), ("tis", {"cap": 1.2})])
def test_each_tokens_gradient_is_weighted_by_its_importance_weight(loss, name, hp):
  """For token-separable losses (each token's term depends on its own log-prob only), the corrected gradient at
  token t is w_t times the uncorrected one (0 for a dropped token), whatever the clip region the token is in.
  GSPO's sequence-level ratio couples a sequence's tokens, so it is checked only for the identity above."""
  logp, old, adv, mask, ent, behav = _batch(1)
  base = obj.policy_loss(loss)
  corrected = obj.apply_off_policy(base, name, **hp)
  w, keep, _ = obj.off_policy(name)(old, behav, mask, **hp)
  dropped = float(jnp.sum(mask - keep))
  if loss == "aepo":  # its entropy statistics are over the kept tokens: give both the same mask
    mask = keep
  ref_grad = jax.grad(lambda lp: _call(base, lp, old, adv, mask, ent)[0])(logp)
  grad = jax.grad(lambda lp: _call(corrected, lp, old, adv, mask, ent, behaviour_log_prob=behav)[0])(logp)
  expected = np.asarray(ref_grad) * np.asarray(w) * np.asarray(keep)
  np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-7)
  assert np.abs(expected).max() > 1e-3 and float(jnp.sum(keep)) > 0
  if name == "decoupled":
    assert dropped > 0  # some tokens really were dropped at this cap
