"""Advantage estimators against NumPy transcriptions of verl's estimators."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import objectives_reference as ref
from aepo_jax import objectives as obj

# Groups: 0 (four rewards), 7 (all equal → 0), 3 (singleton → mean 0, std 1), 5 (two rewards),
# interleaved as a rollout with branches would order them.
REWARDS = np.array([0.3, 1.0, -1.0, 0.5, 0.2, 0.9, 0.0, 1.0, 1.0, 0.1, 0.5], np.float32)
GROUPS = np.array([0, 0, 7, 0, 3, 5, 0, 7, 7, 5, 7])
T = 6


def _mask(seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, T + 1, len(REWARDS))
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
  mask[:, 0] = 1
  mask[1, 1:3] = 0  # a tool-result hole in the middle (row 1 has length >= 4 below)
  mask[1, 3] = 1
  return mask


def test_grpo_matches_verl():
  mask = _mask()
  # Group 7 rewards are −1, 1, 1, 0.5: not all equal; make an all-equal group explicitly.
  rewards = REWARDS.copy()
  rewards[GROUPS == 7] = 1.0
  got = obj.advantage("grpo")(rewards, GROUPS, mask)
  want = ref.grpo_outcome_advantage(rewards, GROUPS, mask)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got)[GROUPS == 7] == 0)
  singleton = GROUPS == 3
  np.testing.assert_allclose(np.asarray(got)[singleton][:, 0], rewards[singleton] / (1 + 1e-6))
  got = obj.advantage("grpo")(rewards, GROUPS, mask, norm_by_std=False)  # Dr.GRPO
  want = ref.grpo_outcome_advantage(rewards, GROUPS, mask, norm_adv_by_std_in_grpo=False)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_grpo_zero_variance_group_is_exactly_zero_for_inexact_rewards():
  rewards = np.array([0.1, 0.1, 0.1, 0.7, 0.3], np.float32)
  adv = obj.advantage("grpo")(rewards, np.array([2, 2, 2, 9, 9]), np.ones((5, 3)))
  assert np.all(np.asarray(adv)[:3] == 0)


def test_grpo_unbiased_std_by_hand():
  adv = obj.advantage("grpo")(np.array([0.0, 1.0], np.float32), np.array([4, 4]), np.ones((2, 1)))
  # mean 0.5, unbiased std sqrt(0.5) → ±0.5/0.70710678
  np.testing.assert_allclose(np.asarray(adv)[:, 0], [-0.70710578, 0.70710578], rtol=1e-5)


def test_rloo_matches_verl():
  mask = _mask(1)
  got = obj.advantage("rloo")(REWARDS, GROUPS, mask)
  np.testing.assert_allclose(got, ref.rloo_outcome_advantage(REWARDS, GROUPS, mask), rtol=1e-5, atol=1e-6)


def test_reinforce_pp_matches_verl_with_holes_and_discount():
  mask = _mask(2)
  for gamma in (1.0, 0.9):
    token_r = np.zeros(mask.shape)
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1] > 0, axis=1)
    token_r[np.arange(len(REWARDS)), last] = REWARDS
    got = obj.advantage("reinforce_pp")(REWARDS, GROUPS, mask, gamma=gamma)
    np.testing.assert_allclose(got, ref.reinforce_pp(token_r, mask, gamma), rtol=1e-5, atol=1e-5)
  # The hole in row 1 cuts the return: tokens before it share one value, different from after.
  returns = obj.discounted_returns(jnp.asarray(token_r), jnp.asarray(mask), 1.0)
  assert float(returns[1, 0]) == 0.0 and float(returns[1, 3]) == REWARDS[1]
  through = obj.discounted_returns(jnp.asarray(token_r), jnp.asarray(mask), 1.0, reset_at_mask=False)
  assert float(through[1, 0]) == REWARDS[1]


def test_reinforce_pp_token_rewards_kl_penalty():
  mask = _mask(3)
  rng = np.random.default_rng(0)
  logp, ref_logp = rng.normal(-1, 0.3, (2,) + mask.shape).astype(np.float32)
  penalty = obj.kl_reward_penalty(logp, ref_logp, mask, coef=0.001, estimator="k1")
  token_r = np.asarray(penalty, np.float64)
  last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1] > 0, axis=1)
  token_r[np.arange(len(REWARDS)), last] += REWARDS
  got = obj.advantage("reinforce_pp")(REWARDS, GROUPS, mask, token_rewards=penalty)
  np.testing.assert_allclose(got, ref.reinforce_pp(token_r, mask, 1.0), rtol=1e-4, atol=1e-5)


def test_reinforce_pp_baseline_matches_verl():
  mask = _mask(4)
  got = obj.advantage("reinforce_pp_baseline")(REWARDS, GROUPS, mask)
  np.testing.assert_allclose(got, ref.reinforce_pp_baseline(REWARDS, GROUPS, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", obj.list_advantages())
def test_zero_outside_mask_jit_vmap_deterministic(name):
  mask = _mask(5)
  fn = jax.jit(obj.advantage(name))
  a = np.asarray(fn(REWARDS, GROUPS, mask))
  assert np.all(a[mask == 0] == 0)
  np.testing.assert_array_equal(a, fn(REWARDS, GROUPS, mask))
  # vmap over independent batches equals per-batch calls.
  rewards2 = np.stack([REWARDS, REWARDS[::-1]])
  masks2 = np.stack([mask, _mask(6)])
  batched = jax.vmap(obj.advantage(name))(rewards2, np.stack([GROUPS, GROUPS]), masks2)
  for i in range(2):
    np.testing.assert_allclose(batched[i], fn(rewards2[i], GROUPS, masks2[i]), rtol=1e-6, atol=1e-7)


def test_group_ids_are_relabel_invariant():
  mask = _mask(7)
  a = obj.advantage("grpo")(REWARDS, GROUPS, mask)
  b = obj.advantage("grpo")(REWARDS, GROUPS * 1000 + 12345, mask)
  np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
  "args, match",
  [
    ((REWARDS[:, None], GROUPS, np.ones((11, 2))), r"rewards must be one scalar per sequence"),
    ((REWARDS, GROUPS[:5], np.ones((11, 2))), "group_ids shape"),
    ((REWARDS, GROUPS.astype(np.float32), np.ones((11, 2))), "group_ids must be integers"),
    ((REWARDS, GROUPS, np.ones((5, 2))), "mask must be"),
  ],
)
def test_bad_inputs_are_named(args, match):
  with pytest.raises(ValueError, match=match):
    obj.advantage("grpo")(*args)
