"""Math equivalence for evaluation (spec §2.5): `math-verify` plus fast exact paths.

Used for the math benchmarks and OR'ed with the judge on QA sets. Not part of the training reward.
math-verify guards its sympy work with SIGALRM timeouts, which only work in a main thread: call it
from a `RewardPool` worker (or the main thread), never from a thread pool.
"""

from __future__ import annotations

import re

_INT = re.compile(r"[+-]?\d{1,3}(,\d{3})+|[+-]?\d+")  # "1,000" or "025"
_WRAPPERS = ("\\boxed{", "\\text{", "\\mathrm{", "\\textbf{")


def _closes_at_end(s: str, open_idx: int) -> bool:
  """The brace opened at `open_idx` is closed by the last character (so `\\boxed{a}+\\boxed{b}` is not one box)."""
  depth = 0
  for i in range(open_idx, len(s)):
    depth += {"{": 1, "}": -1}.get(s[i], 0)
    if depth == 0:
      return i == len(s) - 1
  return False


def _unwrap(s: str) -> str:
  s = s.strip().strip("$").strip()
  changed = True
  while changed:
    changed = False
    for w in _WRAPPERS:
      if s.startswith(w) and _closes_at_end(s, len(w) - 1):
        s, changed = s[len(w) : -1].strip(), True
  return s


def _canon_int(s: str) -> str | None:
  """Canonical digit string of an integer literal (no int(): 10^5-digit strings stay cheap)."""
  if not _INT.fullmatch(s):
    return None
  sign = "-" if s.startswith("-") else ""
  digits = s.lstrip("+-").replace(",", "").lstrip("0") or "0"
  return digits if digits == "0" else sign + digits


def math_equal(prediction: str, ground_truth: str | int, *, timeout_s: int = 5) -> bool:
  """True when `prediction` equals `ground_truth` mathematically.

  Integer strings compare as integers ("025" == "25" == "+25", "1,000" == "1000": AIME answers
  carry leading zeros); otherwise both sides go through math-verify (fractions, LaTeX, sets,
  intervals, `\\text{}` units), each parsed as inline LaTeX so bare LaTeX like
  `\\left( 3, \\frac{\\pi}{2} \\right)` is read whole.
  """
  pred, gold = _unwrap(str(prediction)), _unwrap(str(ground_truth))
  if not pred or not gold:
    return False
  if pred == gold:
    return True
  pi, gi = _canon_int(pred), _canon_int(gold)
  if pi is not None and gi is not None:
    return pi == gi
  from math_verify import parse, verify  # lazy: pulls sympy (~0.5 s)

  gold_parsed = parse(f"${gold}$", parsing_timeout=timeout_s)
  pred_parsed = parse(f"${pred}$", parsing_timeout=timeout_s)
  if not gold_parsed or not pred_parsed:
    return False
  return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))
