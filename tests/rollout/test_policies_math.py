"""The pure jitted pieces of the rollout policies against the spec's formulas (spec §1.2 2.2/2.6, §2.1)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aepo_jax.rollout.policies import (
  PolicyConfig,
  branch_probability,
  decide_branches,
  premonitor_split,
  rollout_policy,
  rollout_policy_names,
  window_statistic,
)


def _bound(p, n):  # 4.5-sigma binomial bound (+ a continuity term)
  return 4.5 * math.sqrt(max(p * (1 - p), 1e-12) / n) + 1.0 / n


def test_window_statistic_exact_and_official():
  count = jnp.asarray([0, 5, 40])
  ent_sum = jnp.asarray([0.0, 10.0, 20.0])  # engine sums over the first min(count, window) tokens
  topk_sum = jnp.asarray([0.0, 3.0, 9.0])
  exact = window_statistic(count, ent_sum, topk_sum, estimator="exact", window=20, vocab_size=100)
  np.testing.assert_allclose(exact, [0.0, 2.0, 1.0], rtol=1e-6)  # mean over min(count, 20) tokens
  off = window_statistic(count, ent_sum, topk_sum, estimator="official", window=20, vocab_size=100)
  np.testing.assert_allclose(off, np.asarray([0.0, 3.0, 9.0]) / math.log(100), rtol=1e-6)  # sum / ln|V|
  with pytest.raises(ValueError, match="estimator"):
    window_statistic(count, ent_sum, topk_sum, estimator="mean", window=20, vocab_size=100)


def _decide(rule, delta_h, consecutive=0, n_cand=4000, z=2, remaining=10**6, seed=0, threshold=0.5, weight=0.2):
  c = n_cand
  out = decide_branches(
    jax.random.PRNGKey(seed),
    jnp.full((c,), delta_h, jnp.float32),
    jnp.zeros((c,), jnp.float32),
    jnp.ones((c,), bool),
    jnp.zeros((c,), jnp.int32),
    jnp.zeros((c,), bool),
    jnp.asarray([remaining], jnp.int32),
    jnp.asarray([consecutive], jnp.int32),
    jnp.full((8,), -1, jnp.int32),
    0,
    rule=rule,
    beam_size=z,
    num_prompts=1,
    weight=weight,
    threshold=threshold,
    penalty_slope=0.05,
  )
  return jax.device_get(out)


@pytest.mark.parametrize("rule", ["arpo", "aepo"])
@pytest.mark.parametrize(
  "delta_h,consecutive", [(-2.0, 0), (0.0, 0), (1.0, 0), (3.0, 0), (0.0, 6), (1.0, 12), (0.5, 25)]
)
def test_branch_rate_matches_formula(rule, delta_h, consecutive):
  out = _decide(rule, delta_h, consecutive)
  f = max(0.0, 1 - 0.05 * consecutive)
  if rule == "arpo":
    want = min(max(0.5 + 0.2 * delta_h, 0.0), 1.0)  # spec §1.2 2.6
  else:
    want = 0.0 if f == 0 else min(max(1 - 0.5 / f + 0.2 * delta_h, 0.0), 1.0)  # spec §2.1
  rate = out["children_c"].sum() / out["attempts_c"].sum()
  assert abs(rate - want) <= _bound(want, out["attempts_c"].sum()), (rate, want)
  np.testing.assert_allclose(out["prob_c"][0], want, atol=1e-6)
  np.testing.assert_allclose(branch_probability(rule, delta_h, weight=0.2, threshold=0.5, penalty=f), want, atol=1e-6)


def test_attempts_follow_the_official_budget_rule():
  # Z=3, remaining 1: each candidate gets min(Z-1, remaining - created) attempts when visited (spec §1.2 2.6).
  out = _decide("arpo", 100.0, n_cand=5, z=3, remaining=1)  # P = 1
  assert out["attempts_c"].tolist() == [1, 0, 0, 0, 0] and out["children_c"].tolist() == [1, 0, 0, 0, 0]
  out = _decide("arpo", 100.0, n_cand=5, z=3, remaining=5)
  assert out["children_c"].tolist() == [2, 2, 1, 0, 0]
  for seed in range(20):  # never over budget, whatever the draws
    out = _decide("arpo", 0.0, n_cand=16, z=4, remaining=7, seed=seed)
    assert out["children_c"].sum() <= 7


def test_children_go_to_free_slots_in_order():
  c = 6
  out = jax.device_get(
    decide_branches(
      jax.random.PRNGKey(0),
      jnp.full((c,), 50.0),
      jnp.zeros((c,)),
      jnp.asarray([1, 1, 0, 1, 1, 1], bool),
      jnp.asarray([0, 0, 0, 1, 1, 1], jnp.int32),
      jnp.asarray([1, 0, 1, 1, 1, 1], bool),
      jnp.asarray([9, 2]),
      jnp.zeros((2,), jnp.int32),
      jnp.asarray([5, 7, 2, -1]),
      3,
      rule="arpo",
      beam_size=2,
      num_prompts=2,
      weight=0.2,
      threshold=0.5,
      penalty_slope=0.05,
    )
  )
  # prompt 1 has budget 2: candidates 3, 4 branch, 5 does not; candidate 1 is not resident (host re-prefill).
  assert out["children_c"].tolist() == [1, 1, 0, 1, 1, 0]
  assert out["child_src_k"][:4].tolist() == [0, 1, 3, 4] and (out["child_src_k"][4:] == -1).all()
  assert out["child_dst_k"][:4].tolist() == [5, -1, 7, 2]


@pytest.mark.parametrize("estimator", ["exact", "official"])
def test_the_round_decision_is_one_compiled_function_from_the_accumulators(estimator):
  """decide_branches with `estimator`: the window statistics from the engine's accumulators and the decision in one
  jitted call (no eager statistic on the host), equal to the statistic computed first."""
  rng = np.random.default_rng(0)
  c = 8
  acc = np.stack([rng.integers(0, 40, c), rng.uniform(0, 60, c), rng.uniform(0, 90, c)], 1).astype(np.float32)
  ini = np.stack([rng.integers(1, 40, c), rng.uniform(0, 60, c), rng.uniform(0, 90, c)], 1).astype(np.float32)
  args = (
    jnp.ones((c,), bool),
    jnp.asarray([0, 0, 0, 1, 1, 1, 1, 1], jnp.int32),
    jnp.asarray([0, 1, 1, 0, 1, 1, 0, 1], bool),
    jnp.asarray([5, 6], jnp.int32),
    jnp.asarray([0, 3], jnp.int32),
    jnp.asarray([4, 9, -1, -1], jnp.int32),
    2,
  )
  rule_kw = dict(rule="aepo", beam_size=3, num_prompts=2, weight=0.2, threshold=0.5, penalty_slope=0.05)
  stat_kw = dict(estimator=estimator, window=20, vocab_size=1000)
  key = jax.random.PRNGKey(3)
  got = jax.device_get(decide_branches(key, jnp.asarray(acc), jnp.asarray(ini), *args, **stat_kw, **rule_kw))

  def stat(a):
    return window_statistic(jnp.asarray(a[:, 0], jnp.int32), jnp.asarray(a[:, 1]), jnp.asarray(a[:, 2]), **stat_kw)

  want = jax.device_get(decide_branches(key, stat(acc), stat(ini), *args, **rule_kw))
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)
  assert np.abs(got["delta_h_c"]).max() > 0
  # one compiled program: the jaxpr is a single jit whose body holds the statistic (the division) and the draws
  jaxpr = jax.make_jaxpr(lambda a, i: decide_branches(key, a, i, *args, **stat_kw, **rule_kw))(acc, ini)
  assert [e.primitive.name for e in jaxpr.eqns] in (["jit"], ["pjit"]), jaxpr
  body = str(jaxpr.eqns[0].params["jaxpr"])
  assert "div" in body and ("random_bits" in body or "threefry" in body)


@pytest.mark.parametrize("n", [1, 4, 12, 16])
def test_premonitor_split_matches_code_formula(n):
  rng = np.random.default_rng(n)
  h_root, h_tool = rng.uniform(0, 4, 200).astype(np.float32), rng.uniform(0, 4, 200).astype(np.float32)
  got = np.asarray(premonitor_split(jnp.asarray(h_root), jnp.asarray(h_tool), n=n, beta=0.5))
  sig = 1 / (1 + np.exp(-0.5 * (h_root.astype(np.float64) - h_tool)))
  want = np.clip((n * sig).astype(np.int64) + 1, 1, n)  # int(n·σ(β·ΔH)) + 1, clamped (spec §2.1 step 3)
  near = np.abs(n * sig - np.round(n * sig)) < 1e-4  # float32 vs float64 at exact integers
  np.testing.assert_array_equal(got[~near], want[~near])
  assert int(premonitor_split(jnp.asarray([1.0]), jnp.asarray([1.0]), n=16, beta=0.5)[0]) == 9  # int(16/2)+1


@pytest.mark.parametrize("n", [1, 4, 12, 16])
def test_premonitor_split_paper_formula(n):
  """'paper': m = n·σ(β·ΔH) (spec §2.1), rounded half up to a whole sample, clamped to [1, n]."""
  rng = np.random.default_rng(100 + n)
  h_root, h_tool = rng.uniform(0, 4, 200).astype(np.float32), rng.uniform(0, 4, 200).astype(np.float32)
  got = np.asarray(premonitor_split(jnp.asarray(h_root), jnp.asarray(h_tool), n=n, beta=0.5, formula="paper"))
  sig = 1 / (1 + np.exp(-0.5 * (h_root.astype(np.float64) - h_tool)))
  want = np.clip(np.floor(n * sig + 0.5).astype(np.int64), 1, n)
  near = np.abs(n * sig + 0.5 - np.round(n * sig + 0.5)) < 1e-4  # float32 vs float64 at a rounding boundary
  np.testing.assert_array_equal(got[~near], want[~near])
  one = jnp.asarray([1.0])
  assert int(premonitor_split(one, one, n=16, beta=0.5, formula="paper")[0]) == 8  # 16·σ(0) = 8; the code gives 9
  assert int(premonitor_split(one, one, n=12, beta=0.5, formula="paper")[0]) == 6  # the code gives 7
  with pytest.raises(ValueError, match="formula='kσ'"):
    premonitor_split(one, one, n=4, beta=0.5, formula="kσ")


def test_registry_and_config_errors():
  assert rollout_policy_names() == ["aepo", "arpo", "none"]
  with pytest.raises(ValueError, match="Unknown rollout policy"):
    rollout_policy("grpo")
  with pytest.raises(ValueError, match="PolicyConfig.mode"):
    PolicyConfig(mode="official")
  with pytest.raises(ValueError, match="PolicyConfig.estimator"):
    rollout_policy("arpo", estimator="topk")
