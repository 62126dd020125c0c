"""Registries, and every loss under jit, vmap and repeated calls."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aepo_jax import objectives as obj
from aepo_jax.objectives._registry import POLICY_LOSSES


def test_registered_names():
  assert obj.list_policy_losses() == sorted(
    ["ppo", "grpo", "arpo", "dapo", "gspo", "gppo", "cispo", "aepo", "reinforce"]
  )
  assert obj.list_advantages() == ["grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo"]
  assert {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"} == set(obj.list_kl_estimators())
  assert obj.policy_loss("grpo") is obj.policy_loss("ppo") is obj.policy_loss("arpo")


def test_defaults_are_the_spec_values():
  assert obj.policy_loss_defaults("ppo") == dict(
    clip_low=0.2, clip_high=0.2, clip_c=3.0, agg="token-mean", normalizer=None
  )
  d = obj.policy_loss_defaults("aepo")
  assert (d["entropy_advantage_coef"], d["preserve_high_clip_grad"], d["clip_c"]) == (0.2, True, 3.0)
  assert obj.policy_loss_defaults("dapo")["clip_high"] == 0.28
  g = obj.policy_loss_defaults("gspo")
  assert (g["clip_low"], g["clip_high"], g["agg"]) == (3e-4, 4e-4, "seq-mean-token-mean")
  assert obj.advantage_defaults("grpo") == dict(epsilon=1e-6, norm_by_std=True)


def test_unknown_names_list_the_known_ones():
  with pytest.raises(ValueError, match="unknown policy loss 'sppo'; known: aepo, arpo"):
    obj.policy_loss("sppo")
  with pytest.raises(ValueError, match="unknown advantage estimator 'gae'.*grpo"):
    obj.advantage("gae")
  with pytest.raises(ValueError, match="unknown KL estimator 'full'"):
    obj.kl("full")


def test_register_new_loss_and_refuse_name_clash():
  @obj.register_policy_loss("test_only_half_ppo")
  def half(log_prob, old_log_prob, advantages, mask, entropy=None, **hp):
    loss, metrics = obj.policy_loss("ppo")(log_prob, old_log_prob, advantages, mask, **hp)
    return 0.5 * loss, metrics

  try:
    assert obj.policy_loss("test_only_half_ppo") is half
    new, old, adv, mask, _ = _batch(6)
    np.testing.assert_allclose(
      half(new, old, adv, mask)[0], 0.5 * obj.policy_loss("ppo")(new, old, adv, mask)[0], rtol=1e-6
    )
    with pytest.raises(ValueError, match="already registered"):
      obj.register_policy_loss("ppo")(half)
  finally:  # keep the global registry as the other tests expect it
    POLICY_LOSSES._fns.pop("test_only_half_ppo", None)


def _batch(seed, b=4, t=8):
  rng = np.random.default_rng(seed)
  old = rng.normal(-2, 1, (b, t)).astype(np.float32)
  new = (old + rng.normal(0, 0.4, (b, t))).astype(np.float32)
  adv = np.repeat(rng.normal(size=(b, 1)), t, 1).astype(np.float32)
  mask = (rng.random((b, t)) < 0.8).astype(np.float32)
  mask[:, 0] = 1
  ent = rng.gamma(2, 0.5, (b, t)).astype(np.float32)
  return new, old, adv, mask, ent


CANONICAL = ["ppo", "dapo", "gspo", "gppo", "cispo", "aepo", "reinforce"]


@pytest.mark.parametrize("name", CANONICAL)
def test_jit_vmap_and_determinism(name):
  fn = functools.partial(obj.policy_loss(name), agg="token-mean")
  step = jax.jit(jax.value_and_grad(lambda lp, o, a, m, e: fn(lp, o, a, m, entropy=e)[0]))
  new, old, adv, mask, ent = _batch(0)
  (l1, g1), (l2, g2) = step(new, old, adv, mask, ent), step(new, old, adv, mask, ent)
  assert float(l1) == float(l2)
  np.testing.assert_array_equal(g1, g2)
  eager = fn(new, old, adv, mask, entropy=ent)[0]
  np.testing.assert_allclose(l1, eager, rtol=1e-6)
  # vmap over a leading micro-batch axis equals a Python loop over it.
  stacked = [np.stack(x) for x in zip(_batch(1), _batch(2), _batch(3))]
  losses, metrics = jax.vmap(lambda *xs: fn(*xs[:4], entropy=xs[4]))(*stacked)
  assert metrics["actor/ppo_kl"].shape == (3,)
  for i in range(3):
    want = fn(*[x[i] for x in stacked[:4]], entropy=stacked[4][i])[0]
    np.testing.assert_allclose(losses[i], want, rtol=1e-5)


@pytest.mark.parametrize("name", CANONICAL)
def test_metrics_are_finite_scalars_with_prefix(name):
  new, old, adv, mask, ent = _batch(4)
  loss, metrics = obj.policy_loss(name)(new, old, adv, mask, entropy=ent)
  assert jnp.shape(loss) == ()
  for key in (
    "actor/pg_clipfrac_upper",
    "actor/pg_clipfrac_lower",
    "actor/dual_clipfrac",
    "actor/ppo_kl",
    "actor/ratio_mean",
    "actor/pg_loss",
  ):
    assert key in metrics, key
  for k, v in metrics.items():
    assert k.startswith("actor/") and jnp.shape(v) == () and np.isfinite(float(v)), k


def test_all_masked_batch_gives_zero_loss_and_gradient():
  new, old, adv, mask, ent = _batch(5)
  mask = np.zeros_like(mask)
  for name in CANONICAL:
    fn = obj.policy_loss(name)
    loss, metrics = fn(new, old, adv, mask, entropy=ent)
    g = jax.grad(lambda lp: fn(lp, old, adv, mask, entropy=ent)[0])(new)
    assert float(loss) == 0.0 and not np.any(np.asarray(g)), name
    assert all(np.isfinite(float(v)) for v in metrics.values()), name
