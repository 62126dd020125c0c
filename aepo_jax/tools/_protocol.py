"""Tool-call tags and result text (spec §1.2 step 2.3-2.4, §4).

The model writes `<search>query</search>` or `<python>code</python>`; generation stops at the closing tag.
The call is the content of the LAST such block, stripped, exactly as `_extract_content` in the official rollout
(rindex of the closing tag, then rindex of the opening tag before it).
"""

import dataclasses

DEFAULT_TAGS = ("search", "python")

# Evaluation-mode messages, verbatim from the official evaluation code (spec §2.5).
PYTHON_LIMIT_MESSAGE = "The maximum python call limit is exceeded. You are not allowed to use python."
SEARCH_LIMIT_MESSAGE = "The maximum search limit is exceeded. You are not allowed to search."
REPEATED_QUERY_MESSAGE = "You have searched this query. Please refer to previous results."


def limit_message(tag: str) -> str:
  if tag == "python":
    return PYTHON_LIMIT_MESSAGE
  if tag == "search":
    return SEARCH_LIMIT_MESSAGE
  return f"The maximum {tag} call limit is exceeded. You are not allowed to use {tag}."


def empty_output_message(tag: str) -> str:
  return f"Tool({tag}) returned empty output."


def failure_message(tag: str, error: object) -> str:
  return f"Error: Tool({tag}) execution failed with message: {error}"


@dataclasses.dataclass(frozen=True)
class ToolCall:
  tag: str
  content: str


def parse_tool_call(text: str, tags: tuple[str, ...] = DEFAULT_TAGS) -> ToolCall | None:
  """The tool call that ends `text`: the tag whose closing tag occurs last, and its last block's content.

  Returns None when no `<tag>...</tag>` block of the given tags is present. Content may be "" (the official
  rollout then ends the trajectory without a result).
  """
  best = None
  for tag in tags:
    end = text.rfind(f"</{tag}>")
    if end < 0:
      continue
    start = text.rfind(f"<{tag}>", 0, end)
    if start < 0:
      continue
    if best is None or end > best[0]:
      best = (end, tag, text[start + len(tag) + 2 : end].strip())
  return None if best is None else ToolCall(best[1], best[2])


def format_result(text: str, mode: str = "train", tag: str = "result") -> str:
  """Wraps tool text for the context: training `" <result>\\n{text}\\n</result>"`, eval `<result>{text}</result>`
  (`tag`: a tool's own result tag, ToolSpec.result_tag)."""
  if mode == "train":
    return f" <{tag}>\n{text}\n</{tag}>"
  if mode == "eval":
    return f"<{tag}>{text}</{tag}>"
  raise ValueError(f"format_result(mode={mode!r}); expected 'train' or 'eval'")


def trajectory_steps(tokens, mask, decode) -> list[str]:
  """A trajectory's steps so far, as the official evaluation logs them (`sample_stat["logs"]`, appended by
  `SampleProcessor.log_output` in evaluation/src/sample_processor.py): each model turn and each tool result, in order.
  A turn is a run of generated tokens (mask 1: a call continued past its token cap stays one turn, as the official
  `call_local_llm` joins its outputs), a result a run of tool tokens (mask 0); `decode(ids) -> str`."""
  steps, start = [], 0
  for i in range(1, len(tokens) + 1):
    if i == len(tokens) or bool(mask[i]) != bool(mask[start]):
      steps.append(decode(list(tokens[start:i])))
      start = i
  return steps
