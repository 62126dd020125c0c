"""System prompts (spec §4) and chat-message building. The one place prompt text lives.

`code_search` is the prompt of the ARPO RL data and of the official evaluation (`prompt_manager.py`,
type code_search), with `\\boxed` intact: the released parquet files store `\\b` as a backspace
(U+0008), see `has_backspace_bug`. `search` and `math` are the single-tool variants written in the
same words (search-only or python-only), `base` asks for the answer format without tools, and
`compact` is a short prompt for the small CPU model (SmolLM2-135M), whose context and step budget
cannot afford the long one. `code_search_cn` is the official evaluation's Chinese prompt, the one it
asks xbench in.
"""

from __future__ import annotations

from typing import Any

_ANSWER = (
  "<answer> The final answer is \\[ \\boxed{answer here} \\] </answer>. In the last part "
  "of the answer, the final exact answer is enclosed within \\boxed{} with latex format."
)

CODE_SEARCH = (
  "You are a helpful assistant that can solve the given question step by step with the help of "
  "the wikipedia search tool and python interpreter tool. Given a question, you need to first "
  "think about the reasoning process in the mind and then provide the answer. During thinking, "
  "you can invoke the wikipedia search tool to search and python interpreter tool to calculate "
  "the math problem for fact information about specific topics if needed. The reasoning process "
  "and answer are enclosed within <think> </think> and <answer> </answer> tags respectively, and "
  "the search query and result are enclosed within <search> </search> and <result> </result> "
  "tags respectively. For example, <think> This is the reasoning process. </think> <search> "
  "search query here </search> <result> search result here </result> <think> This is the "
  "reasoning process. </think> <python> python code here </python> <result> python interpreter "
  "result here </result> <think> This is the reasoning process. </think> " + _ANSWER
)

SEARCH = (
  "You are a helpful assistant that can solve the given question step by step with the help of "
  "the wikipedia search tool. Given a question, you need to first think about the reasoning "
  "process in the mind and then provide the answer. During thinking, you can invoke the "
  "wikipedia search tool to search for fact information about specific topics if needed. The "
  "reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags "
  "respectively, and the search query and result are enclosed within <search> </search> and "
  "<result> </result> tags respectively. For example, <think> This is the reasoning process. "
  "</think> <search> search query here </search> <result> search result here </result> <think> "
  "This is the reasoning process. </think> " + _ANSWER
)

MATH = (
  "You are a helpful assistant that can solve the given question step by step with the help of "
  "the python interpreter tool. Given a question, you need to first think about the reasoning "
  "process in the mind and then provide the answer. During thinking, you can invoke the python "
  "interpreter tool to calculate the math problem if needed. The reasoning process and answer "
  "are enclosed within <think> </think> and <answer> </answer> tags respectively. For example, "
  "<think> This is the reasoning process. </think> <python> python code here </python> <result> "
  "python interpreter result here </result> <think> This is the reasoning process. </think> " + _ANSWER
)

BASE = (
  "You are a helpful assistant. Given a question, you need to first think about the reasoning "
  "process in the mind and then provide the answer. The reasoning process and answer are "
  "enclosed within <think> </think> and <answer> </answer> tags respectively. For example, "
  "<think> This is the reasoning process. </think> " + _ANSWER
)

COMPACT = (
  "Answer with tools. Think in <think> </think>. Compute with <python> code </python> or look "
  "facts up with <search> query </search>; the result comes back in <result> </result>. End "
  "with <answer> \\boxed{answer} </answer>."
)

# The official evaluation's prompt for xbench (prompt_manager.py, type code_search_cn; infer_local_sds_cn.sh).
CODE_SEARCH_CN = (
  "你是一个乐于助人的助手，能够借助 Wikipedia 搜索工具和 Python 解释器工具，逐步解决给定的问题。\n"
  "给定一个问题后，你需要先在头脑中进行推理过程，然后再提供答案。\n"
  "在思考过程中，你可以调用 Wikipedia 搜索工具来搜索特定主题的事实信息，也可以使用 Python 解释器工具来计算数学问题（如有需要）。\n"
  "推理过程和答案分别用 <think> 和 </think>，以及 <answer> 和 </answer> 标签括起来；\n"
  "搜索查询和结果分别用 <search> 和 </search>，以及 <result> 和 </result> 标签括起来。\n"
  "例如：\n"
  "<think> 这是推理过程。 </think> <search> 这里是搜索查询 </search> <result> 这里是搜索结果 </result>\n"
  "<think> 这是推理过程。 </think> <python> 这里是 Python 代码 </python> <result> 这里是 Python 解释器的结果 </result>\n"
  "<think> 这是推理过程。 </think> <answer> 最终答案是 \\[ \\boxed{这里是答案} \\] </answer>"
)

TEMPLATES = {
  "code_search": CODE_SEARCH,
  "code_search_cn": CODE_SEARCH_CN,
  "search": SEARCH,
  "math": MATH,
  "base": BASE,
  "compact": COMPACT,
}


def system_prompt(template: str) -> str:
  try:
    return TEMPLATES[template]
  except KeyError:
    raise ValueError(f"unknown prompt template {template!r}; choose from {sorted(TEMPLATES)}") from None


def has_backspace_bug(text: str) -> bool:
  """True when `text` holds the ARPO data bug: `\\b` of `\\boxed` stored as U+0008."""
  return "\x08" in text


def fix_backspace_bug(text: str) -> str:
  return text.replace("\x08", "\\b")


def build_messages(example: Any, template: str = "code_search") -> list[dict[str, str]]:
  """[{role: system, content}, {role: user, content: question}] for a chat template.

  `example` is an `Example`, a dict with a 'question' key (and optionally 'system_prompt'), or the question
  string itself. A record's own system prompt (Example.metadata['system_prompt'], from a data file that
  carries one) replaces the template's.
  """
  own = None
  if isinstance(example, str):
    question = example
  elif isinstance(example, dict):
    question, own = example["question"], example.get("system_prompt")
  else:
    question, own = example.question, (example.metadata or {}).get("system_prompt")
  return [{"role": "system", "content": own if own else system_prompt(template)}, {"role": "user", "content": question}]
