"""The deep-search evaluation's browser as released ("SDS", spec §2.5), English and Chinese.

    tool = SdsBrowseTool(backend, sds_summarizer(url, model), pages=PageStore("pages/"), variant="sds")
    tool("Amy Smart film debut", trajectory=steps)   # -> the summariser's `**Final Information**`

Re-implements `BingSearchToolSDS` (evaluation/src/tools/search_tool_sds.py of the official ARPO code) and
`BingSearchToolSDScn` (search_tool_sds_cn.py), which `infer_local_sds.sh` / `infer_local_sds_cn.sh` run
(INFER_MODE=completion_sds, SEARCH_MAX_RESULTS=10). One search:
  1. the backend's top 10 hits (`extract_relevant_info`: organic[:max_results]);
  2. each hit's page text: the page store, else (live) the URL fetched as `extract_text_from_url` does (HTML: the
     visible text joined by spaces, first 20,000 characters; PDF: `extract_pdf_text`, the first 600 words);
  3. a window of the page anchored on the hit's snippet (`extract_snippet_with_context`): the sentence whose word set
     best matches the snippet's (F1 above 0.2) with 3,000 characters (max_doc_len) either side; no such sentence:
     the page's first 6,000 characters; a page that could not be fetched: "Web Page content cannot fetch";
  4. the pages as `**Web Page i:**` + the hit's JSON (`get_formatted_documents`), the agent's previous reasoning cut
     as `get_truncated_prev_reasoning` does, both in `get_webpage_to_reasonchain_instruction`'s prompt;
  5. the summariser's reply (temperature 0.6, top_p 0.95, max_tokens 4096: `self.sampling_params`) reduced to what
     follows `**Final Information**` (`extract_answer`).
The Chinese variant differs in its prompt (Chinese, marker `**最终信息**`, `extract_answer(mode='infogen')`) and its
snippet matching: a snippet with Chinese characters splits the page at 。！？, and words come from jieba where langid
says Chinese (`tokenize_text`, `is_chinese`).

Deliberate differences (docs/tools.md "The SDS browser as released"): pages come from a local store first (the
official fetches every URL); the summary request goes to `/chat/completions` with the user message, where the server
applies the summariser's chat template (the official applies it with `transformers` and posts the text to
`/completions`); the released Chinese tool never loads its summariser's tokenizer, so every search there ends in
"Tool execute failed: ... has no attribute 'tokenizer'": this one summarises, as the English tool does. English
sentences are nltk's `sent_tokenize` where nltk's punkt_tab data is installed, else `regex_sentences`.
"""

import importlib.util
import json
import logging
import re
import string
import threading

from aepo_jax.tools._sds_pages import PAGE_CHARS, fetch_page_text
from aepo_jax.tools._search import SearchHit

log = logging.getLogger(__name__)

VARIANTS = ("sds", "sds_cn")  # English (search_tool_sds.py) | Chinese (search_tool_sds_cn.py)
TOPK = 10  # SEARCH_MAX_RESULTS of infer_local_sds.sh / infer_local_sds_cn.sh
MATCH_CHARS = 50_000  # extract_snippet_with_context: full_text[:50000]
WINDOW_CHARS = 3_000  # max_doc_len, BingSearchToolSDS's default (infer.py passes none)
MIN_F1 = 0.2  # extract_snippet_with_context: best_f1 = 0.2, a sentence must do better
FETCH_FAILED = "Web Page content cannot fetch"  # get_formatted_documents, for a page whose fetch failed
_FETCH_ERRORS = (  # get_formatted_documents: fetched text starting so is a failed fetch
  "HTTP error occurred:",
  "Error: Connection error occurred",
  "Error: Request timed out after 20 seconds",
  "Unexpected error:",
)
MARKERS = {"sds": "**Final Information**", "sds_cn": "**最终信息**"}  # extract_answer's pattern_info
_STEPS_MARKER = "**Modified Reasoning Steps**"  # extract_answer's pattern_step, in both variants
# BingSearchToolSDS.__init__: SamplingParams(temperature=0.6, max_tokens=4096, top_p=0.95, n=1), sent by
# VLLMClientPool.generate with vLLM's defaults for the rest (stop None -> [], repetition_penalty 1.0,
# include_stop_str_in_output False).
SUMMARY_SAMPLING = {
  "temperature": 0.6,
  "top_p": 0.95,
  "max_tokens": 4096,
  "stop": [],
  "repetition_penalty": 1.0,
  "include_stop_str_in_output": False,
}

