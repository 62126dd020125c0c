"""The official judge (llm_evaluator_sds.py) and the official extraction / QA metrics (utils.py, metrics.py) against
expectations produced by running the official code itself (github.com/dongguanting/ARPO, evaluation/src; the
judge's `LLMEvaluator.evaluate` driven by a fake OpenAI client returning each reply)."""

import hashlib
import json

import pytest

from aepo_jax.rewards import _official as official
from aepo_jax.rewards import parse_verdict

# (judge reply, the official verdict for gold "Paris" / prediction "London": is_equiv is False, the reply decides)
REPLIES = [
  ('Correct', True),
  ('Incorrect', False),
  ('correct', True),
  ('CORRECT', True),
  ('The prediction is Correct.', True),
  ('Not correct', False),
  ('not correct.', False),
  ('Correct? No, it is wrong.', False),
  ('Wrong', False),
  ('The answer is correct.', True),
  ('<judgment>Correct</judgment>', True),
  ('<judgment>Incorrect</judgment>', False),
  ('The golden answer says X. <judgment>correct</judgment> it is incorrect elsewhere', True),
  ('<judgment>Correct', True),
  ('Correctly identified', True),
  ('Yes', False),
  ('No', False),
  ('', False),
  ('  Correct  ', True),
  ('**Correct**', True),
  ('Correct, but the year is wrong', False),
  ('The predicted answer is right.', False),
  ('uncorrected', True),
  ('<judgment></judgment> Correct', False),
  ("I think it's correct.\n<judgment>Wrong</judgment>", False),
  ('incorrect', False),
  ('The answer is Correct. Incorrectly formatted though.', False),
]

OFFICIAL_PROMPT_SHA256 = "bf2a3802ccf538ad39cefd2220a67dc73e77dcf186df4dd8da6ffd9bd6853e48"  # 450 bytes


def test_enough_replies():
  assert len(REPLIES) >= 20


@pytest.mark.parametrize("reply,verdict", REPLIES)
def test_official_reading_of_the_reply(reply, verdict):
  assert official.reply_is_correct(reply) is verdict
  assert official.llm_equal("London", "Paris", reply) is verdict


def test_the_training_judge_keeps_its_strict_rule():
  assert parse_verdict("Correct") is True
  assert parse_verdict("The prediction is Correct.") is False  # officially correct; strict here
  assert official.reply_is_correct("The prediction is Correct.") is True
  assert parse_verdict("Correct, but the year is wrong") is False


def test_prompt_is_byte_equal():
  assert hashlib.sha256(official.EVALUATION_PROMPT.encode()).hexdigest() == OFFICIAL_PROMPT_SHA256
  assert official.EVALUATION_PROMPT.startswith(
    "Given a Question and its Golden Answer, verify whether the Predicted Answer is correct. "
  )
  shown = official.format_prompt("Q", ["a", "b"], "p")
  assert shown.endswith("\n\nQuestion: Q\nGolden Answer: ['a', 'b']\nPredicted Answer: p\n")


def test_llm_equal_is_is_equiv_or_judge():
  assert official.llm_equal("0.5", "\\frac{1}{2}", "Incorrect")  # is_equiv decides first
  assert not official.llm_equal("Paris", ["Paris"], "Incorrect")  # a list of aliases never is_equiv a string
  assert official.llm_equal("Paris", "Paris", None)  # the judge failed: the official fallback is is_equiv
  assert not official.llm_equal("London", "Paris", None)


def test_official_request_sends_no_temperature_nor_max_tokens(monkeypatch):
  from aepo_jax.tools import _llm

  sent = []

  def fake(method, url, data=None, headers=None, timeout_s=None):
    sent.append(json.loads(data))
    return 200, json.dumps({"choices": [{"message": {"content": " The prediction is Correct. "}}]}).encode()

  monkeypatch.setattr(_llm, "http_request", fake)
  judge = official.OfficialJudge("http://127.0.0.1:1/v1", "Qwen2.5-72B-Instruct")
  assert judge.reply("Q?", ["Paris"], "Paris!") == "The prediction is Correct."
  assert judge.judge("Q?", ["Paris"], "Paris!") is True
  assert sorted(sent[0]) == ["messages", "model"]
  assert sent[0]["messages"] == [{"role": "user", "content": official.format_prompt("Q?", ["Paris"], "Paris!")}]
  assert judge._client.retries + 1 == official.JUDGE_RETRY_LIMIT == 3


