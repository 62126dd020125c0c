"""The SDS browser as released (aepo_jax/tools/_sds.py) against the official code's own text and rules: the summary
prompts byte for byte (the reference functions below are copied from evaluation/src/tools/search_tool_sds.py and
search_tool_sds_cn.py, `get_webpage_to_reasonchain_instruction`), the previous-reasoning cut, the `**Final
Information**` reading, the snippet-anchored window, the summary request's sampling (a loopback chat server), live
pages and PDFs (a loopback page server), the trajectory the agent hands the tool, and the evaluation's wiring."""

import http.server
import json
import threading

import pytest

from aepo_jax.testing import chat_server
from aepo_jax.tools import (
  BrowseTool,
  CallState,
  PageStore,
  SdsBrowseTool,
  SearchHit,
  ToolCall,
  ToolSet,
  fetch_page_text,
  final_information,
  pdf_text,
  sds_summarizer,
  snippet_window,
  summary_prompt,
  trajectory_steps,
  truncated_prev_reasoning,
  visible_text,
)
from aepo_jax.tools._sds import regex_sentences


# ------------------------------------------------------------------------------------------------ official references
# search_tool_sds.py, get_webpage_to_reasonchain_instruction (verbatim).
def official_prompt_en(prev_reasoning, search_query, document):
  return f"""**Task Instruction:**

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


# search_tool_sds_cn.py, get_webpage_to_reasonchain_instruction (verbatim).
def official_prompt_cn(prev_reasoning, search_query, document):
  return f"""***任务说明***：

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


# prompt_manager.py, PromptManager._get_template for 'code_search_cn' (the prompt infer_local_sds_cn.sh asks xbench in)
OFFICIAL_CODE_SEARCH_CN = """你是一个乐于助人的助手，能够借助 Wikipedia 搜索工具和 Python 解释器工具，逐步解决给定的问题。
给定一个问题后，你需要先在头脑中进行推理过程，然后再提供答案。
在思考过程中，你可以调用 Wikipedia 搜索工具来搜索特定主题的事实信息，也可以使用 Python 解释器工具来计算数学问题（如有需要）。
推理过程和答案分别用 <think> 和 </think>，以及 <answer> 和 </answer> 标签括起来；
搜索查询和结果分别用 <search> 和 </search>，以及 <result> 和 </result> 标签括起来。
例如：
<think> 这是推理过程。 </think> <search> 这里是搜索查询 </search> <result> 这里是搜索结果 </result>
<think> 这是推理过程。 </think> <python> 这里是 Python 代码 </python> <result> 这里是 Python 解释器的结果 </result>
<think> 这是推理过程。 </think> <answer> 最终答案是 \\[ \\boxed{这里是答案} \\] </answer>"""


class Hits:
  """A search backend with fixed hits."""

  def __init__(self, hits):
    self.hits, self.queries = hits, []

  def search(self, query, topk):
    self.queries.append((query, topk))
    return self.hits[:topk]


def _store(tmp_path):
  path = tmp_path / "pages.jsonl"
  pages = [
    {
      "id": "doc-1",
      "title": "Amy Smart",
      "text": "Amy Smart is an American actress (é). Her film debut was Campfire Tales.",
    },
    {"id": "doc-2", "title": "巴黎", "text": "前言。巴黎是法国的首都！埃菲尔铁塔高330米？结束"},
  ]
  path.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pages))
  return PageStore(str(path))


def _chars(text):  # a word per character: the Chinese rule's split without jieba's dictionary
  return [c for c in text if not c.isspace()]


# ------------------------------------------------------------------------------------------------ prompts and replies
@pytest.mark.parametrize("variant, official", [("sds", official_prompt_en), ("sds_cn", official_prompt_cn)])
def test_summary_prompts_are_the_official_templates_byte_for_byte(variant, official):
  prev = "Step 1: <think>who?</think> <search>Amy Smart {debut}</search>"
  query, docs = 'Amy Smart "film debut" {year}', '**Web Page 1:**\n{\n  "id": 1\n}\n'
  assert summary_prompt(prev, query, docs, variant) == official(prev, query, docs)
  assert summary_prompt("", "巴黎", "", variant) == official("", "巴黎", "")


def test_the_xbench_prompt_is_the_official_code_search_cn():
  from aepo_jax.data import system_prompt

  assert system_prompt("code_search_cn") == OFFICIAL_CODE_SEARCH_CN


