"""The deep-research reward of ARPO/AEPO (spec §1.6, official `deep_research.py::compute_score`).

reward = -1 on any format violation or when no `\\boxed{}` can be extracted from the answer span;
otherwise F1 = token-F1 (max over aliases) of the boxed answer, plus 0.1 when F1 > 0 and the
response contains both `</search>` and `</python>`. Range {-1} ∪ [0, 1.1]. Math is scored with
token-F1 too (spec §5 item 11): use `math_equal` only for evaluation.
"""

from __future__ import annotations

from typing import Sequence

from aepo_jax.rewards._extract import extract_boxed
from aepo_jax.rewards._qa import f1_score

FORMAT_PENALTY = -1.0
TOOL_BONUS = 0.1


def _tool_blocks_ordered(text: str, tool: str) -> bool:
  """Every `<tool>` is followed, in order, by `</tool>`, `<result>`, `</result>` (spec §1.6.1)."""
  open_tag, close_tag = f"<{tool}>", f"</{tool}>"
  pos = 0
  while True:
    start = text.find(open_tag, pos)
    if start < 0:
      return True
    close = text.find(close_tag, start)
    res = text.find("<result>", start)
    res_end = text.find("</result>", res) if res >= 0 else -1
    if -1 in (close, res, res_end) or not (start < close < res < res_end):
      return False
    pos = res_end


def check_format(text: str) -> tuple[bool, str]:
  """(ok, reason) for the format rules of spec §1.6.1, checked in the official order."""
  n_think, n_think_end = text.count("<think>"), text.count("</think>")
  if n_think != n_think_end:
    return False, "<think> and </think> counts differ"
  if n_think == 0:
    return False, "no <think> ... </think> block"
  if text.count("<answer>") != 1 or text.count("</answer>") != 1:
    return False, "need exactly one <answer> and one </answer>"
  if not _tool_blocks_ordered(text, "search"):
    return False, "a <search> is not followed by </search>, <result>, </result>"
  if not _tool_blocks_ordered(text, "python"):
    return False, "a <python> is not followed by </python>, <result>, </result>"
  start, end = text.find("<answer>"), text.find("</answer>")
  if start > end:
    return False, "</answer> comes before <answer>"
  span = text[start:end]
  if "\\boxed{" not in span or "}" not in span:
    return False, "the answer span has no \\boxed{...}"
  return True, "format ok"


def deep_research_details(response_text: str, ground_truths: str | Sequence[str]) -> dict:
  """The §1.6 reward with its breakdown: score, format_ok, reason, extracted (boxed text), f1."""
  ok, reason = check_format(response_text)
  if not ok:
    return dict(score=FORMAT_PENALTY, format_ok=False, reason=reason, extracted=None, f1=0.0)
  start, end = response_text.find("<answer>"), response_text.find("</answer>")
  extracted = extract_boxed(response_text[start + len("<answer>") : end])
  if extracted is None:
    return dict(score=FORMAT_PENALTY, format_ok=False, reason="\\boxed{ is never closed", extracted=None, f1=0.0)
  f1 = f1_score(extracted, ground_truths)
  used_both = "</search>" in response_text and "</python>" in response_text
  score = f1 + TOOL_BONUS if (f1 > 0 and used_both) else f1
  reason = "correct" if f1 == 1.0 else ("partial" if f1 > 0 else "wrong answer, good format")
  return dict(score=score, format_ok=True, reason=reason, extracted=extracted, f1=f1)


def deep_research(response_text: str, ground_truths: str | Sequence[str]) -> float:
  """Scalar reward of spec §1.6 for one decoded response (tool results included)."""
  return float(deep_research_details(response_text, ground_truths)["score"])
