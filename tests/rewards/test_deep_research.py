"""The deep-research reward, rule by rule (spec §1.6), on trajectories shaped like ARPO's."""

import pytest
from hypothesis import given, settings, strategies as st

from aepo_jax.rewards import check_format, deep_research, deep_research_details

ANS = "<answer> The final answer is \\[ \\boxed{{{}}} \\] </answer>"
SEARCH = "<search> who illustrated winnie the pooh </search> <result>\nPage 1: E. H. Shepard drew them.\n</result>"
PYTHON = "<python>\nprint(487 * 362)\n</python> <result>\n176294\n</result>"


def traj(*parts, answer="E. H. Shepard"):
  return " ".join(parts) + " " + ANS.format(answer)


GOOD = traj("<think> Look it up. </think>", SEARCH, "<think> Found it. </think>")


def test_correct_answer_scores_one():
  d = deep_research_details(GOOD, "E. H. Shepard")
  assert d == dict(score=1.0, format_ok=True, reason="correct", extracted="E. H. Shepard", f1=1.0)


# Each rule of §1.6.1 gets at least one violating example; every violation gives -1.
@pytest.mark.parametrize(
  "text,why",
  [
    (traj("<think> a </think> <think> b", SEARCH), "think counts differ"),
    (traj("<think> a </think> </think>"), "think counts differ (extra close)"),
    (traj(SEARCH), "no think block"),
    ("<think> a </think> " + ANS.format("x") + " " + ANS.format("x"), "two answer blocks"),
    ("<think> a </think> The final answer is \\boxed{x}", "no answer block"),
    ("<think> a </think> <answer> \\boxed{x}", "answer never closed"),
    ("<think> a </think> \\boxed{x} </answer> <answer>", "close before open"),
    (traj("<think> a </think> <search> q </search> <think> b </think>"), "search without result"),
    (traj("<think> a </think> <search> q <result> r </result> </search>"), "</search> after <result>"),
    (traj("<think> a </think> <search> q </search> <result> r"), "result never closed"),
    (traj("<think> a </think> <python> print(1) </python>"), "python without result"),
    (traj("<think> a </think> <python> print(1) <result> 1 </result>"), "python never closed"),
    ("<think> a </think> <answer> E. H. Shepard </answer>", "no boxed in answer"),
    ("<think> a </think> <answer> \\boxed E. H. Shepard </answer>", "boxed without brace"),
    ("<think> \\boxed{E. H. Shepard} </think> <answer> Shepard </answer>", "boxed only outside answer"),
    ("<think> a </think> <answer> \\boxed{E. H. {Shepard} </answer>", "boxed never closed"),
  ],
)
def test_format_violations_give_minus_one(text, why):
  d = deep_research_details(text, "E. H. Shepard")
  assert d["score"] == -1.0 and not d["format_ok"], why
  assert deep_research(text, ["E. H. Shepard"]) == -1.0


def test_check_format_reasons_name_the_rule():
  assert check_format(GOOD) == (True, "format ok")
  assert "exactly one <answer>" in check_format("<think> a </think>")[1]
  assert "<python>" in check_format(traj("<think> a </think> <python> x </python>"))[1]


def test_last_boxed_inside_answer_decides():
  text = "<think> maybe \\boxed{wrong} </think> <answer> first \\boxed{Paris, Texas} then \\boxed{Paris} </answer>"
  d = deep_research_details(text, ["Paris"])
  assert d["extracted"] == "Paris" and d["score"] == 1.0


def test_nested_braces_in_boxed():
  text = "<think> x </think> <answer> \\boxed{\\frac{14}{3}} </answer>"
  assert deep_research_details(text, "\\frac{14}{3}")["extracted"] == "\\frac{14}{3}"


def test_token_f1_partial_credit():
  # pred tokens {eiffel, tower, in, paris}, gold {eiffel, tower}: P=1/2, R=1 -> F1=2/3.
  text = traj("<think> x </think>", answer="the Eiffel Tower in Paris")
  assert deep_research(text, "Eiffel Tower") == pytest.approx(2 / 3, abs=1e-12)


