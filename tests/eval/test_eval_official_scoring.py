"""`Scorer(protocol='official')`: the official evaluator's per-sample metrics and judge rule on the same responses
the project protocol scores, the official fallbacks (empty prediction -> the last lines; a failed judge ->
is_equiv), and records that name their protocol. Expected values follow evaluation/src of the official repository
(tests/rewards/test_official_*.py check the functions against the official code itself)."""

import pytest

from aepo_jax.data import Example
from aepo_jax.eval import Scorer
from aepo_jax.eval._report import official_overall, summarize_records, summary_markdown
from aepo_jax.eval._scoring import needs_rescore
from aepo_jax.rewards import PoolResult, official


def _ex(family, answers, source="x", q="Q?"):
  return Example("x:1", q, answers, source, family)


def _ans(text):
  return f"<think>...</think><python>1</python><result>1</result><answer>\\boxed{{{text}}}</answer>"


class ReplyJudge:
  """An official-style judge: the raw reply."""

  def __init__(self, reply="Correct", fail=False):
    self.text, self.fail, self.calls = reply, fail, []

  def reply(self, question, labeled, predicted):
    self.calls.append((question, labeled, predicted))
    if self.fail:
      raise TimeoutError("judge timed out")
    return self.text


@pytest.mark.parametrize(
  "pred,gold,official_ok,project_ok",
  [
    ("3.0", "3", False, True),
    ("25", "025", False, True),
    ("1,000", "1000", False, True),
    ("\\dfrac{1}{2}", "0.5", True, True),
    ("I", "i", True, False),
    ("7", "8", False, False),
  ],
)
def test_math_official_vs_project(pred, gold, official_ok, project_ok):
  off = Scorer(protocol="official").score(_ex("math", [gold]), _ans(pred))
  proj = Scorer().score(_ex("math", [gold]), _ans(pred))
  assert (off["protocol"], off["scorer"], off["correct"], off["math_equal"]) == (
    "official",
    "math_equal",
    official_ok,
    int(official_ok),
  )
  assert (proj["protocol"], proj["correct"]) == ("project", project_ok)
  assert (off["python_calls"], off["search_calls"], off["tool_counts"], off["tools_used"]) == (1, 0, 1, "python")
  assert off["output_length"] == len(_ans(pred).replace("<result>1</result>", ""))


def test_qa_without_judge_scores_token_f1():
  out = Scorer(protocol="official").score(_ex("qa", ["Frank Lowy"], source="hotpotqa"), _ans("Lowy"))
  assert out["scorer"] == "f1" and out["score"] == pytest.approx(2 / 3) and out["correct"] is False
  assert (out["em"], out["acc"]) == (0.0, 0)


def test_empty_prediction_is_judged_on_the_last_lines():
  judge = ReplyJudge("The prediction is Correct.")
  text = "line 1\nline 2\n\nline 3\nline 4\nline 5\nSo it is Paris"
  out = Scorer(judge, protocol="official").score(_ex("deep_search", ["Paris"], source="gaia"), text)
  assert out["extracted"] == "" and out["prediction"] == "line 2\nline 3\nline 4\nline 5\nSo it is Paris"
  assert judge.calls == [("Q?", "Paris", out["prediction"])]  # gaia's answer field is a string
  assert (out["scorer"], out["llm_equal"], out["correct"], out["judge"]) == ("llm_equal", 1, True, True)
  assert out["llm_response"] == "The prediction is Correct."
  project = Scorer(judge, protocol="project").score(_ex("deep_search", ["Paris"], source="gaia"), text)
  assert project["score"] == 0.0 and len(judge.calls) == 1  # no answer: 0 without a judge call


def test_list_answers_are_shown_as_lists_and_math_is_judged_too():
  judge = ReplyJudge("Incorrect")
  out = Scorer(judge, protocol="official").score(_ex("qa", ["Frank Lowy"], source="hotpotqa"), _ans("Frank Lowy"))
  assert judge.calls[-1][1] == ["Frank Lowy"]
  # is_equiv(pred, ['Frank Lowy']) is False (a list never equals a string): the judge's "Incorrect" decides
  assert (out["llm_equal"], out["em"], out["f1"]) == (0, 1.0, 1.0)
  out = Scorer(judge, protocol="official").score(_ex("math", ["18"], source="gsm8k"), _ans("18"))
  assert judge.calls[-1][1] == "18" and out["llm_equal"] == 1  # is_equiv OR judge


