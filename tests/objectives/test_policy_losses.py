"""Policy losses: values on hand-made arrays, analytic per-token gradient weights, AEPO == PPO forward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import objectives_reference as ref
from aepo_jax import objectives as obj

# Hand-made batch (ε_l = ε_h = 0.2, c = 3) covering every clip region, with a tool-result hole in
# the middle of each row (mask 0 at column 1 / 2) and padding at the end of row 0.
#   row 0, A = +1: r = 1.1 (inside), 1.5 (upper-clipped), 0.5 (below 1-ε_l: unclipped for A>0)
#   row 1, A = −1: r = 0.9 (inside), 0.5 (lower-clipped), 2.0 (above 1+ε_h: unclipped for A<0),
#                  4.0 (dual-clipped, r > c)
RATIO = np.array([[1.1, 7.0, 1.5, 0.5, 1.0], [0.9, 0.5, 9.0, 2.0, 4.0]], np.float32)
MASK = np.array([[1, 0, 1, 1, 0], [1, 1, 0, 1, 1]], np.float32)
ADV = np.array([[1.0] * 5, [-1.0] * 5], np.float32)
OLD = np.zeros_like(RATIO)
NEW = np.log(RATIO)
N_TOKENS = MASK.sum()


def _grad_logp(fn, new=NEW, old=OLD, adv=ADV, mask=MASK, **kw):
  return np.asarray(jax.grad(lambda lp: fn(lp, old, adv, mask, **kw)[0])(jnp.asarray(new)))


def _expected_grad(weight_bt, adv=ADV, mask=MASK, n=N_TOKENS):
  # token-mean of ℓ = −A·(something with d/dlogπ = F): dL/dlogπ_t = −F_t·A_t·m_t / N.
  return -np.asarray(weight_bt, np.float32) * adv * mask / n


def _valid(values_by_valid_slot):
  out = np.zeros_like(RATIO)
  out[MASK > 0] = values_by_valid_slot
  return out


# Per-valid-token gradient weights F, listed row by row over the valid tokens:
# row 0: r=1.1, 1.5, 0.5; row 1: r=0.9, 0.5, 2.0, 4.0.
PPO_F = [1.1, 0.0, 0.5, 0.9, 0.0, 2.0, 0.0]
AEPO_F = [1.1, 1.2, 0.5, 0.9, 0.0, 2.0, 0.0]  # only A>0, r>1+ε_h changes: F = 1+ε_h
GPPO_F = [1.1, 1.2, 0.5, 0.9, 0.8, 2.0, 4.0]  # no dual clip by default; lower bound keeps 1−ε_l
CISPO_F = [1.1, 1.2, 0.8, 0.9, 0.8, 1.2, 1.2]  # clip(r) with ε = 0.2, detached: every token has one


def test_ppo_value_and_metrics_by_hand():
  loss, metrics = obj.policy_loss("ppo")(NEW, OLD, ADV, MASK)
  # per-token losses: −1.1, −1.2, −0.5 | 0.9, 0.8, 2.0, 3.0 (dual-clipped at c·|A|)
  np.testing.assert_allclose(loss, 3.9 / 7, rtol=1e-6)
  np.testing.assert_allclose(metrics["actor/pg_clipfrac_upper"], 1 / 7, rtol=1e-6)
  np.testing.assert_allclose(metrics["actor/pg_clipfrac_lower"], 1 / 7, rtol=1e-6)
  np.testing.assert_allclose(metrics["actor/pg_clipfrac"], 2 / 7, rtol=1e-6)
  np.testing.assert_allclose(metrics["actor/dual_clipfrac"], 1 / 7, rtol=1e-6)
  np.testing.assert_allclose(metrics["actor/ppo_kl"], -np.log(RATIO)[MASK > 0].mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["actor/ratio_mean"], RATIO[MASK > 0].mean(), rtol=1e-6)
  np.testing.assert_allclose(metrics["actor/ratio_max"], 4.0, rtol=1e-6)
  assert float(metrics["actor/pg_loss"]) == float(loss)


@pytest.mark.parametrize(
  "name, kw, weights",
  [
    ("ppo", {}, PPO_F),
    ("grpo", {}, PPO_F),
    ("aepo", {"entropy_advantage_coef": 0.0}, AEPO_F),
    ("aepo", {"entropy_advantage_coef": 0.0, "preserve_high_clip_grad": False}, PPO_F),
    ("gppo", {"clip_high": 0.2}, GPPO_F),
    ("gppo", {"clip_high": 0.2, "clip_c": 3.0}, GPPO_F[:-1] + [0.0]),
    # DAPO: ε_h = 0.28 leaves 1.5 clipped; c = 10 leaves r = 4 unclipped.
    ("dapo", {}, [1.1, 0.0, 0.5, 0.9, 0.0, 2.0, 4.0]),
    ("cispo", {"clip_low": 0.2, "clip_high": 0.2}, CISPO_F),
    ("reinforce", {}, [1.0] * 7),
  ],
)
def test_gradient_equals_analytic_token_weights(name, kw, weights):
  got = _grad_logp(obj.policy_loss(name), **kw)
  np.testing.assert_allclose(got, _expected_grad(_valid(weights)), rtol=1e-5, atol=1e-7)


def test_aepo_forward_equals_ppo_exactly_and_backward_differs_only_where_spec_says():
  ppo = obj.policy_loss("ppo")
  aepo = functools.partial(obj.policy_loss("aepo"), entropy_advantage_coef=0.0)
  loss_p, met_p = ppo(NEW, OLD, ADV, MASK)
  loss_a, met_a = aepo(NEW, OLD, ADV, MASK)
  assert float(loss_a) == float(loss_p)
  for k, v in met_p.items():
    assert float(met_a[k]) == float(v), k
  diff = _grad_logp(aepo) != _grad_logp(ppo)
  upper = (ADV > 0) & (RATIO > 1.2) & (MASK > 0)
  np.testing.assert_array_equal(diff, upper)


def test_gppo_and_cispo_match_official_values():
  for name, kw in [("gppo", {"clip_high": 0.28, "clip_c": None}), ("dapo", {})]:
    loss, _ = obj.policy_loss(name)(NEW, OLD, ADV, MASK)
    want, _ = ref.ppo_dual_clip(OLD, NEW, ADV, MASK, 0.2, 0.28, clip_c=kw.get("clip_c", 10.0))
    np.testing.assert_allclose(loss, want, rtol=1e-6)
  loss, _ = obj.policy_loss("cispo")(NEW, OLD, ADV, MASK, clip_low=0.2, clip_high=0.2)
  np.testing.assert_allclose(loss, ref.cispo(OLD, NEW, ADV, MASK, 0.2, 0.2), rtol=1e-6)


def _random_batch(seed, b=4, t=9, scale=0.6):
  rng = np.random.default_rng(seed)
  old = rng.normal(-2.0, 1.0, (b, t)).astype(np.float32)
  new = (old + rng.normal(0.0, scale, (b, t))).astype(np.float32)
  adv = np.repeat(rng.normal(0, 1, (b, 1)), t, axis=1).astype(np.float32)
  mask = (rng.random((b, t)) < 0.75).astype(np.float32)
  mask[:, 0] = 1.0
  entropy = rng.gamma(2.0, 0.7, (b, t)).astype(np.float32)
  return new, old, adv, mask, entropy


@pytest.mark.parametrize("mode", obj.AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_and_aepo_match_official_code(mode, seed):
  new, old, adv, mask, entropy = _random_batch(seed)
  loss, met = obj.policy_loss("ppo")(new, old, adv, mask, agg=mode)
  want, want_met = ref.ppo_dual_clip(old, new, adv, mask, 0.2, 0.2, 3.0, mode)
  np.testing.assert_allclose(loss, want, rtol=2e-5)
  np.testing.assert_allclose(met["actor/pg_clipfrac"], want_met["pg_clipfrac"], rtol=1e-6)
  np.testing.assert_allclose(met["actor/dual_clipfrac"], want_met["dual_clipfrac"], rtol=1e-6)
  np.testing.assert_allclose(met["actor/ppo_kl"], want_met["ppo_kl"], rtol=1e-5, atol=1e-7)
  # AEPO with the entropy-aware advantage on (a = 0.2), against the fork's function.
  loss, met = obj.policy_loss("aepo")(new, old, adv, mask, entropy=entropy, agg=mode)
  want, _ = ref.ppo_dual_clip(old, new, adv, mask, 0.2, 0.2, 3.0, mode, entropy, 0.2)
  np.testing.assert_allclose(loss, want, rtol=2e-5)
  valid = entropy[mask > 0]
  factor = 1 + 0.2 * (valid - valid.mean()) / valid.std(ddof=1)
  np.testing.assert_allclose(met["actor/entropy_adv_factor_mean"], factor.mean(), rtol=1e-5)
  np.testing.assert_allclose(met["actor/entropy_adv_factor_max"], factor.max(), rtol=1e-5)


def test_aepo_entropy_advantage_gradient_weights():
  """Ã = A·(1 + a·Ĥ) detached, applied before clipping: weight F(r, Ã)·Ã per token."""
  entropy = np.array([[0.5, 99.0, 1.5, 2.5, 99.0], [1.0, 2.0, 99.0, 0.2, 3.0]], np.float32)
  valid = entropy[MASK > 0]
  h_hat = (entropy - valid.mean()) / valid.std(ddof=1)
  adv_t = ADV * (1 + 0.2 * h_hat)
  aepo = obj.policy_loss("aepo")
  got = np.asarray(jax.grad(lambda lp: aepo(lp, OLD, ADV, MASK, entropy=jnp.asarray(entropy))[0])(jnp.asarray(NEW)))
  want = _expected_grad(_valid(AEPO_F), adv=adv_t)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  # The factor is detached: no gradient reaches the entropy.
  g_ent = jax.grad(lambda h: aepo(NEW, OLD, ADV, MASK, entropy=h)[0])(jnp.asarray(entropy))
  assert not np.any(np.asarray(g_ent))


def test_aepo_needs_entropy_when_the_entropy_advantage_is_on():
  with pytest.raises(ValueError, match="entropy_advantage_coef=0.2 needs the per-token"):
    obj.policy_loss("aepo")(NEW, OLD, ADV, MASK)


def test_gspo_token_gradient_weights():
  # Row 0: log-ratios +log2, −log2 → s = 1, unclipped, A>0: F = s = 1 on both tokens.
  # Row 1: s = 1.5 > 1+ε_h with A>0: clipped, F = 0. Row 2: s = 1.5 with A<0: unclipped, F = 1.5.
  new = np.log(np.array([[2.0, 0.5, 1.0], [1.5, 1.5, 1.0], [1.5, 1.5, 1.5]], np.float32))
  old = np.zeros_like(new)
  adv = np.array([[1.0] * 3, [1.0] * 3, [-2.0] * 3], np.float32)
  mask = np.array([[1, 1, 0], [1, 1, 0], [1, 1, 1]], np.float32)
  loss_fn = obj.policy_loss("gspo")
  got = np.asarray(jax.grad(lambda lp: loss_fn(lp, old, adv, mask)[0])(jnp.asarray(new)))
  lengths = mask.sum(-1, keepdims=True)
  f = np.array([[1.0] * 3, [0.0] * 3, [1.5] * 3], np.float32)
  want = -f * adv * mask / lengths / 3  # seq-mean-token-mean over 3 sequences
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  loss, met = loss_fn(new, old, adv, mask)
  np.testing.assert_allclose(loss, ref.gspo(old, new, adv, mask, 3e-4, 4e-4), rtol=1e-5)
  np.testing.assert_allclose(met["actor/pg_clipfrac_upper"], 2 / 7, rtol=1e-6)
  with pytest.raises(ValueError, match="no dual clip"):
    loss_fn(new, old, adv, mask, clip_c=3.0)


@pytest.mark.parametrize("name", obj.list_policy_losses())
def test_masked_positions_never_contribute(name):
  """Garbage (NaN log-probs, huge advantages, entropies) in holes changes nothing, gets 0 gradient."""
  new, old, adv, mask, entropy = _random_batch(3)
  hole = mask == 0
  dirty = lambda x, v: np.where(hole, v, x).astype(np.float32)  # noqa: E731
  kw = {"entropy": entropy} if name == "aepo" else {}
  dirty_kw = {"entropy": dirty(entropy, 1e6)} if name == "aepo" else {}
  fn = obj.policy_loss(name)
  clean_loss, clean_met = fn(new, old, adv, mask, **kw)
  loss_of = lambda lp, o, a, k: fn(lp, o, a, mask, **k)[0]  # noqa: E731
  dirty_new, dirty_old, dirty_adv = dirty(new, np.nan), dirty(old, -np.inf), dirty(adv, 1e9)
  dirty_loss, dirty_met = fn(dirty_new, dirty_old, dirty_adv, mask, **dirty_kw)
  np.testing.assert_array_equal(dirty_loss, clean_loss)
  for k in clean_met:
    np.testing.assert_array_equal(dirty_met[k], clean_met[k], err_msg=k)
  g_clean = jax.grad(loss_of)(jnp.asarray(new), old, adv, kw)
  g_dirty = jax.grad(loss_of)(jnp.asarray(dirty_new), dirty_old, dirty_adv, dirty_kw)
  np.testing.assert_array_equal(g_dirty, g_clean)
  assert np.all(np.asarray(g_dirty)[hole] == 0)


@settings(max_examples=40, deadline=None)
@given(
  seed=st.integers(0, 2**31 - 1),
  scale=st.floats(0.01, 2.0),
  clip=st.sampled_from([(0.2, 0.2, 3.0), (0.2, 0.28, None), (0.1, 0.3, 1.5)]),
)
def test_property_aepo_with_both_features_off_is_ppo(seed, scale, clip):
  new, old, adv, mask, entropy = _random_batch(seed, scale=scale)
  clip_low, clip_high, clip_c = clip
  hp = dict(clip_low=clip_low, clip_high=clip_high, clip_c=clip_c)
  ppo = lambda lp: obj.policy_loss("ppo")(lp, old, adv, mask, **hp)  # noqa: E731
  aepo = lambda lp: obj.policy_loss("aepo")(  # noqa: E731
    lp, old, adv, mask, entropy=entropy, entropy_advantage_coef=0.0, preserve_high_clip_grad=False, **hp
  )
  (lp_, mp), gp = jax.value_and_grad(ppo, has_aux=True)(jnp.asarray(new))
  (la, ma), ga = jax.value_and_grad(aepo, has_aux=True)(jnp.asarray(new))
  assert float(la) == float(lp_)
  np.testing.assert_array_equal(ga, gp)
  for k in mp:
    assert float(ma[k]) == float(mp[k]), k
  # With the stop-gradient bound on, the value is still PPO's exactly.
  la2, _ = obj.policy_loss("aepo")(new, old, adv, mask, entropy_advantage_coef=0.0, **hp)
  assert float(la2) == float(lp_)


@pytest.mark.parametrize(
  "bad, match",
  [
    (dict(clip_low=1.5), "clip_low=1.5"),
    (dict(clip_high=-0.1), "clip_high=-0.1"),
    (dict(clip_c=0.5), "clip_c=0.5"),
    (dict(agg="token-sum"), "unknown aggregation mode"),
  ],
)
def test_bad_hyperparameters_are_named(bad, match):
  with pytest.raises(ValueError, match=match):
    obj.policy_loss("ppo")(NEW, OLD, ADV, MASK, **bad)


def test_shape_mismatch_is_named():
  with pytest.raises(ValueError, match="advantages"):
    obj.policy_loss("ppo")(NEW, OLD, ADV[:, :1], MASK)
