"""KL estimators against verl's kl_penalty; DAPO's group filter and overlong shaping."""

import jax
import numpy as np
import pytest

import objectives_reference as ref
from aepo_jax import objectives as obj


@pytest.mark.parametrize("name", obj.list_kl_estimators())
def test_kl_estimators_match_verl(name):
  rng = np.random.default_rng(0)
  logp = rng.normal(-2, 1.5, (3, 8)).astype(np.float32)
  ref_logp = (logp + rng.normal(0, 2.0, (3, 8))).astype(np.float32)
  ref_logp[0, 0] = logp[0, 0] + 30.0  # exercises the ±20 / ±10 clamps of low_var_kl
  np.testing.assert_allclose(obj.kl(name)(logp, ref_logp), ref.kl_penalty(logp, ref_logp, name), rtol=1e-5, atol=1e-6)


def test_k3_is_nonnegative_and_zero_at_equality():
  x = np.linspace(-5, 5, 11, dtype=np.float32)[None]
  assert np.all(np.asarray(obj.kl("k3")(x, x)) == 0)
  assert np.all(np.asarray(obj.kl("k3")(x, x[:, ::-1])) >= 0)


def test_kl_loss_masks_and_aggregates():
  logp = np.array([[-1.0, -2.0, np.nan]], np.float32)
  ref_logp = np.array([[-1.5, -1.0, 0.0]], np.float32)
  mask = np.array([[1, 1, 0]], np.float32)
  got = obj.kl_loss(logp, ref_logp, mask, estimator="k1")
  np.testing.assert_allclose(got, (0.5 - 1.0) / 2, rtol=1e-6)
  g = jax.grad(lambda lp: obj.kl_loss(lp, ref_logp, mask, estimator="k3"))(np.nan_to_num(logp))
  assert np.all(np.isfinite(g)) and float(g[0, 2]) == 0.0


def test_kl_reward_penalty_is_minus_coef_kl_on_valid_tokens():
  logp = np.array([[-1.0, -2.0, -3.0]], np.float32)
  ref_logp = np.array([[-1.5, -1.0, 0.0]], np.float32)
  mask = np.array([[1, 1, 0]], np.float32)
  np.testing.assert_allclose(obj.kl_reward_penalty(logp, ref_logp, mask, coef=0.1), [[-0.05, 0.1, 0.0]], rtol=1e-6)


def test_dynamic_sampling_keeps_groups_with_signal_and_singletons():
  acc = np.array([1, 1, 0, 0, 0, 1, 1, 1, 0.5], np.float32)
  groups = np.array([0, 0, 1, 1, 2, 2, 3, 3, 4])
  keep = obj.dynamic_sampling_keep(acc, groups)
  np.testing.assert_array_equal(keep, [False, False, False, False, True, True, False, False, True])
  np.testing.assert_array_equal(jax.jit(obj.dynamic_sampling_keep)(acc, groups), keep)


def test_overlong_penalty_matches_verl_recipe_and_paper_beyond_max():
  max_len, buf = 20480, 4096
  lengths = np.array([100, 16384, 18432, 20480, 25000])
  got = obj.overlong_reward_penalty(lengths, max_response_length=max_len, buffer_length=buf)
  verl = [min(-(n - (max_len - buf)) / buf * 1.0, 0.0) for n in lengths[:4]]
  np.testing.assert_allclose(got[:4], verl, rtol=1e-6)
  np.testing.assert_allclose(got, [0.0, 0.0, -0.5, -1.0, -1.0], rtol=1e-6)
  with pytest.raises(ValueError, match="buffer_length=0"):
    obj.overlong_reward_penalty(lengths, max_response_length=max_len, buffer_length=0)