def test_a_plain_verdict_judge_works_too():
  class VerdictJudge:
    def judge(self, q, labeled, pred):
      return True

  out = Scorer(VerdictJudge(), protocol="official").score(_ex("deep_search", ["Paris"], source="gaia"), _ans("Rome"))
  assert (out["llm_equal"], out["judge"], out["llm_response"]) == (1, True, None)


def test_judge_failure_falls_back_to_is_equiv_and_is_rescored():
  judge = ReplyJudge(fail=True)
  ex = _ex("deep_search", ["Paris"], source="gaia")
  ok = Scorer(judge, protocol="official").score(ex, _ans("paris"))
  bad = Scorer(judge, protocol="official").score(ex, _ans("Rome"))
  assert (ok["scorer"], ok["llm_equal"], ok["llm_response"]) == ("llm_equal_fallback", 0, "Error")  # raw strings
  assert bad["llm_equal"] == 0 and "TimeoutError" in bad["judge_error"] and needs_rescore(bad)
  same = Scorer(judge, protocol="official").score(ex, _ans("Paris"))
  assert same["llm_equal"] == 1 and same["correct"] is True


def test_a_check_past_its_timeout_is_wrong_and_says_why():
  class TimedOutPool:
    def map_results(self, fn, items, timeout_s):
      assert fn is official.answer_checks and items[0][1:] == ("1", "math")
      return [PoolResult(None, "timeout", "over 0.5 s", 0.5)]

  out = Scorer(protocol="official", pool=TimedOutPool(), timeout_s=0.5).score(_ex("math", ["1"]), _ans("1"))
  assert (out["protocol"], out["score"], out["correct"], out["scorer"]) == ("official", 0.0, False, "timeout")
  assert out["score_error"] == "timeout: over 0.5 s"


def test_unknown_protocol_is_refused():
  with pytest.raises(ValueError, match="protocol"):
    Scorer(protocol="paper")


def test_report_names_the_protocol_and_gives_the_official_overall_metrics():
  judge = ReplyJudge("Correct")
  scorer = Scorer(judge, protocol="official")
  recs = []
  for i, (text, gold) in enumerate([(_ans("18"), "18"), (_ans("3.0"), "3"), ("no answer at all", "5")]):
    rec = {"id": f"q{i}", "sample": 0, "num_tool_calls": 0, "response_len": 10}
    rec.update(scorer.score(_ex("math", [gold], source="gsm8k"), text))
    recs.append(rec)
  s = summarize_records(recs, [1])
  assert s["protocol"] == "official"
  o = s["official"]
  assert o["math_equal"] == pytest.approx(1 / 3) and o["llm_equal"] == pytest.approx(1.0)
  assert o["num_valid_answer"] == "3 of 3" and o["tool_call"] == pytest.approx(2 / 3)
  assert o["average_datas_used_tool_number"] == pytest.approx(2 / 3)
  assert o["tool_productivity"] == pytest.approx(1.0 * (2 / 3) / (2 / 3 + 0.1) * 100)
  assert o == official_overall(recs)
  md = summary_markdown({"checkpoint": "c", "protocol": "official", "benchmarks": {"gsm8k": {**s, "family": "math"}}})
  assert "protocol: official" in md and "| gsm8k | 1.000" not in md and "Official metrics" in md
  proj = Scorer().score(_ex("math", ["18"]), _ans("18"))
  mixed = summarize_records(recs + [{"id": "q9", "sample": 0, **proj}], [1])
  assert mixed["protocol"] == "mixed: official,project" and "official" not in mixed


def test_the_health_probe_accepts_a_verbose_judge_but_not_a_wrong_one():
  from aepo_jax.eval._scoring import JudgeUnavailableError, probe_judge
  from aepo_jax.testing import chat_server

  with chat_server(lambda body: "The prediction is Correct.") as (url, requests):
    probe_judge(url, "m")
  assert len(requests) == 1
  with chat_server(lambda body: "I cannot say.") as (url, _):
    with pytest.raises(JudgeUnavailableError, match="health probe"):
      probe_judge(url, "m")
