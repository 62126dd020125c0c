"""Evaluation-time correctness (spec §2.5): math sets by `math_equal`; QA and deep-search sets by
the LLM judge OR'ed with `math_equal`. Training uses `deep_research` instead (spec §4)."""

from __future__ import annotations

from typing import Optional, Sequence

from aepo_jax.rewards._extract import extract_answer
from aepo_jax.rewards._judge import JudgeClient
from aepo_jax.rewards._math import math_equal
from aepo_jax.rewards._qa import exact_match, f1_score

FAMILIES = ("math", "qa", "deep_search")


def answer_checks(response_text: str, answers: Sequence[str], prediction: Optional[str] = None) -> dict:
  """Everything evaluation decides without a judge, in one call (one `RewardPool` item, so a
  hostile answer costs one timeout however many aliases it has): the extracted answer (or the given
  `prediction`: a timed-out sample's "Timeout"), math equivalence to any alias, exact match and token F1
  over the aliases."""
  pred = extract_answer(response_text) if prediction is None else prediction
  answers = [answers] if isinstance(answers, str) else [str(a) for a in answers]
  if not pred or not answers:
    return {"extracted": pred, "math_ok": False, "em": False, "f1": 0.0}
  return {
    "extracted": pred,
    "math_ok": any(math_equal(pred, a) for a in answers),
    "em": bool(exact_match(pred, answers)),
    "f1": float(f1_score(pred, answers)),
  }


def eval_correct(
  response_text: str, answers: Sequence[str], family: str, *, question: str = "", judge: JudgeClient | None = None
) -> bool:
  """Whether one evaluation response is correct under the official protocol.

  Without a judge, QA and deep-search answers fall back to `math_equal` OR normalised exact match
  (say so when reporting: the official numbers use a judge).
  """
  if family not in FAMILIES:
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
  pred = extract_answer(response_text)
  if not pred:
    return False
  if any(math_equal(pred, a) for a in answers):
    return True
  if family == "math":
    return False
  if judge is None:
    return exact_match(pred, list(answers))
  return judge.judge(question, list(answers), pred)
