"""SQuAD/HotpotQA-style answer normalisation, exact match and token F1 (max over aliases)."""

from __future__ import annotations

import collections
import re
import string
from typing import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
_SPECIAL = ("yes", "no", "noanswer")


def normalize_answer(s: str) -> str:
  """Lower-case, drop ASCII punctuation, drop articles, collapse whitespace (SQuAD v1.1 order)."""
  s = s.lower().translate(_PUNCT)
  s = _ARTICLES.sub(" ", s)
  return " ".join(s.split())


def _as_list(ground_truths: str | Sequence[str]) -> list[str]:
  if isinstance(ground_truths, str):
    return [ground_truths]
  out = [str(g) for g in ground_truths]
  if not out:
    raise ValueError("ground_truths is empty: pass at least one reference answer")
  return out


def _f1_single(prediction: str, ground_truth: str) -> float:
  pred, gold = normalize_answer(prediction), normalize_answer(ground_truth)
  # HotpotQA rule: a yes/no/noanswer on either side only scores when both are identical.
  if (pred in _SPECIAL or gold in _SPECIAL) and pred != gold:
    return 0.0
  pred_toks, gold_toks = pred.split(), gold.split()
  common = collections.Counter(pred_toks) & collections.Counter(gold_toks)
  num_same = sum(common.values())
  if num_same == 0:
    return 0.0
  precision = num_same / len(pred_toks)
  recall = num_same / len(gold_toks)
  return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, ground_truths: str | Sequence[str]) -> float:
  """Token F1 after `normalize_answer`, maximum over the ground-truth aliases."""
  return max(_f1_single(prediction, g) for g in _as_list(ground_truths))


def exact_match(prediction: str, ground_truths: str | Sequence[str]) -> bool:
  """Normalised exact match against any alias."""
  pred = normalize_answer(prediction)
  return any(pred == normalize_answer(g) for g in _as_list(ground_truths))
