"""Math equivalence (evaluation), EM/F1 and answer extraction."""

import pytest

from aepo_jax.rewards import (
  eval_correct,
  exact_match,
  extract_answer,
  extract_boxed,
  f1_score,
  math_equal,
  normalize_answer,
)


@pytest.mark.parametrize(
  "pred,gold",
  [
    ("025", "25"),
    ("25", "025"),
    ("+7", "7"),
    ("1,000", "1000"),
    ("-0", "0"),
    (70, "70"),
    ("\\boxed{204}", "204"),
    ("$33$", "33"),
    ("\\frac{14}{3}", "14/3"),
    ("\\dfrac{14}{3}", "4\\frac{2}{3}"),
    ("0.5", "\\frac12"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi/2)"),  # MATH500 answer format
    ("2\\sqrt{3}", "\\sqrt{12}"),
    ("\\{1,2\\}", "\\{2,1\\}"),
    ("10^{3}", "1000"),
    ("3.0", "3"),
    ("x=3", "3"),
    ("12\\text{ cm}", "12"),
    ("\\text{(C)}", "C"),
  ],
)
def test_math_equal_true(pred, gold):
  assert math_equal(pred, gold)


@pytest.mark.parametrize(
  "pred,gold",
  [
    ("4", "5"),
    ("250", "25"),
    ("\\frac{1}{3}", "0.33"),
    ("", "1"),
    ("abc", "abd"),
    ("\\boxed{a}+\\boxed{b}", "a"),
    ("1" * 50_000, "1" * 50_000 + "0"),
  ],
)
def test_math_equal_false(pred, gold):
  assert not math_equal(pred, gold)


def test_normalize_and_em_f1():
  assert normalize_answer("The  Big-Apple!") == "bigapple"
  assert exact_match("the new york city", ["NYC", "New York City"])
  assert not exact_match("York", ["New York City"])
  assert f1_score("new york", ["New York City"]) == pytest.approx(0.8)  # P=1, R=2/3
  with pytest.raises(ValueError, match="empty"):
    f1_score("x", [])


def test_extract_boxed_and_answer():
  assert extract_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
  assert extract_boxed("\\boxed{unclosed") is None
  assert extract_boxed("none") is None
  text = "<think> \\boxed{no} </think><answer> The answer is \\boxed{\\text{Paris}} </answer>"
  assert extract_answer(text) == "Paris"
  assert extract_answer("<answer> Paris </answer>") == "Paris"
  assert extract_answer("so \\boxed{42}") == "42"
  assert extract_answer("nothing here") == ""


def test_eval_correct_protocol():
  class Judge:
    calls = []

    def judge(self, question, labeled_answer, predicted_answer):
      self.calls.append((question, labeled_answer, predicted_answer))
      return predicted_answer == "Big Apple"

  resp = "<answer> \\boxed{{{}}} </answer>"
  assert eval_correct(resp.format("025"), ["25"], "math")
  assert not eval_correct(resp.format("Big Apple"), ["NYC"], "math")
  j = Judge()
  assert eval_correct(resp.format("Big Apple"), ["NYC"], "qa", question="q", judge=j)
  assert j.calls == [("q", ["NYC"], "Big Apple")]
  assert eval_correct(resp.format("1,000"), ["1000"], "deep_search", judge=j)  # math path first
  assert len(j.calls) == 1
  assert eval_correct(resp.format("the NYC"), ["NYC"], "qa")  # no judge: EM fallback
  with pytest.raises(ValueError, match="family"):
    eval_correct("x", ["y"], "trivia")
