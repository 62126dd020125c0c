"""Answer extraction: the last `\\boxed{...}` (brace-matched) and the `<answer>` span.

Linear-time scans only (no backtracking regexes), so hostile model output cannot stall a reward worker.
"""

from __future__ import annotations

_BOXED = "\\boxed{"


def extract_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` in `text`, braces matched; None when absent or unclosed.

  A `\\boxed{` whose braces never close is skipped in favour of an earlier, complete one only if
  it is not the last occurrence: like the official `last_boxed_only_string`, the last one decides.
  """
  start = text.rfind(_BOXED)
  if start < 0:
    return None
  depth = 0
  for i in range(start + len(_BOXED) - 1, len(text)):
    ch = text[i]
    if ch == "{":
      depth += 1
    elif ch == "}":
      depth -= 1
      if depth == 0:
        return text[start + len(_BOXED) : i]
  return None


def strip_text_wrapper(answer: str) -> str:
  """`\\text{Paris}` -> `Paris` (official eval strips one wrapper around the whole boxed content)."""
  s = answer.strip()
  if s.startswith("\\text{") and s.endswith("}"):
    return s[len("\\text{") : -1]
  return s


def answer_span(text: str) -> str | None:
  """Text between the last `<answer>` and the last `</answer>` after it; None when absent."""
  end = text.rfind("</answer>")
  if end < 0:
    return None
  start = text.rfind("<answer>", 0, end)
  if start < 0:
    return None
  return text[start + len("<answer>") : end]


def extract_answer(text: str) -> str:
  """Evaluation-time answer extraction (official eval, §2.5): last `<answer>` block, then its last
  `\\boxed{}` with a `\\text{}` wrapper removed; the whole block when it has no box; else the last
  `\\boxed{}` anywhere; else ''. Never raises."""
  span = answer_span(text)
  if span is not None and span.strip():
    boxed = extract_boxed(span)
    return strip_text_wrapper(boxed) if boxed else span.strip()
  boxed = extract_boxed(text)
  return strip_text_wrapper(boxed) if boxed else ""