# get_webpage_to_reasonchain_instruction of search_tool_sds.py / search_tool_sds_cn.py, verbatim (the official
# f-string's fields as str.format fields).
PROMPT_EN = """**Task Instruction:**

You are tasked with reading and analyzing web pages based on the following inputs: **Previous Reasoning Steps**, **Current Search Query**, and **Searched Web Pages**. Your objective is to extract relevant and helpful information for **Current Search Query** from the **Searched Web Pages** and seamlessly integrate this information into the **Previous Reasoning Steps** to continue reasoning for the original question.

**Guidelines:**

1. **Analyze the Searched Web Pages:**
- Carefully review the content of each searched web page.
- Identify factual information that is relevant to the **Current Search Query** and can aid in the reasoning process for the original question.

2. **Extract Relevant Information:**
- Select the information from the Searched Web Pages that directly contributes to advancing the **Previous Reasoning Steps**.
- Ensure that the extracted information is accurate and relevant.

3. **Output Format:**
- Present the helpful information for current search query: beginning with `**Final Information**` as shown below.
**Final Information**

[Helpful information]

**Inputs:**
- **Previous Reasoning Steps:**
{prev_reasoning}

- **Current Search Query:**
{search_query}

- **Searched Web Pages:**
{document}

Now you should analyze each web page and find helpful information based on the current search query "{search_query}" and previous reasoning steps.
"""

PROMPT_CN = """***任务说明***：

你的任务是根据以下输入内容阅读并分析网页：**前序推理步骤**、**当前搜索查询** 和 **已搜索网页内容**。你的目标是从 **已搜索网页内容** 中提取与 **当前搜索查询** 相关且有用的信息，并将这些信息无缝整合进 **前序推理步骤** 中，以继续对原始问题的推理。

**操作指南：**

1. **分析已搜索网页内容：**
- 仔细审阅每一条搜索结果页面的内容。
- 识别出与 **当前搜索查询** 相关的事实信息，这些信息可以帮助原始问题的推理过程。

2. **提取相关信息：**
- 从已搜索网页中选择能够直接推进 **前序推理步骤** 的内容。确保提取的信息准确且相关。

3. **输出格式：**
- 使用如下格式展示当前搜索查询的有用信息：以 **最终信息** 开头，如下所示。
**最终信息**

[有用的信息]

- **输入内容：**

- **前序推理步骤：**
{prev_reasoning}

- **当前搜索查询：**
{search_query}

- **已搜索网页内容：**
{document}

现在你应该分析每一条网页内容，并基于当前搜索查询 "{search_query}" 和前序推理步骤找出有用信息。
"""

PROMPTS = {"sds": PROMPT_EN, "sds_cn": PROMPT_CN}


def summary_prompt(prev_reasoning: str, search_query: str, document: str, variant: str = "sds") -> str:
  """`get_webpage_to_reasonchain_instruction(prev_reasoning, search_query, document)` of the variant."""
  return PROMPTS[variant].format(prev_reasoning=prev_reasoning, search_query=search_query, document=document)


def truncated_prev_reasoning(steps) -> str:
  """`get_truncated_prev_reasoning(sample_stat["logs"])`: the steps as `Step i: ...`; past 5 steps only the first,
  the last 4, the search calls and the results that follow a search call are kept, each run of the others becoming
  one `...`. No steps (a caller that passes none): ""."""
  prev = [f"Step {i + 1}: {step}" for i, step in enumerate(steps)]
  if len(prev) <= 5:
    return "\n\n".join(prev).strip("\n")
  out = ""
  for i, step in enumerate(prev):
    if (
      i == 0
      or i >= len(prev) - 4
      or ("<search>" in step and "</search>" in step)
      or ("<result>" in step and "</result>" in step and "<search>" in prev[i - 1])
    ):
      out += step + "\n\n"
    elif out[-len("\n\n...\n\n") :] != "\n\n...\n\n":
      out += "...\n\n"
  return out.strip("\n")


def final_information(reply, variant: str = "sds") -> str:
  """`extract_answer(output)` (search_tool_sds.py) / `extract_answer(output, mode='infogen')` (search_tool_sds_cn.py):
  what follows the last marker with its newlines removed, else what follows `**Modified Reasoning Steps**`, else
  the whole reply (unstripped); both cuts lose surrounding backticks and spaces."""
  reply = "None" if reply is None else reply
  marker = MARKERS[variant]
  if marker in reply:
    return reply.split(marker)[-1].replace("\n", "").strip("```").strip()
  if _STEPS_MARKER in reply:
    return reply.split(_STEPS_MARKER)[-1].strip("```").strip()
  return reply


