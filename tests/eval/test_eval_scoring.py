"""Which scorer decides each family (spec §2.5), transient judge failures recorded per example, and the bounds on
one example's scoring (a pool timeout for the offline checks, a deadline for the judge)."""

import time

import pytest

from aepo_jax.data import Example
from aepo_jax.eval import Scorer
from aepo_jax.eval._scoring import needs_rescore
from aepo_jax.rewards import RewardPool


def _ex(family, answers, q="Q?"):
  return Example("x:1", q, answers, "x", family)


def _ans(text):
  return f"<think>...</think><answer> The final answer is \\[ \\boxed{{{text}}} \\] </answer>"


class FakeJudge:
  def __init__(self, verdict=True, fail=False):
    self.verdict, self.fail, self.calls = verdict, fail, []

  def judge(self, question, labeled, predicted):
    self.calls.append((question, labeled, predicted))
    if self.fail:
      raise TimeoutError("judge timed out")
    return self.verdict


@pytest.mark.parametrize(
  "pred,gold,ok",
  [
    ("025", "25", True),
    ("\\frac{1}{2}", "0.5", True),
    ("1,000", "1000", True),
    ("\\frac{14}{3}", "\\frac{14}{3}", True),
    ("7", "8", False),
  ],
)
def test_math_by_math_verify_with_integer_normalisation(pred, gold, ok):
  out = Scorer().score(_ex("math", [gold]), _ans(pred))
  assert (out["correct"], out["score"], out["scorer"], out["extracted"]) == (ok, float(ok), "math_verify", pred)


def test_math_without_an_answer_is_wrong():
  out = Scorer().score(_ex("math", ["3"]), "I think it is 3")
  assert out["extracted"] == "" and out["score"] == 0.0


def test_qa_em_and_f1_over_aliases():
  ex = _ex("qa", ["Barack Obama", "Obama"])
  out = Scorer().score(ex, _ans("the Obama"))  # normalisation drops articles
  assert (out["em"], out["f1"], out["correct"], out["scorer"]) == (1.0, 1.0, True, "em")
  out = Scorer().score(ex, _ans("Michelle Obama"))
  assert out["em"] == 0.0 and out["f1"] == pytest.approx(2 * 0.5 * 1 / 1.5)  # best alias: 'Obama' (P=.5, R=1)
  assert out["correct"] is False


def test_qa_numeric_answer_counts_by_math_equivalence():
  out = Scorer().score(_ex("qa", ["1/2"]), _ans("0.5"))
  assert out["correct"] and out["scorer"] == "math_equal"


def test_deep_search_judge_is_consulted_only_when_math_equivalence_fails():
  judge = FakeJudge(verdict=True)
  out = Scorer(judge).score(_ex("deep_search", ["42"]), _ans("42.0"))
  assert out["correct"] and out["scorer"] == "math_equal" and judge.calls == []
  out = Scorer(judge).score(_ex("deep_search", ["Paris"], q="Capital of France?"), _ans("paris, France"))
  assert out["correct"] and out["scorer"] == "judge" and out["judge"] is True
  assert judge.calls == [("Capital of France?", ["Paris"], "paris, France")]
  out = Scorer(FakeJudge(verdict=False)).score(_ex("deep_search", ["Paris"]), _ans("Lyon"))
  assert not out["correct"] and out["scorer"] == "judge"


def test_transient_judge_failure_is_recorded_not_fatal():
  out = Scorer(FakeJudge(fail=True)).score(_ex("deep_search", ["Paris"]), _ans("Lyon"))
  assert out["score"] == 0.0 and out["scorer"] == "judge_failed"
  assert "TimeoutError" in out["judge_error"] and needs_rescore(out)
  assert not needs_rescore(Scorer(FakeJudge()).score(_ex("deep_search", ["Paris"]), _ans("Lyon")))


class SlowJudge:
  def judge(self, question, labeled, predicted):
    time.sleep(30)
    return True


@pytest.fixture(scope="module")
def pool():
  with RewardPool(num_workers=1, timeout_s=10.0, memory_limit_mb=2048) as p:
    yield p


def test_offline_checks_run_in_the_pool(pool):
  before = pool.stats["items"]
  out = Scorer(pool=pool).score(_ex("qa", ["Barack Obama", "Obama"]), _ans("the Obama"))
  assert (out["em"], out["correct"], out["score_error"]) == (1.0, True, None)
  assert pool.stats["items"] == before + 1


def test_hostile_answer_costs_one_timeout_whatever_the_aliases(pool):
  # In-process, math-verify's own 5 s guard ran once per alias (three aliases: over 15 s).
  start = time.monotonic()
  out = Scorer(pool=pool, timeout_s=1.5).score(_ex("math", ["5", "6", "7"]), _ans("10^{10^{9}}-1"))
  assert time.monotonic() - start < 12  # one 1.5 s timeout (8x for a loaded machine), not one per alias (> 15 s)
  assert (out["score"], out["scorer"], out["extracted"]) == (0.0, "timeout", "10^{10^{9}}-1")
  assert out["score_error"].startswith("timeout")
  assert Scorer(pool=pool).score(_ex("math", ["25"]), _ans("025"))["correct"]  # the pool still serves


def test_judge_time_per_example_is_bounded(pool):
  start = time.monotonic()
  out = Scorer(SlowJudge(), pool=pool, judge_timeout_s=0.5).score(_ex("deep_search", ["Paris"]), _ans("Lyon"))
  assert time.monotonic() - start < 15  # the 0.5 s judge deadline, not the judge's 30 s
  assert out["scorer"] == "judge_failed" and "no verdict within 0.5 s" in out["judge_error"] and needs_rescore(out)
