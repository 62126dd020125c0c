"""The official math equivalence (`is_equiv` on normalised answers, the official `math_equal` metric) against the
project's math-verify on the same pairs.

The expected official verdicts were produced by running the official files themselves (github.com/dongguanting/ARPO,
evaluation/src/metrics.py `evaluate_math_prediction` and math_equivalence.py `is_equiv`) on these pairs; the
reference answers are the benchmarks' (math500, aime24/25, gsm8k in /work/shared/data/arpo/eval), the predictions
typical model outputs. Columns: prediction, reference, official math_equal, em, acc, f1, is_equiv on the raw
strings (what the official judge ORs), and the project's math-verify `math_equal`.
"""

import pytest

from aepo_jax.rewards import _official as official
from aepo_jax.rewards import math_equal

PAIRS = [
  ('\\left( 3, \\frac{\\pi}{2} \\right)', '\\left( 3, \\frac{\\pi}{2} \\right)', 1, 1, 1, 1.0, 1, 1),
  ('(3, \\frac{\\pi}{2})', '\\left( 3, \\frac{\\pi}{2} \\right)', 1, 0, 0, 0.0, 1, 1),
  ('(3,\\pi/2)', '\\left( 3, \\frac{\\pi}{2} \\right)', 0, 0, 0, 0.0, 0, 1),
  ('p-q', 'p - q', 1, 0, 0, 0.0, 1, 1),
  ('\\frac{14}{3}', '\\frac{14}{3}', 1, 1, 1, 1.0, 1, 1),
  ('\\dfrac{14}{3}', '\\frac{14}{3}', 1, 0, 0, 0.0, 1, 1),
  ('14/3', '\\frac{14}{3}', 1, 0, 0, 0.0, 1, 1),
  ('4.666666666666667', '\\frac{14}{3}', 0, 0, 0, 0.0, 0, 1),
  ('9', '9', 1, 1, 1, 1.0, 1, 1),
  ('9.0', '9', 0, 0, 1, 0.0, 0, 1),
  ('Evelyn', '\\text{Evelyn}', 0, 0, 0, 0.0, 0, 1),
  ('\\text{Evelyn}', '\\text{Evelyn}', 1, 1, 1, 1.0, 1, 1),
  ('90', '90^\\circ', 1, 0, 0, 0.0, 1, 1),
  ('90^\\circ', '90^\\circ', 1, 1, 1, 1.0, 1, 1),
  ('90^{\\circ}', '90^\\circ', 1, 0, 0, 0.0, 1, 1),
  ('3\\sqrt{13}', '3\\sqrt{13}', 1, 1, 1, 1.0, 1, 1),
  ('3\\sqrt13', '3\\sqrt{13}', 0, 0, 0, 0.0, 0, 0),
  ('3 \\sqrt{13}', '3\\sqrt{13}', 1, 0, 0, 0.0, 1, 1),
  ('\\frac{3}{56}', '\\frac{3}{56}', 1, 1, 1, 1.0, 1, 1),
  ('\\frac3{56}', '\\frac{3}{56}', 1, 0, 0, 0.0, 1, 1),
  ('3/56', '\\frac{3}{56}', 1, 0, 0, 0.0, 1, 1),
  ('\\sqrt{51}', '\\sqrt{51}', 1, 1, 1, 1.0, 1, 1),
  ('6-5i', '6 - 5i', 1, 0, 0, 0.0, 1, 1),
  ('-50', '-50', 1, 1, 1, 1.0, 1, 1),
  ('\\pi', '\\pi', 1, 1, 1, 1.0, 1, 1),
  ('3.14159', '\\pi', 0, 0, 0, 0.0, 0, 0),
  ('x=5', 'x=5', 1, 1, 1, 1.0, 1, 1),
  ('5', 'x=5', 1, 0, 0, 0.0, 1, 1),
  ('x = 5', '5', 1, 0, 1, 0.5, 1, 1),
  ('0.5', '\\frac{1}{2}', 1, 0, 0, 0.0, 1, 1),
  ('.5', '\\frac{1}{2}', 1, 0, 0, 0.0, 1, 1),
  ('\\frac12', '\\frac{1}{2}', 1, 0, 0, 0.0, 1, 1),
  ('1/2', '\\frac{1}{2}', 1, 0, 0, 0.0, 1, 1),
  ('50\\%', '50', 1, 0, 1, 0.0, 1, 1),
  ('\\$18', '18', 1, 0, 1, 0.0, 1, 1),
  ('$18', '18', 0, 0, 1, 0.0, 0, 1),
  ('18 \\text{ dollars}', '18', 1, 0, 1, 0.5, 1, 1),
  ('18 dollars', '18', 0, 0, 1, 0.666667, 0, 0),
  ('204', '204', 1, 1, 1, 1.0, 1, 1),
  ('25', '025', 0, 0, 0, 0.0, 0, 1),
  ('025', '025', 1, 1, 1, 1.0, 1, 1),
  ('73', '073', 0, 0, 0, 0.0, 0, 1),
  ('\\boxed{204}', '204', 0, 0, 1, 0.0, 0, 1),
  ('70', '70', 1, 1, 1, 1.0, 1, 1),
  ('70.0', '70', 0, 0, 1, 0.0, 0, 1),
  ('3.0', '3', 0, 0, 1, 0.0, 0, 1),
  ('+3', '3', 0, 0, 1, 0.0, 0, 1),
  ('1,000', '1000', 0, 0, 0, 0.0, 0, 1),
  ('70,000', '70000', 0, 0, 0, 0.0, 0, 1),
  ('70000', '70000', 1, 1, 1, 1.0, 1, 1),
  ('57500.00', '57500', 0, 0, 1, 0.0, 0, 1),
  ('18', '18', 1, 1, 1, 1.0, 1, 1),
  ('The answer is 18', '18', 0, 0, 1, 0.4, 0, 1),
  ('18.', '18', 0, 0, 1, 0.0, 0, 1),
  ('2220', '2220', 1, 1, 1, 1.0, 1, 1),
  ('\\{1, 2\\}', '\\{1,2\\}', 1, 0, 0, 0.0, 1, 1),
  ('[1, 2)', '[1,2)', 1, 0, 0, 0.0, 1, 1),
  ('x^2+1', '1+x^2', 0, 0, 0, 0.0, 0, 1),
  ('2x', '2 x', 1, 0, 0, 0.0, 1, 1),
  ('\\frac{\\sqrt{3}}{2}', '\\frac{\\sqrt3}{2}', 1, 0, 0, 0.0, 1, 1),
  ('k = 7', '7', 1, 0, 1, 0.5, 1, 1),
  ('10^{\\circ}', '10', 1, 0, 1, 0.0, 1, 1),
  ('\\left(1,2\\right)', '(1,2)', 1, 0, 0, 0.0, 1, 1),
  ('\\text{(C)}', '\\text{(C)}', 1, 1, 1, 1.0, 1, 1),
  ('C', '\\text{(C)}', 0, 0, 0, 0.0, 0, 1),
  ('3\\text{ cm}', '3', 1, 0, 1, 0.0, 1, 1),
  ('3 \\text{ cm}^2 and \\text{ m}', '3', 0, 0, 1, 0.285714, 0, 1),
  ('\\sqrt', '\\sqrt{2}', 0, 0, 0, 0.0, 0, 0),
  ('\\frac1', '\\frac{1}{2}', 0, 0, 0, 0.0, 0, 0),
  ('\\text{evelyn}', '\\text{Evelyn}', 1, 1, 1, 1.0, 0, 0),
  ('I', 'i', 1, 1, 1, 1.0, 0, 0),
  ('a+b', 'A+B', 1, 1, 1, 1.0, 0, 1),
  ('x \\in [1,2]', '[1,2]', 0, 0, 1, 0.5, 0, 1),
  ('1.5', '\\frac32', 0, 0, 0, 0.0, 0, 1),
  ('\\text{Monday}', 'Monday', 0, 0, 1, 0.0, 0, 1),
]


