"""Pass@k estimators and bootstrap confidence intervals (no jax: evaluation scoring runs on the host).

* `pass_at_k(n, c, k)`: the unbiased estimator of Chen et al. 2021 (Codex), 1 − C(n−c, k) / C(n, k),
  computed as a stable product. Needs n ≥ k samples of a question, c of them correct.
* `best_of_k(scores)`: the papers' form ("Pass@5 = 5 independent runs"): per question, the best score over
  exactly k runs. With binary scores and n = k it equals `pass_at_k(k, c, k)`.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k for one question with n samples of which c are correct."""
  if not 0 <= c <= n:
    raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}.")
  if k < 1 or k > n:
    raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n}; sample at least k answers per question.")
  if n - c < k:
    return 1.0
  # 1 - prod_{i = n-c+1}^{n} (1 - k / i)
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
  """Mean unbiased pass@k over questions; `correct[q]` is the list of per-sample outcomes of question q."""
  if not len(correct):
    raise ValueError("mean_pass_at_k: no questions.")
  return float(np.mean([pass_at_k(len(s), int(np.sum(s)), k) for s in correct]))


def best_of_k(scores: Sequence[Sequence[float]], k: int) -> float:
  """Mean over questions of the best score among the first k runs (the papers' 'k independent runs')."""
  rows = []
  for q, s in enumerate(scores):
    if len(s) < k:
      raise ValueError(f"best_of_k: question {q} has {len(s)} runs, fewer than k={k}.")
    rows.append(max(s[:k]))
  return float(np.mean(rows))


def bootstrap_ci(
  per_question: Sequence[float],
  *,
  stat: Callable[[np.ndarray], float] = np.mean,
  num_resamples: int = 2000,
  alpha: float = 0.05,
  seed: int = 0,
) -> tuple[float, float]:
  """Percentile bootstrap CI of `stat` over questions (resampled with replacement)."""
  x = np.asarray(per_question, dtype=np.float64)
  if x.size == 0:
    raise ValueError("bootstrap_ci: no values.")
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, x.size, size=(num_resamples, x.size))
  if stat is np.mean:
    stats = x[idx].mean(axis=1)
  else:
    stats = np.array([stat(x[i]) for i in idx])
  lo, hi = np.quantile(stats, [alpha / 2, 1 - alpha / 2])
  return float(lo), float(hi)


def summarize(
  correct: Sequence[Sequence[bool]],
  ks: Sequence[int],
  *,
  scores: Optional[Sequence[Sequence[float]]] = None,
  num_resamples: int = 2000,
  seed: int = 0,
) -> dict:
  """Pass@k (unbiased) with 95% bootstrap CIs for every k ≤ the smallest sample count, plus best-of-k."""
  n_min = min(len(s) for s in correct)
  out = {"num_questions": len(correct), "samples_per_question": n_min}
  for k in ks:
    if k > n_min:
      continue
    per_q = [pass_at_k(len(s), int(np.sum(s)), k) for s in correct]
    lo, hi = bootstrap_ci(per_q, num_resamples=num_resamples, seed=seed)
    out[f"pass@{k}"] = float(np.mean(per_q))
    out[f"pass@{k}_ci95"] = (lo, hi)
    if scores is not None:
      out[f"best_of_{k}"] = best_of_k(scores, k)
  return out