def test_f1_is_max_over_aliases():
  text = traj("<think> x </think>", answer="NYC")
  assert deep_research(text, ["New York City", "NYC", "Big Apple"]) == 1.0


def test_wrong_but_well_formatted_is_zero():
  assert deep_research(GOOD, "A. A. Milne") == 0.0


@pytest.mark.parametrize(
  "pred,gold,expected",
  [
    ("yes", "no", 0.0),
    ("no", "no", 1.0),
    ("yes it is", "yes", 0.0),
    ("yes", "yes indeed", 0.0),
    ("noanswer", "no answer", 0.0),
  ],
)
def test_yes_no_noanswer_rule(pred, gold, expected):
  assert deep_research(traj("<think> x </think>", answer=pred), gold) == expected


def test_math_is_scored_with_token_f1_not_equivalence():
  # spec §5 item 11: "025" vs "25" and "0.5" vs "1/2" get F1 0 in training.
  for pred, gold in [("025", "25"), ("0.5", "1/2")]:
    assert deep_research(traj("<think> x </think>", answer=pred), gold) == 0.0
  assert deep_research(traj("<think> x </think>", answer="70"), "70") == 1.0


def test_tool_bonus_needs_both_tools_and_a_nonzero_f1():
  both = traj("<think> a </think>", SEARCH, "<think> b </think>", PYTHON, "<think> c </think>", answer="176294")
  assert deep_research(both, "176294") == pytest.approx(1.1)
  assert deep_research(both, "1") == 0.0  # F1 = 0: no bonus
  partial = traj("<think> a </think>", SEARCH, PYTHON, "<think> c </think>", answer="176294 apples")
  assert deep_research(partial, "176294") == pytest.approx(2 / 3 + 0.1)
  only_python = traj("<think> a </think>", PYTHON, "<think> c </think>", answer="176294")
  assert deep_research(only_python, "176294") == 1.0


def test_bonus_tools_come_from_the_registry_or_the_caller():
  from aepo_jax.tools import reward_tags

  assert reward_tags() == ("search", "python")  # the official tools, in the official order of the format rules
  calc = "<calc>6*7</calc> <result>\n42\n</result>"
  both = traj("<think> a </think>", SEARCH, PYTHON, "<think> c </think>", answer="176294")
  assert deep_research(both, "176294", bonus_tools=("search", "python")) == deep_research(both, "176294")
  assert deep_research(both, "176294", bonus_tools=("calc",)) == 1.0  # calc not used
  with_calc = traj("<think> a </think>", calc, "<think> c </think>", answer="42")
  assert deep_research(with_calc, "42", bonus_tools=("calc",)) == pytest.approx(1.1)
  assert deep_research(with_calc, "42") == 1.0  # by default only the official tools earn the bonus
  assert deep_research(with_calc, "42", bonus_tools=()) == 1.0  # no bonus tools: no bonus
  assert check_format("<think> a </think><calc>1</calc><answer>\\boxed{1}</answer>", tools=("calc",))[1] == (
    "a <calc> is not followed by </calc>, <result>, </result>"
  )


def test_hostile_long_input_is_linear():
  import time

  text = "<think>" * 1 + "</think>" + "<answer>" + "\\boxed{" * 200_000 + "x" + "</answer>"
  t0 = time.perf_counter()
  assert deep_research(text, "x") == -1.0
  assert time.perf_counter() - t0 < 20.0  # linear: well under 1 s; 10x the old 2 s bound for a loaded machine


TAGS = [
  "<think>",
  "</think>",
  "<answer>",
  "</answer>",
  "<search>",
  "</search>",
  "<python>",
  "</python>",
  "<result>",
  "</result>",
  "\\boxed{",
  "}",
  "{",
  " Paris ",
  " yes ",
  "x",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(TAGS), max_size=30))
def test_range_is_minus_one_or_zero_to_one_point_one(parts):
  s = deep_research("".join(parts), ["Paris", "yes"])
  assert s == -1.0 or 0.0 <= s <= 1.1 + 1e-12
