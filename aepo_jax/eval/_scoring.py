"""Scoring one evaluation answer, recording which scorer decided (spec §2.5).

  math (aime24/25, math500, gsm8k, math):   math_equal on the extracted answer (math-verify, integers compared
                                             as integers, so AIME's "025" == "25")          scorer 'math_verify'
  qa (hotpotqa, 2wiki, musique, bamboogle):  with a judge, as deep search (the official evaluation); without one,
                                             exact match over the aliases OR math_equal      scorer 'em' | 'math_equal'
                                             EM and token F1 are recorded either way
  deep_search (gaia, hle, webwalker, xbench, simpleqa): math_equal OR the LLM judge (official evaluation)
                                                                                 scorer 'math_equal' | 'judge'
                                       (without a judge, library use only: exact match, scorer 'em_no_judge')
A judge call that fails (timeout, HTTP 5xx after retries, an unparsable verdict) or gives no verdict within
`judge_timeout_s` is recorded on the example (`judge_error`, scorer 'judge_failed', score 0) and does not stop the
run; a resumed run judges it again.
Extraction, math equivalence, EM and F1 run as one item in a `RewardPool` worker (`rewards.shared_pool()` unless a
pool is given), so a hostile answer costs at most `timeout_s`: it is then scored 0 with scorer 'timeout' and the
reason in `score_error`.
`judge_qa=False` scores the QA sets by EM even when a judge is given (offline, the numbers the QA literature
reports), a deliberate difference from the official evaluation.

The above is `protocol='project'`. `protocol='official'` scores as the official ARPO/AEPO evaluator does
(`evaluation/src/evaluator.py`, re-implemented in `aepo_jax.rewards._official`): the official prediction (the
`<answer>` block's box, else the last box, else the output's last 5 lines), the official metrics em, acc, f1,
math_equal (Hendrycks `is_equiv` on normalised answers, so "3.0" != "3" and "025" != "25"), python/search calls,
tool counts and output length; with a judge, every set (math too, as evaluate_passk.sh runs them all with
--use_llm) gets `llm_equal = is_equiv(pred, gold) OR <the official reading of the official judge's reply>`.
The score is llm_equal with a judge, else math_equal (math) or token F1 (qa: every non-math set); `correct` is
score == 1. A judge failure falls back to `is_equiv` as officially (scorer 'llm_equal_fallback') and is recorded
in `judge_error`, so a resumed run judges it again. Every record says which protocol scored it (`protocol`).
"""

from __future__ import annotations

import json
import threading
import urllib.error
from typing import Optional

from aepo_jax.data import Example
from aepo_jax.rewards import _official as official
from aepo_jax.rewards import (
  JudgeClient,
  JudgeError,
  OpenAICompatibleJudge,
  RewardPool,
  answer_checks,
  extract_answer,
  shared_pool,
)


class JudgeUnavailableError(RuntimeError):
  """The judge endpoint did not answer the health probe; raised before any compute."""


PROTOCOLS = ("official", "project")


def _blank_record(protocol: str, *, extracted: str = "", score_error=None) -> dict:
  """The fields every scored record has, before a scorer fills them: wrong until shown right."""
  return {
    "protocol": protocol,
    "extracted": extracted,
    "score": 0.0,
    "correct": False,
    "scorer": "",
    "em": None,
    "f1": None,
    "judge": None,
    "judge_error": None,
    "score_error": score_error,
  }


def probe_judge(base_url: str, model: str, *, timeout_s: float = 10.0) -> None:
  """One tiny chat completion that must come back with a verdict, else JudgeUnavailableError: "Correct" or
  "Incorrect" by the project's strict rule, or a reply the official rule reads as correct ("The prediction is
  Correct.": a judge for the official protocol need not be terse).

  Runs before the policy is loaded so a wrong URL or model name costs seconds, not an evaluation.
  """
  from aepo_jax.rewards import format_judge_prompt, parse_verdict

  probe = OpenAICompatibleJudge(base_url, model, timeout=timeout_s, retries=0)
  try:
    reply = probe.complete(format_judge_prompt("What is 1 + 1?", "2", "2"))
    try:
      parse_verdict(reply)
    except JudgeError:
      if not official.reply_is_correct(reply):
        raise
  except (JudgeError, urllib.error.URLError, OSError, json.JSONDecodeError) as e:
    raise JudgeUnavailableError(
      f"the judge at {base_url} (model {model!r}) did not answer a health probe ({e}); start the server, or fix "
      "--judge-url / --judge-model (the URL is the OpenAI base, e.g. http://127.0.0.1:8000/v1)."
    ) from e