def test_previous_reasoning_is_cut_as_get_truncated_prev_reasoning():
  assert truncated_prev_reasoning([]) == ""
  assert truncated_prev_reasoning(["<search>q</search>\n"]) == "Step 1: <search>q</search>"
  five = ["t1", "<result>r</result>", "t3", "r4", "t5\n"]
  assert (
    truncated_prev_reasoning(five)
    == "Step 1: t1\n\nStep 2: <result>r</result>\n\nStep 3: t3\n\nStep 4: r4\n\nStep 5: t5"
  )
  steps = [
    "<think>plan</think>",  # 1: the first step, kept
    "<python>1+1</python>",  # 2: dropped, one "..."
    "<result>2</result>",  # 3: dropped (no search before it), no second "..."
    "<think>look</think><search>q</search>",  # 4: a search, kept
    "<result>found</result>",  # 5: the result of a search, kept
    "<python>x</python>",  # 6: dropped, "..."
    "<result>y</result>",  # 7: dropped
    "a",  # 8-11: the last four, kept
    "b",
    "c",
    "<search>q2</search>",
  ]
  assert truncated_prev_reasoning(steps) == (
    "Step 1: <think>plan</think>\n\n...\n\nStep 4: <think>look</think><search>q</search>\n\n"
    "Step 5: <result>found</result>\n\n...\n\nStep 8: a\n\nStep 9: b\n\nStep 10: c\n\nStep 11: <search>q2</search>"
  )


@pytest.mark.parametrize(
  "reply, expected",
  [
    (  # what follows the marker, its newlines removed (the official .replace("\n", ""))
      "Reading the pages.\n**Final Information**\n\nHer debut was\nCampfire Tales (1997).\n",
      "Her debut wasCampfire Tales (1997).",
    ),
    ("**Final Information**\n```\nfact\n```", "fact"),  # fences dropped
    ("draft **Final Information** one\n**Final Information** two", "two"),  # the last marker
    # the fallback keeps newlines, and strips backticks before spaces: fences after a newline stay
    ("**Modified Reasoning Steps**\n```\nstep 1\nstep 2\n```\n", "```\nstep 1\nstep 2\n```"),
    ("No marker here.\n", "No marker here.\n"),  # the whole reply, as it is
    ("**最终信息**\n巴黎", "**最终信息**\n巴黎"),  # the Chinese marker means nothing to the English tool
    ("", ""),
    (None, "None"),
  ],
)
def test_final_information_is_read_as_extract_answer(reply, expected):
  assert final_information(reply, "sds") == expected


def test_the_chinese_tool_reads_its_own_marker():
  assert final_information("思考\n**最终信息**\n巴黎是\n法国的首都。", "sds_cn") == "巴黎是法国的首都。"
  assert final_information("**Final Information**\nx", "sds_cn") == "**Final Information**\nx"
  assert final_information("**Modified Reasoning Steps**\n a \n", "sds_cn") == "a"


# ------------------------------------------------------------------------------------------------ the page window
PAGE = "Intro line. Amy Smart is an American actress. Her film debut was Campfire Tales. The end."


def test_the_window_is_anchored_on_the_sentence_that_matches_the_snippet():
  found = snippet_window(PAGE, "Her film debut was Campfire Tales (1997)", context_chars=5)
  assert found == (True, "ess. Her film debut was Campfire Tales. The ")
  # no sentence matches: the page's first 2 * context_chars characters
  assert snippet_window(PAGE, "completely unrelated words", context_chars=5) == (False, "Intro line")
  # a page shorter than the window: all of it, found or not
  assert snippet_window(PAGE, "her FILM debut!", context_chars=3000) == (True, PAGE)
  assert snippet_window(PAGE, "nothing", context_chars=3000) == (False, PAGE)
  assert snippet_window("", "anything") == (False, "")


def test_a_sentence_must_match_better_than_f1_0_2_and_the_first_best_wins():
  # one shared word of an 8-word snippet and a 2-word sentence: F1 = 0.2 exactly, not enough; of 7 words: 0.22
  assert snippet_window("Alpha beta.", "alpha c d e f g h i", context_chars=1) == (False, "Al")
  assert snippet_window("Alpha beta.", "alpha c d e f g h", context_chars=1) == (True, "Alpha beta.")
  page = "Red cat. Blue dog. Green cat."
  assert snippet_window(page, "cat", context_chars=0) == (True, "Red cat.")  # the earliest of equals
  page = "A cat sat. Dogs run far away. A cat sat."
  assert snippet_window(page, "a cat sat", context_chars=2) == (True, "A cat sat. D")  # its first occurrence