# ---------------------------------------------------------------------------------------------- the page window
def remove_punctuation(text: str) -> str:
  return text.translate(str.maketrans("", "", string.punctuation))


def f1_score(true_set: set, pred_set: set) -> float:
  common = len(true_set & pred_set)
  if not common:
    return 0.0
  precision, recall = common / len(pred_set), common / len(true_set)
  return 2 * precision * recall / (precision + recall)


_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s)")


def regex_sentences(text: str) -> list[str]:
  """Sentences ending at . ! ? (and closing quotes or brackets) before white space: stands in for nltk's Punkt
  model when its data is not installed (Punkt also keeps abbreviations such as "Dr." inside a sentence)."""
  out, start = [], 0
  for m in _SENTENCE_END.finditer(text):
    piece = text[start : m.end()].strip()
    if piece:
      out.append(piece)
    start = m.end()
  if text[start:].strip():
    out.append(text[start:].strip())
  return out


def english_sentences():
  """(`nltk.sent_tokenize`, "nltk") as the official code splits, when nltk and its punkt_tab data are installed;
  else (regex_sentences, "regex")."""
  try:
    import nltk

    nltk.sent_tokenize("One. Two.")
  except (ImportError, LookupError):
    return regex_sentences, "regex"
  return nltk.sent_tokenize, "nltk"


def chinese_words():
  """`tokenize_text` of search_tool_sds_cn.py: jieba's words where langid says Chinese, else split on spaces."""
  missing = [m for m in ("jieba", "langid") if importlib.util.find_spec(m) is None]
  if missing:
    raise ValueError(
      f"the Chinese SDS browser (browse variant 'sds_cn') matches snippets with jieba and langid, as the official "
      f"tool does: pip install {' '.join(missing)} (or pip install 'aepo_jax[sds]')"
    )
  import jieba
  import langid

  jieba.setLogLevel(logging.WARNING)

  def words(text: str) -> list[str]:
    return list(jieba.cut(text)) if langid.classify(text)[0] == "zh" else text.split()

  return words


def is_chinese(text: str) -> bool:
  return re.search(r"[\u4e00-\u9fa5]", text) is not None


def snippet_window(
  full_text: str,
  snippet: str,
  *,
  context_chars: int = WINDOW_CHARS,
  sentences=regex_sentences,
  words=str.split,
  chinese: bool = False,
) -> tuple[bool, str]:
  """`extract_snippet_with_context(full_text, snippet, context_chars)`: (True, the page from `context_chars` before
  the sentence that best matches the snippet to `context_chars` after it), or (False, the first 2 * context_chars
  characters) when no sentence's word-set F1 with the snippet's passes 0.2. Case and ASCII punctuation are ignored;
  the first occurrence of the best (earliest on ties) sentence anchors the window. `chinese`: the sds_cn rule (a
  snippet with Chinese characters splits the page at 。！？)."""
  full_text = full_text[:MATCH_CHARS]
  clean = remove_punctuation(snippet.lower())
  pieces = re.split(r"[。！？]", full_text) if chinese and is_chinese(clean) else sentences(full_text)
  snippet_words = set(words(clean))
  best, best_f1 = None, MIN_F1
  for sentence in pieces:
    f1 = f1_score(snippet_words, set(words(remove_punctuation(sentence.lower()))))
    if f1 > best_f1:
      best, best_f1 = sentence, f1
  if not best:
    return False, full_text[: context_chars * 2]
  start = full_text.find(best)
  return True, full_text[max(0, start - context_chars) : min(len(full_text), start + len(best) + context_chars)]


# ---------------------------------------------------------------------------------------------- the tool
def sds_summarizer(base_url: str, model: str, *, timeout_s: float = 600.0, retries: int = 2):
  """The summariser client with the official request's sampling (SUMMARY_SAMPLING). 600 s per attempt and 3
  attempts: the official client's defaults (AsyncOpenAI's timeout, VLLMClientPool's 3 tries)."""
  from aepo_jax.tools._llm import ChatClient

  extra = {k: v for k, v in SUMMARY_SAMPLING.items() if k not in ("temperature", "max_tokens")}
  return ChatClient(
    base_url,
    model,
    timeout_s=timeout_s,
    retries=retries,
    temperature=SUMMARY_SAMPLING["temperature"],
    max_tokens=SUMMARY_SAMPLING["max_tokens"],
    extra_body=extra,
  )


