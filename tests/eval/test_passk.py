"""Pass@k: hand-computed cases, brute-force enumeration, best-of-k and bootstrap behaviour."""

import itertools
import math

import numpy as np
import pytest

from aepo_jax.eval._passk import best_of_k, bootstrap_ci, mean_pass_at_k, pass_at_k, summarize


@pytest.mark.parametrize(
  "n,c,k,expected",
  [
    (1, 1, 1, 1.0),
    (1, 0, 1, 0.0),
    (5, 1, 1, 0.2),
    (5, 2, 5, 1.0),
    (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (10, 3, 5, 1 - math.comb(7, 5) / math.comb(10, 5)),
  ],
)
def test_hand_computed(n, c, k, expected):
  assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_matches_brute_force_enumeration():
  # pass@k = probability that a uniformly random k-subset of the n samples holds at least one correct one.
  for n in range(1, 9):
    for c in range(n + 1):
      outcomes = [1] * c + [0] * (n - c)
      for k in range(1, n + 1):
        subsets = list(itertools.combinations(range(n), k))
        brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_errors_name_the_problem():
  with pytest.raises(ValueError, match="k <= n"):
    pass_at_k(3, 1, 5)
  with pytest.raises(ValueError, match="0 <= c <= n"):
    pass_at_k(3, 4, 1)


def test_best_of_k_equals_unbiased_when_n_equals_k_and_binary():
  rng = np.random.default_rng(0)
  correct = rng.random((50, 5)) < 0.3
  assert best_of_k(correct.astype(float), 5) == pytest.approx(mean_pass_at_k(correct, 5))
  # With more samples than k, best-of-first-k is one draw of what pass@k averages.
  assert best_of_k([[0.2, 0.9, 0.1]], 2) == 0.9


def test_bootstrap_ci_covers_mean_and_shrinks_with_more_questions():
  rng = np.random.default_rng(1)
  small = rng.random(40) < 0.5
  large = rng.random(4000) < 0.5
  lo_s, hi_s = bootstrap_ci(small)
  lo_l, hi_l = bootstrap_ci(large)
  assert lo_s <= small.mean() <= hi_s and lo_l <= large.mean() <= hi_l
  assert hi_l - lo_l < hi_s - lo_s


def test_summarize_skips_k_above_sample_count():
  out = summarize([[True, False, False], [False, False, False]], ks=(1, 3, 5))
  assert out["pass@1"] == pytest.approx((1 / 3 + 0) / 2)
  assert out["pass@3"] == pytest.approx(0.5)
  assert "pass@5" not in out
