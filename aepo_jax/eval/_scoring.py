"""Scoring one evaluation answer, recording which scorer decided (spec §2.5).

  math (aime24/25, math500, gsm8k, math):   math_equal on the extracted answer (math-verify, integers compared
                                             as integers, so AIME's "025" == "25")          scorer 'math_verify'
  qa (hotpotqa, 2wiki, musique, bamboogle):  exact match over the aliases OR math_equal; token F1 recorded too
                                                                                            scorer 'em' | 'math_equal'
  deep_search (gaia, hle, webwalker, xbench, simpleqa): math_equal OR the LLM judge (official evaluation)
                                                                                 scorer 'math_equal' | 'judge'
                                       (without a judge, library use only: exact match, scorer 'em_no_judge')
A judge call that fails (timeout, HTTP 5xx after retries, an unparsable verdict) is recorded on the example
(`judge_error`, scorer 'judge_failed', score 0) and does not stop the run; a resumed run judges it again.
Deliberate difference: the official evaluation also judges the QA sets; we use EM/F1 there (offline, and the
numbers the QA literature reports), unless `judge_qa=True`.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Optional

from aepo_jax.data import Example
from aepo_jax.rewards import JudgeClient, JudgeError, OpenAICompatibleJudge, exact_match, extract_answer, f1_score
from aepo_jax.rewards import math_equal


class JudgeUnavailableError(RuntimeError):
  """The judge endpoint did not answer the health probe; raised before any compute."""


def probe_judge(base_url: str, model: str, *, timeout_s: float = 10.0) -> None:
  """One tiny chat completion that must come back with a Correct/Incorrect verdict, else JudgeUnavailableError.

  Runs before the policy is loaded so a wrong URL or model name costs seconds, not an evaluation.
  """
  probe = OpenAICompatibleJudge(base_url, model, timeout=timeout_s, retries=0)
  try:
    probe.judge("What is 1 + 1?", "2", "2")
  except (JudgeError, urllib.error.URLError, OSError, json.JSONDecodeError) as e:
    raise JudgeUnavailableError(
        f"the judge at {base_url} (model {model!r}) did not answer a health probe ({e}); start the server, or fix "
        "--judge-url / --judge-model (the URL is the OpenAI base, e.g. http://127.0.0.1:8000/v1).") from e


class Scorer:
  """score(example, response_text) -> dict with score, correct, scorer, extracted, em, f1, judge, judge_error."""

  def __init__(self, judge: Optional[JudgeClient] = None, *, judge_qa: bool = False):
    self.judge, self.judge_qa = judge, judge_qa

  def score(self, example: Example, response_text: str) -> dict:
    pred = extract_answer(response_text)
    out = {"extracted": pred, "score": 0.0, "correct": False, "scorer": "", "em": None, "f1": None,
           "judge": None, "judge_error": None}
    answers = list(example.answers)
    math_ok = bool(pred) and any(math_equal(pred, a) for a in answers)
    fam = example.family
    if fam == "math":
      out.update(correct=math_ok, scorer="math_verify")
    elif fam == "qa" and not (self.judge_qa and self.judge is not None):
      em = bool(pred) and exact_match(pred, answers)
      out.update(em=float(em), f1=float(f1_score(pred, answers)) if pred else 0.0, correct=em or math_ok,
                 scorer="em" if em or not math_ok else "math_equal")
    else:  # deep search (and QA with judge_qa): judge OR math equivalence
      if fam == "qa":
        out.update(em=float(bool(pred) and exact_match(pred, answers)),
                   f1=float(f1_score(pred, answers)) if pred else 0.0)
      if math_ok or not pred:
        out.update(correct=math_ok, scorer="math_equal")
      elif self.judge is None:  # library use without a judge (the CLI refuses this before compute)
        em = exact_match(pred, answers)
        out.update(correct=em, scorer="em_no_judge")
      else:
        try:
          verdict = bool(self.judge.judge(example.question, answers, pred))
          out.update(correct=verdict, judge=verdict, scorer="judge")
        except Exception as e:  # noqa: BLE001 -- a transient judge failure is recorded per example
          out.update(correct=False, scorer="judge_failed", judge_error=f"{type(e).__name__}: {e}")
    out["score"] = float(out["correct"])
    return out


def needs_rescore(record: dict) -> bool:
  """A stored example whose judge call failed: a resumed run scores it again."""
  return bool(record.get("judge_error"))