class SdsBrowseTool:
  """The `search` tool as the official SDS browser (module docstring): query + the trajectory so far -> the
  summariser's `**Final Information**` about the top 10 hits' pages.

  backend: any SearchBackend; summarizer: `complete(prompt) -> str` (`sds_summarizer(url, model)`); pages: a
  PageStore or None; live: fetch http(s) URLs the store lacks; variant: 'sds' | 'sds_cn'; sentences: how English
  text is split (default nltk's `sent_tokenize` when its punkt_tab data is installed, else `regex_sentences`).
  Called with `trajectory=` (the official `sample_stat["logs"]`: `_protocol.trajectory_steps`) by the ToolSet.
  """

  tag = "search"
  wants_trajectory = True
  call_timeout_s = 1800.0  # the summariser's 3 attempts of 600 s (the official bounds only the whole sample)

  def __init__(
    self,
    backend,
    summarizer,
    *,
    pages=None,
    live: bool = False,
    variant: str = "sds",
    topk: int = TOPK,
    window_chars: int = WINDOW_CHARS,
    sentences=None,
  ):
    if variant not in VARIANTS:
      raise ValueError(f"SdsBrowseTool(variant={variant!r}); expected one of {VARIANTS}")
    if live and importlib.util.find_spec("pdfplumber") is None:
      raise ValueError(
        "the SDS browser with live pages reads PDFs with pdfplumber, as the official tool does: pip install "
        "pdfplumber (or pip install 'aepo_jax[sds]')"
      )
    self.backend, self.summarizer, self.pages, self.live = backend, summarizer, pages, live
    self.variant, self.topk, self.window_chars = variant, topk, window_chars
    self.words = chinese_words() if variant == "sds_cn" else str.split
    if sentences is None:
      sentences, how = english_sentences()
      if how == "regex":
        log.warning(
          "SDS browser: nltk's punkt_tab is not installed; English pages are split into sentences by a regex, which "
          "can anchor a page's window elsewhere than the official code (pip install nltk && python -m "
          "nltk.downloader punkt_tab)"
        )
    self.sentences = sentences
    self._lock = threading.Lock()
    self._stats = dict.fromkeys(
      ("pages_from_store", "pages_live", "pages_unfetched", "windows_anchored", "windows_first_chars", "unmarked"), 0
    )

  def metrics(self) -> dict:
    """Cumulative counters (the ToolSet reports them as tools/search_<name>)."""
    with self._lock:
      return dict(self._stats)

  def _count(self, key: str) -> None:
    with self._lock:
      self._stats[key] += 1

  def page_text(self, hit: SearchHit):
    """What the official fetch would hold for the hit: the store's page (first 20,000 characters) or the live page
    (`fetch_page_text`, perhaps an official fetch error); None when neither has it (a failed fetch)."""
    text = self.pages.get(hit) if self.pages is not None else None
    if text is not None:
      self._count("pages_from_store")
      return text[:PAGE_CHARS]
    if self.live and hit.url.startswith(("http://", "https://")):
      self._count("pages_live")
      return fetch_page_text(hit.url)
    return None

  def documents(self, hits) -> str:
    """`get_formatted_documents(relevant_info)`: each hit as `**Web Page i:**` and its JSON (id, title, url,
    site_name, date, snippet without <b> tags, context: the page's snippet window)."""
    out = ""
    for i, hit in enumerate(hits):
      snippet = hit.text.replace("<b>", "").replace("</b>", "")
      raw = self.page_text(hit)
      if raw is None or raw.startswith(_FETCH_ERRORS):
        self._count("pages_unfetched")
        context = FETCH_FAILED
      else:
        found, window = snippet_window(
          raw,
          snippet,
          context_chars=self.window_chars,
          sentences=self.sentences,
          words=self.words,
          chinese=self.variant == "sds_cn",
        )
        self._count("windows_anchored" if found else "windows_first_chars")
        context = window if found else raw[: self.window_chars * 2]
      info = {"id": i + 1, "title": hit.title, "url": hit.url, "site_name": "", "date": "", "snippet": snippet}
      info["context"] = context
      out += f"**Web Page {i + 1}:**\n" + json.dumps(info, ensure_ascii=False, indent=2) + "\n"
    return out

  def __call__(self, query: str, trajectory=None) -> str:
    query = query.strip()
    if not query:
      return ""  # nothing searched: the ToolSet reports empty output
    hits = self.backend.search(query, self.topk)[: self.topk]
    prompt = summary_prompt(truncated_prev_reasoning(trajectory or ()), query, self.documents(hits), self.variant)
    reply = self.summarizer.complete(prompt)
    if MARKERS[self.variant] not in reply:
      self._count("unmarked")
    return final_information(reply, self.variant)