def test_regex_sentences_stand_in_for_punkt():
  assert regex_sentences('Who met Mr. Smith. "Really?" she asked! End') == [
    "Who met Mr.",  # Punkt's English model would keep "Mr." inside the sentence
    "Smith.",
    '"Really?"',
    "she asked!",
    "End",
  ]


def test_the_chinese_variant_splits_chinese_snippets_at_sentence_marks():
  page = "前言。巴黎是法国的首都！埃菲尔铁塔高330米？结束"
  assert snippet_window(page, "巴黎是法国的首都", context_chars=2, words=_chars, chinese=True) == (
    True,
    "言。巴黎是法国的首都！埃",
  )
  # the English rule sees one sentence of one word: no match
  assert snippet_window(page, "巴黎是法国的首都", context_chars=2) == (False, "前言。巴")


# ------------------------------------------------------------------------------------------------ one search
def _reply(answer):
  def reply(body):
    reply.bodies.append(body)
    return answer

  reply.bodies = []
  return reply


def test_one_search_sends_the_official_request_and_returns_the_final_information(tmp_path):
  backend = Hits(
    [
      SearchHit("Amy Smart", "Her <b>film debut</b> was Campfire Tales", url="doc-1"),
      SearchHit("Elsewhere", "a page the store lacks", url="https://example.invalid/x"),
    ]
  )
  reply = _reply("I read both.\n**Final Information**\nHer film debut was\nCampfire Tales.")
  with chat_server(reply) as (url, _):
    tool = SdsBrowseTool(backend, sds_summarizer(url, "summariser"), pages=_store(tmp_path))
    tools = ToolSet({"search": tool}, mode="eval")
    steps = ["<think>Find her debut.</think> <search> Amy Smart debut </search>"]
    try:
      out = tools.execute(ToolCall("search", "Amy Smart debut"), CallState(), trajectory=steps)
    finally:
      tools.shutdown()
  assert out.ok and out.text == "Her film debut wasCampfire Tales."
  assert backend.queries == [("Amy Smart debut", 10)]  # the official max_results
  docs = (
    "**Web Page 1:**\n{\n"
    '  "id": 1,\n  "title": "Amy Smart",\n  "url": "doc-1",\n  "site_name": "",\n  "date": "",\n'
    '  "snippet": "Her film debut was Campfire Tales",\n'
    '  "context": "Amy Smart\\nAmy Smart is an American actress (é). Her film debut was Campfire Tales."\n}\n'
    "**Web Page 2:**\n{\n"
    '  "id": 2,\n  "title": "Elsewhere",\n  "url": "https://example.invalid/x",\n  "site_name": "",\n  "date": "",\n'
    '  "snippet": "a page the store lacks",\n  "context": "Web Page content cannot fetch"\n}\n'
  )
  [body] = reply.bodies
  assert body == {
    "model": "summariser",
    "messages": [{"role": "user", "content": official_prompt_en("Step 1: " + steps[0], "Amy Smart debut", docs)}],
    # SamplingParams(temperature=0.6, max_tokens=4096, top_p=0.95) with vLLM's defaults for what VLLMClientPool sends
    "temperature": 0.6,
    "top_p": 0.95,
    "max_tokens": 4096,
    "stop": [],
    "repetition_penalty": 1.0,
    "include_stop_str_in_output": False,
  }
  assert tool.metrics() == {
    "pages_from_store": 1,
    "pages_live": 0,
    "pages_unfetched": 1,
    "windows_anchored": 1,
    "windows_first_chars": 0,
    "unmarked": 0,
  }


def test_the_chinese_tool_prompts_and_matches_in_chinese(tmp_path):
  backend = Hits([SearchHit("巴黎", "巴黎是<b>法国</b>的首都", url="doc-2")])
  reply = _reply("**最终信息**\n巴黎是法国的首都。")
  with chat_server(reply) as (url, _):
    tool = SdsBrowseTool(backend, sds_summarizer(url, "s"), pages=_store(tmp_path), variant="sds_cn", window_chars=2)
    assert tool("巴黎 首都", trajectory=["<search>巴黎 首都</search>"]) == "巴黎是法国的首都。"
  prompt = reply.bodies[0]["messages"][0]["content"]
  docs = (
    '**Web Page 1:**\n{\n  "id": 1,\n  "title": "巴黎",\n  "url": "doc-2",\n  "site_name": "",\n  "date": "",\n'
    '  "snippet": "巴黎是法国的首都",\n  "context": "言。巴黎是法国的首都！埃"\n}\n'  # jieba's words, split at 。！？
  )
  assert prompt == official_prompt_cn("Step 1: <search>巴黎 首都</search>", "巴黎 首都", docs)