def test_enough_pairs():
  assert len(PAIRS) >= 50


@pytest.mark.parametrize("pred,ref,math_eq,em,acc,f1,raw_equiv,_mv", PAIRS)
def test_official_math_metrics_match_the_official_code(pred, ref, math_eq, em, acc, f1, raw_equiv, _mv):
  m = official.evaluate_math_prediction(pred, ref)
  assert (m["math_equal"], m["em"], m["acc"], round(m["f1"], 6)) == (math_eq, em, acc, f1)
  assert int(official.is_equiv(pred, ref)) == raw_equiv


@pytest.mark.parametrize("pred,ref,_me,_em,_acc,_f1,_raw,mv", PAIRS)
def test_project_math_verify_verdicts(pred, ref, _me, _em, _acc, _f1, _raw, mv):
  assert int(math_equal(pred, ref)) == mv


def test_where_official_and_math_verify_disagree():
  """Documented in docs/evaluation.md: the official metric is string equality after normalisation."""
  disagree = {(p, r): (me, mv) for p, r, me, _, _, _, _, mv in PAIRS if me != mv}
  for pair in [("3.0", "3"), ("25", "025"), ("1,000", "1000"), ("9.0", "9"), ("18.", "18"), ("+3", "3")]:
    assert disagree[pair] == (0, 1), pair  # equal by value, not officially
  assert disagree[("I", "i")] == (1, 0)  # the official normaliser lower-cases: equal officially, not by math-verify
  assert disagree[("\\text{evelyn}", "\\text{Evelyn}")] == (1, 0)
  assert len(disagree) == 24


def test_is_equiv_quirks():
  assert official.is_equiv(None, None) and not official.is_equiv("1", None)
  assert official.is_equiv("\\sqrt", "\\sqrt")  # _fix_sqrt raises: plain equality decides
  assert not official.is_equiv("\\sqrt", "\\sqrt{}")
  assert not official.is_equiv("3", ["3"])  # a list of aliases never equals a string (the judge's OR)
  assert official._strip_string("\\dfrac{1}{2}") == "\\frac{1}{2}"
  assert official._strip_string("0.5") == "\\frac{1}{2}" and official._strip_string("3/4") == "\\frac{3}{4}"
