"""The deep-research reward of ARPO/AEPO (spec §1.6, official `deep_research.py::compute_score`).

reward = -1 on any format violation or when no `\\boxed{}` can be extracted from the answer span;
otherwise F1 = token-F1 (max over aliases) of the boxed answer, plus 0.1 when F1 > 0 and the
response closes a call of every bonus tool (`</search>` and `</python>`). Range {-1} ∪ [0, 1.1]. Math is scored with
token-F1 too (spec §5 item 11): use `math_equal` only for evaluation.

The tools come from the tool registry: the call tags of the tools of the official protocol
(`aepo_jax.tools.reward_tags()`: search, python; a tool registered with `reward_tool=True` joins them), in
registration order, both for the format rule (each one's blocks in order) and for the bonus (every one used). The
`tools` / `bonus_tools` parameters name other call tags; an empty `bonus_tools` gives no bonus.
"""

from __future__ import annotations

from typing import Optional, Sequence

from aepo_jax.rewards._extract import extract_boxed
from aepo_jax.rewards._qa import f1_score

FORMAT_PENALTY = -1.0
TOOL_BONUS = 0.1


def _reward_tags(tags: Optional[Sequence[str]]) -> tuple:
  if tags is not None:
    return tuple(tags)
  from aepo_jax.tools import reward_tags

  return reward_tags()


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


def check_format(text: str, tools: Optional[Sequence[str]] = None) -> tuple[bool, str]:
  """(ok, reason) for the format rules of spec §1.6.1, checked in the official order; `tools`: the call tags whose
  blocks must be in order (default `aepo_jax.tools.reward_tags()`: search, then python)."""
  n_think, n_think_end = text.count("<think>"), text.count("</think>")
  if n_think != n_think_end:
    return False, "<think> and </think> counts differ"
  if n_think == 0:
    return False, "no <think> ... </think> block"
  if text.count("<answer>") != 1 or text.count("</answer>") != 1:
    return False, "need exactly one <answer> and one </answer>"
  for tool in _reward_tags(tools):
    if not _tool_blocks_ordered(text, tool):
      return False, f"a <{tool}> is not followed by </{tool}>, <result>, </result>"
  start, end = text.find("<answer>"), text.find("</answer>")
  if start > end:
    return False, "</answer> comes before <answer>"
  span = text[start:end]
  if "\\boxed{" not in span or "}" not in span:
    return False, "the answer span has no \\boxed{...}"
  return True, "format ok"


def deep_research_details(
  response_text: str, ground_truths: str | Sequence[str], *, bonus_tools: Optional[Sequence[str]] = None
) -> dict:
  """The §1.6 reward with its breakdown: score, format_ok, reason, extracted (boxed text), f1. bonus_tools: the call
  tags that must all be used (closed) for the tool bonus (default `aepo_jax.tools.reward_tags()`: search and python).
  """
  ok, reason = check_format(response_text)
  if not ok:
    return dict(score=FORMAT_PENALTY, format_ok=False, reason=reason, extracted=None, f1=0.0)
  start, end = response_text.find("<answer>"), response_text.find("</answer>")
  extracted = extract_boxed(response_text[start + len("<answer>") : end])
  if extracted is None:
    return dict(score=FORMAT_PENALTY, format_ok=False, reason="\\boxed{ is never closed", extracted=None, f1=0.0)
  f1 = f1_score(extracted, ground_truths)
  tags = _reward_tags(bonus_tools)
  used_all = bool(tags) and all(f"</{t}>" in response_text for t in tags)
  score = f1 + TOOL_BONUS if (f1 > 0 and used_all) else f1
  reason = "correct" if f1 == 1.0 else ("partial" if f1 > 0 else "wrong answer, good format")
  return dict(score=score, format_ok=True, reason=reason, extracted=extracted, f1=f1)


def deep_research(
  response_text: str, ground_truths: str | Sequence[str], *, bonus_tools: Optional[Sequence[str]] = None
) -> float:
  """Scalar reward of spec §1.6 for one decoded response (tool results included)."""
  return float(deep_research_details(response_text, ground_truths, bonus_tools=bonus_tools)["score"])