def test_no_hits_still_asks_the_summariser_and_an_empty_query_searches_nothing():
  reply = _reply("**Final Information**\nNothing found.")
  with chat_server(reply) as (url, _):
    backend = Hits([])
    tool = SdsBrowseTool(backend, sds_summarizer(url, "s"))
    assert tool("q") == "Nothing found."
    assert tool("  ") == "" and backend.queries == [("q", 10)]
  assert reply.bodies[0]["messages"][0]["content"] == official_prompt_en("", "q", "")


# ------------------------------------------------------------------------------------------------ live pages and PDFs
def _tiny_pdf(pages):
  """A PDF of one Helvetica text line per page, written by hand (offsets and xref exact)."""
  n = len(pages)
  objs = [
    "<< /Type /Catalog /Pages 2 0 R >>",
    f"<< /Type /Pages /Kids [{' '.join(f'{3 + 2 * i} 0 R' for i in range(n))}] /Count {n} >>",
  ]
  for i, text in enumerate(pages):
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET"
    objs.append(
      f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {4 + 2 * i} 0 R "
      f"/Resources << /Font << /F1 {3 + 2 * n} 0 R >> >> >>"
    )
    objs.append(f"<< /Length {len(stream)} >>\nstream\n{stream}\nendstream")
  objs.append("<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
  out, offsets = b"%PDF-1.4\n", []
  for i, obj in enumerate(objs, start=1):
    offsets.append(len(out))
    out += f"{i} 0 obj\n{obj}\nendobj\n".encode()
  xref = len(out)
  out += f"xref\n0 {len(objs) + 1}\n0000000000 65535 f \n".encode()
  out += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
  out += f"trailer\n<< /Size {len(objs) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
  return out


def test_pdf_text_joins_the_pages_and_keeps_600_words():
  assert pdf_text(_tiny_pdf(["alpha beta", "gamma"])) == "alpha betagamma"  # pages joined with nothing between
  words = " ".join(f"w{i}" for i in range(700))
  assert pdf_text(_tiny_pdf([words])) == " ".join(f"w{i}" for i in range(600))


def test_a_missing_pdf_reader_names_its_install_command(monkeypatch):
  import importlib.util
  import sys

  monkeypatch.setitem(sys.modules, "pdfplumber", None)  # import pdfplumber now raises ImportError
  with pytest.raises(ImportError, match="pip install pdfplumber"):
    pdf_text(b"%PDF-1.4")
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pdfplumber" else real(name, *a))
  with pytest.raises(ValueError, match="pip install pdfplumber"):
    SdsBrowseTool(Hits([]), None, live=True)


def test_visible_text_is_beautifulsoups_get_text_with_spaces():
  markup = (
    "<!DOCTYPE html><html><head><title> T </title><style>p{}</style><script>var a;</script></head><body>"
    "<p>Hello <b>world</b>.</p><!-- hidden --><template>tpl</template><ruby>漢<rt>kan</rt></ruby>"
    "<p>a &amp; b</p><br/>End</body></html>"
  )
  assert visible_text(markup) == "T Hello world . 漢 a & b End"


PDF = _tiny_pdf(["Campfire Tales is a 1997 horror film."])


@pytest.fixture()
def page_server():
  routes = {
    "/page.html": (
      200,
      "text/html; charset=utf-8",
      "<html><body><p>Her film debut was Campfire Tales.</p></body></html>".encode(),
    ),
    "/latin.html": (200, "text/html", "<p>café</p>".encode()),  # no charset: requests reads text/* as ISO-8859-1
    "/doc.pdf": (200, "application/pdf", PDF),
    "/long.html": (200, "text/html; charset=utf-8", ("<p>" + "x" * 30000 + "</p>").encode()),
  }

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 -- http.server's name
      Handler.agents.append(self.headers.get("User-Agent"))
      status, ctype, body = routes.get(self.path, (404, "text/html", b"not found"))
      self.send_response(status)
      self.send_header("Content-Type", ctype)
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def log_message(self, *args):
      pass

  Handler.agents = []
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    yield f"http://127.0.0.1:{server.server_address[1]}", Handler.agents
  finally:
    server.shutdown()
    server.server_close()


def test_live_pages_are_read_as_extract_text_from_url(page_server):
  base, agents = page_server
  assert fetch_page_text(base + "/page.html") == "Her film debut was Campfire Tales."
  assert fetch_page_text(base + "/latin.html") == "cafÃ©"
  assert fetch_page_text(base + "/doc.pdf") == "Campfire Tales is a 1997 horror film."
  assert fetch_page_text(base + "/long.html") == "x" * 20000
  assert fetch_page_text(base + "/missing").startswith("HTTP error occurred: 404")
  assert agents[0].startswith("Mozilla/5.0 (Windows NT 10.0; Win64; x64)")  # the official request headers


def test_live_hits_go_through_the_window_and_failed_fetches_are_marked(page_server):
  base, _ = page_server
  backend = Hits(
    [
      SearchHit("PDF", "Campfire Tales 1997 horror film", url=base + "/doc.pdf"),
      SearchHit("Gone", "x", url=base + "/missing"),
    ]
  )
  tool = SdsBrowseTool(backend, None, live=True)
  docs = tool.documents(backend.search("q", 10))
  assert '"context": "Campfire Tales is a 1997 horror film."' in docs
  assert '"context": "Web Page content cannot fetch"' in docs
  assert tool.metrics()["pages_live"] == 2 and tool.metrics()["pages_unfetched"] == 1


# ------------------------------------------------------------------------------------------------ the agent's trajectory
def test_trajectory_steps_are_the_runs_of_model_and_tool_tokens():
  def decode(ids):
    return "".join(chr(96 + i) for i in ids)

  assert trajectory_steps([1, 2, 3, 4, 5, 6, 7], [1, 1, 0, 0, 1, 1, 1], decode) == ["ab", "cd", "efg"]
  assert trajectory_steps([], [], decode) == []


def test_the_toolset_gives_the_trajectory_only_to_tools_that_want_it():
  seen = []

  class Wants:
    wants_trajectory = True

    def __call__(self, content, trajectory=None):
      seen.append((content, trajectory))
      return "read"

  tools = ToolSet({"search": Wants(), "python": lambda code: "ran " + code}, mode="eval")
  try:
    assert tools.wants_trajectory("search") and not tools.wants_trajectory("python")
    steps = ["<search>q</search>"]
    assert tools.execute(ToolCall("search", "q"), CallState(), trajectory=steps).text == "read"
    assert tools.execute(ToolCall("python", "1"), CallState(), trajectory=steps).text == "ran 1"  # one argument
    assert seen == [("q", steps)]
  finally:
    tools.shutdown()


def test_a_tools_own_call_timeout_bounds_its_calls():
  import time

  class Slow:
    call_timeout_s = 0.2

    def __call__(self, content):
      time.sleep(1.0)
      return "late"

  tools = ToolSet({"search": Slow()}, mode="eval", timeout_s=30.0)
  try:
    out = tools.execute(ToolCall("search", "q"), CallState())
  finally:
    tools.shutdown()
  assert not out.ok and "limit 0.2 s" in out.text


# ------------------------------------------------------------------------------------------------ the evaluation's wiring
def test_the_evaluation_builds_the_browser_its_variant_names(tmp_path):
  from aepo_jax.eval import EvalInputError, EvalSettings, build_tools, check_inputs

  store = tmp_path / "pages.jsonl"
  _store(tmp_path)

  def reply(body):  # each variant's marker: the other's would not be read
    return ("**最终信息**" if "任务说明" in body["messages"][0]["content"] else "**Final Information**") + "\nOK"

  with chat_server(reply) as (url, _):
    kw = dict(search_backend="local", search_options={"corpus": str(store)})
    browse = {"pages": str(store), "summarizer_url": url, "summarizer_model": "m"}
    with pytest.raises(EvalInputError, match="--browse_variant='sds_fr'"):
      check_inputs("smollm2-135m-instruct", "math500", browse={**browse, "variant": "sds_fr"}, **kw)
    for variant, kind in (
      (None, BrowseTool),
      ("project", BrowseTool),
      ("sds", SdsBrowseTool),
      ("sds_cn", SdsBrowseTool),
    ):
      plan = check_inputs("smollm2-135m-instruct", "math500", browse={**browse, "variant": variant}, **kw)
      tools = build_tools(plan, EvalSettings())
      try:
        tool = tools.tools["search"]
        assert type(tool) is kind, variant
        if kind is SdsBrowseTool:
          assert tool.variant == variant and tools.wants_trajectory("search")
          assert tools.execute(ToolCall("search", "Amy Smart"), CallState(), trajectory=[]).text == "OK"
      finally:
        tools.shutdown()