# (output, the official extract_answer)
EXTRACT = [
  ('<think>x</think><answer>\\boxed{18}</answer>', '18'),
  ('<answer>The answer is \\boxed{\\text{Paris}}.</answer>', 'Paris'),
  ('<answer> Frank Lowy </answer>', ' Frank Lowy '),
  ('no tags \\boxed{3} then \\boxed{4}', '4'),
  ('<answer></answer> \\boxed{7}', '7'),
  ('<answer> </answer>', ' '),
  ('<answer>\\fbox{5}</answer>', '\\fbox{5}'),
  ('<answer>\\boxed{1</answer>', '\\boxed{1'),
  ('<answer>a</answer> text <answer>b</answer>', 'b'),
  ('plain text without answer', ''),
  ('<answer>\\boxed{\\frac{1}{2}}</answer>', '\\frac{1}{2}'),
  ('\\boxed{unclosed', '\\boxed{unclosed'),
]


@pytest.mark.parametrize("output,expected", EXTRACT)
def test_official_extraction(output, expected):
  assert official.extract_answer(output) == expected


# (prediction, references as the official data holds them, official evaluate_qa_prediction)
QA = [
  ('Frank Lowy', ['Frank Lowy'], {'em': 1, 'acc': 1, 'f1': 1.0, 'math_equal': 1}),
  ('The Frank Lowy', ['Frank Lowy'], {'em': 1, 'acc': 1, 'f1': 1.0, 'math_equal': 1}),
  ('Lowy', ['Frank Lowy'], {'em': 0, 'acc': 0, 'f1': 0.6666666666666666, 'math_equal': 0}),
  (
    'Frank Lowy, an Australian businessman',
    ['Frank Lowy'],
    {'em': 0, 'acc': 1, 'f1': 0.3333333333333333, 'math_equal': 0},
  ),
  ('frank lowy.', ['Frank Lowy'], {'em': 0, 'acc': 1, 'f1': 0.5, 'math_equal': 0}),
  ('yes', ['no'], {'em': 0, 'acc': 0, 'f1': 0, 'math_equal': 0}),
  ('2', ['two', '2'], {'em': 1, 'acc': 1, 'f1': 1.0, 'math_equal': 1}),
  ('Paris', '[Paris, London]', {'em': 1, 'acc': 1, 'f1': 1.0, 'math_equal': 1}),
  ('London', "['Paris', 'London']", {'em': 0, 'acc': 0, 'f1': 0, 'math_equal': 0}),
  ('', ['x'], {'em': 0, 'acc': 0, 'f1': 0, 'math_equal': 0}),
  ('the United States', 'United States of America', {'em': 0, 'acc': 0, 'f1': 0.6666666666666666, 'math_equal': 0}),
]


@pytest.mark.parametrize("pred,refs,expected", QA)
def test_official_qa_metrics(pred, refs, expected):
  assert official.evaluate_qa_prediction(pred, refs) == expected


def test_sample_metrics_and_the_empty_prediction_fallback():
  out = "<search>q</search><result>Paris is big</result>I think\n\nit is Paris"
  m = official.sample_metrics(out, ["Paris"], "qa")
  # no <answer> and no box: the official prediction is the last 5 lines of the output
  assert m["prediction"] == "<search>q</search><result>Paris is big</result>I think\nit is Paris"
  assert (m["search_calls"], m["python_calls"], m["tool_counts"], m["tools_used"]) == (1, 0, 1, "search")
  assert m["output_length"] == len("<search>q</search>I think\n\nit is Paris")
  assert m["acc"] == 1 and m["em"] == 0
  empty = official.sample_metrics("", "3", "math")
  assert empty["is_valid_answer"] is False and empty["math_equal"] == 0 and empty["output_length"] == 0
  m = official.sample_metrics("<python>1</python><result>2</result><answer>\\boxed{025}</answer>", "025", "math")
  assert (m["math_equal"], m["em"], m["tools_used"], m["prediction"]) == (1, 1, "python", "025")
  assert official.sample_metrics("<answer>\\boxed{25}</answer>", "025", "math")["math_equal"] == 0
  assert official.count_valid_tags("<python>a</python><python>b", "python") == 1
  keys = list(official.sample_metrics("<python>1</python><result>2</result>x", "2", "math"))
  assert keys[:5] == ["is_valid_answer", "python_calls", "search_calls", "tools_used", "tool_counts"]  # official order
  m = official.sample_metrics("<calc>1</calc><result>2</result>x", "2", "math", tools=("calc", "python"))
  assert (m["calc_calls"], m["python_calls"], m["tools_used"], m["tool_counts"]) == (1, 0, "calc", 1)
  assert official.official_reference("hotpotqa", ["Frank Lowy"]) == ["Frank Lowy"]
  assert official.official_reference("gaia", ["x"]) == "x"
  assert official.task_of("math") == "math" and official.task_of("deep_search") == "qa"