class Scorer:
  """score(example, response_text) -> dict with score, correct, scorer, extracted, em, f1, judge, judge_error,
  score_error.

  timeout_s bounds the offline checks of one answer (a pool item); judge_timeout_s bounds the judge's time on one
  example, all its retries together.
  """

  def __init__(
    self,
    judge: Optional[JudgeClient] = None,
    *,
    judge_qa: bool = True,
    pool: Optional[RewardPool] = None,
    timeout_s: float = 10.0,
    judge_timeout_s: float = 300.0,
    protocol: str = "project",
  ):
    if protocol not in PROTOCOLS:
      raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    self.judge, self.judge_qa, self.protocol = judge, judge_qa, protocol
    self._pool, self.timeout_s, self.judge_timeout_s = pool, timeout_s, judge_timeout_s

  def _checks(self, response_text: str, answers: list, prediction=None) -> tuple[Optional[dict], Optional[str]]:
    pool = self._pool if self._pool is not None else shared_pool()
    item = (response_text, answers) + (() if prediction is None else (prediction,))
    res = pool.map_results(answer_checks, [item], timeout_s=self.timeout_s)[0]
    return (res.value, None) if res.status == "ok" else (None, f"{res.status}: {res.error}")

  def _judge(self, question: str, answers, pred: str, *, reply: bool = False):
    """The judge's verdict (reply=True: its raw reply when the judge gives one, `OfficialJudge.reply`) within
    judge_timeout_s, else TimeoutError (the call is left to finish on its own)."""
    box: list = []

    def call():
      try:
        if reply and hasattr(self.judge, "reply"):
          box.append(("ok", str(self.judge.reply(question, answers, pred))))
        else:
          box.append(("ok", bool(self.judge.judge(question, answers, pred))))
      except Exception as e:  # noqa: BLE001 -- handed to the caller
        box.append(("error", e))

    worker = threading.Thread(target=call, name="judge", daemon=True)
    worker.start()
    worker.join(self.judge_timeout_s)
    if not box:
      raise TimeoutError(f"the judge gave no verdict within {self.judge_timeout_s:g} s")
    status, value = box[0]
    if status == "error":
      raise value
    return value

  def score(self, example: Example, response_text: str, prediction: Optional[str] = None) -> dict:
    """prediction: the answer to score when it is not the one extracted from response_text (the official
    timeout record's "Timeout", `TIMEOUT_PREDICTION`)."""
    if self.protocol == "official":
      return self._score_official(example, response_text, prediction)
    answers = list(example.answers)
    checks, error = self._checks(response_text, answers, prediction)
    fallback = extract_answer(response_text) if prediction is None else prediction
    out = _blank_record("project", extracted=checks["extracted"] if checks else fallback, score_error=error)
    if checks is None:  # the answer took over timeout_s to check (or crashed its worker): wrong, and said why
      out.update(scorer="timeout" if error.startswith("timeout") else "score_failed")
      return out
    pred, math_ok = checks["extracted"], checks["math_ok"]
    fam = example.family
    if fam == "math":
      out.update(correct=math_ok, scorer="math_verify")
    elif fam == "qa" and not (self.judge_qa and self.judge is not None):
      em = checks["em"]
      out.update(
        em=float(em), f1=checks["f1"], correct=em or math_ok, scorer="em" if em or not math_ok else "math_equal"
      )
    else:  # deep search (and QA with judge_qa): judge OR math equivalence
      if fam == "qa":
        out.update(em=float(checks["em"]), f1=checks["f1"])
      if math_ok or not pred:
        out.update(correct=math_ok, scorer="math_equal")
      elif self.judge is None:  # library use without a judge (the CLI refuses this before compute)
        out.update(correct=checks["em"], scorer="em_no_judge")
      else:
        try:
          verdict = self._judge(example.question, answers, pred)
          out.update(correct=verdict, judge=verdict, scorer="judge")
        except Exception as e:  # noqa: BLE001 -- a transient judge failure is recorded per example
          out.update(correct=False, scorer="judge_failed", judge_error=f"{type(e).__name__}: {e}")
    out["score"] = float(out["correct"])
    return out

  def _score_official(self, example: Example, response_text: str, prediction: Optional[str] = None) -> dict:
    """The official evaluator's metrics of one response (see the module docstring)."""
    ref, task = official.official_reference(example.source, example.answers), official.task_of(example.family)
    pool = self._pool if self._pool is not None else shared_pool()
    item = (response_text, ref, task) + (() if prediction is None else (prediction,))
    res = pool.map_results(official.answer_checks, [item], timeout_s=self.timeout_s)[0]
    out = _blank_record("official", score_error=None if res.status == "ok" else f"{res.status}: {res.error}")
    if res.status != "ok":
      out.update(scorer="timeout" if res.status == "timeout" else "score_failed")
      return out
    m = dict(res.value)
    out.update(m)
    out.update(em=float(m["em"]), f1=float(m["f1"]))
    pred = m["prediction"]
    if self.judge is not None:
      out.update(llm_equal=0, llm_response=None, scorer="llm_equal")
      if m["is_valid_answer"]:
        try:
          verdict = self._judge(example.question, ref, pred, reply=True)
          if isinstance(verdict, str):  # the raw reply: the official reading
            out.update(llm_response=verdict, judge=official.reply_is_correct(verdict))
          else:  # a JudgeClient that only gives a verdict
            out.update(judge=bool(verdict))
          out["llm_equal"] = int(official.is_equiv(pred, ref) or out["judge"])
        except Exception as e:  # noqa: BLE001 -- the official fallback: is_equiv; judged again on resume
          out.update(
            llm_equal=int(official.llm_equal(pred, ref, None)),
            llm_response="Error",
            scorer="llm_equal_fallback",
            judge_error=f"{type(e).__name__}: {e}",
          )
      out["score"] = float(out["llm_equal"])
    elif task == "math":
      out.update(score=float(m["math_equal"]), scorer="math_equal")
    else:
      out.update(score=float(m["f1"]), scorer="f1")
    out["correct"] = out["score"] >= 1.0
    return out


def needs_rescore(record: dict) -> bool:
  """A stored example whose judge call failed: a resumed run scores it again."""
  return bool(record.get("judge_error"))
