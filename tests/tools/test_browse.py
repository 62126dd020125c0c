"""The browse form of search (the evaluation's SDS browser, spec §2.5): pages from a local store, condensed by an
LLM behind any OpenAI-compatible endpoint; selectable from training configs and the evaluation."""

import json

import pytest

from aepo_jax.testing import chat_server
from aepo_jax.tools import (
  NO_RESULTS,
  BrowseTool,
  CallState,
  ChatClient,
  ChatError,
  PageStore,
  SearchHit,
  ToolCall,
  html_to_text,
)

CORPUS = [
  {
    "id": "doc-1",
    "contents": '"Amy Smart"\nAmy Smart is an American actress. Her film debut was Campfire Tales '
    "(1997), followed by Starship Troopers.",
  },
  {"id": "doc-2", "title": "Campfire Tales", "text": "Campfire Tales is a 1997 horror anthology film."},
  {"url": "https://example.org/paris", "title": "Paris", "text": "Paris is the capital of France."},
]


def _corpus(path):
  path.write_text("".join(json.dumps(d) + "\n" for d in CORPUS))
  return str(path)


class Hits:
  """A search backend returning fixed hits (snippets only, as a web search does)."""

  def __init__(self, hits):
    self.hits, self.queries = hits, []

  def search(self, query, topk):
    self.queries.append(query)
    return self.hits[:topk]


class Recorder:
  def __init__(self, answer="Amy Smart's film debut was Campfire Tales (1997) [Page 1]."):
    self.answer, self.prompts = answer, []

  def complete(self, prompt):
    self.prompts.append(prompt)
    return self.answer


def test_page_store_from_a_corpus_file_and_from_a_directory(tmp_path):
  store = PageStore(_corpus(tmp_path / "corpus.jsonl"))
  assert len(store) == 3
  assert store.get(SearchHit("", "snippet", url="doc-1")).startswith("Amy Smart\nAmy Smart is an American actress")
  assert (
    store.get(SearchHit("campfire tales", "x")) == "Campfire Tales\nCampfire Tales is a 1997 horror anthology film."
  )
  assert store.get(SearchHit("", "", url="https://example.org/paris")).endswith("capital of France.")
  assert store.get(SearchHit("Unknown", "x", url="nope")) is None

  pages = tmp_path / "pages"
  (pages / "wiki").mkdir(parents=True)
  (pages / "wiki" / "Eiffel_Tower.html").write_text(
    "<html><head><style>p{}</style><script>var x;</script></head><body><h1>Eiffel Tower</h1>"
    "<p>It is 330 m tall.</p></body></html>"
  )
  (pages / "notes.txt").write_text("Plain text page.")
  _corpus(pages / "more.jsonl")
  store = PageStore(str(pages))
  assert store.get(SearchHit("Eiffel Tower", "")) == "Eiffel Tower\nIt is 330 m tall."
  assert store.get(SearchHit("", "", url="wiki/Eiffel_Tower")) == "Eiffel Tower\nIt is 330 m tall."
  assert store.get(SearchHit("", "", url="notes")) == "Plain text page."
  assert store.get(SearchHit("", "", url="doc-2")).startswith("Campfire Tales")


def test_page_store_errors_name_the_file_and_line(tmp_path):
  with pytest.raises(FileNotFoundError, match="page store"):
    PageStore(str(tmp_path / "missing"))
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps(CORPUS[0]) + "\n" + json.dumps({"id": "x", "body": "no text"}) + "\n")
  with pytest.raises(ValueError, match=r"bad.jsonl:2: a page needs a string field 'contents'"):
    PageStore(str(bad))


def test_browse_reads_the_pages_not_the_snippets(tmp_path):
  store = PageStore(_corpus(tmp_path / "corpus.jsonl"))
  backend = Hits(
    [
      SearchHit("Amy Smart", "Amy Smart is an...", url="doc-1"),
      SearchHit("Somewhere", "only a snippet", url="https://unknown.example/x"),
    ]
  )
  summ = Recorder()
  tool = BrowseTool(backend, summ, pages=store, max_pages=5, page_chars=64)
  assert tool('"Amy Smart" film debut') == "Amy Smart's film debut was Campfire Tales (1997) [Page 1]."
  assert backend.queries == ["Amy Smart film debut"]  # cleaned as the official tool does
  [prompt] = summ.prompts
  assert "Search query: Amy Smart film debut" in prompt
  assert "Page 1 (doc-1):\nAmy Smart\nAmy Smart is an American actress. Her film debut was C" in prompt
  assert "Starship" not in prompt  # each page cut to page_chars
  assert "Page 2 (https://unknown.example/x):\nSomewhere\nonly a snippet" in prompt  # no page: the snippet
  assert tool.stats == {"pages_from_store": 1, "pages_live": 0, "pages_snippet_only": 1}
  assert BrowseTool(Hits([]), summ, pages=store)("anything") == NO_RESULTS
  assert tool("  ") == ""


def test_html_to_text():
  assert html_to_text("<p>a <b>b</b></p><script>x()</script><div>c</div>") == "a b\nc"


class Summariser:
  """Fails `fail` times with HTTP 500, then answers with the query line of the prompt."""

  def __init__(self):
    self.fail = 0

  def __call__(self, body):
    if self.fail:
      self.fail -= 1
      return 500
    prompt = body["messages"][0]["content"]
    line = next((l for l in prompt.splitlines() if l.startswith("Search query:")), "Search query: OK")
    return f"summary of {line[14:]}"


@pytest.fixture()
def summariser():
  rule = Summariser()
  with chat_server(rule) as (url, requests):
    yield url, requests, rule


def test_chat_client_retries_server_errors(summariser):
  url, requests, rule = summariser
  rule.fail = 1
  client = ChatClient(url, "m", retries=1, backoff_s=0.01)
  assert client.complete("Search query: q1") == "summary of q1"
  assert len(requests) == 2 and requests[-1]["model"] == "m"
  rule.fail = 5
  with pytest.raises(ChatError, match="failed after 2 attempts"):
    client.complete("x")
  with pytest.raises(ValueError, match="base URL and a model"):
    ChatClient("", "m")


def test_training_config_selects_browse(tmp_path, summariser):
  summariser_url, requests, _ = summariser
  from aepo_jax.train import _wiring, base_config, ConfigError, validate

  c = base_config()
  c.tools.names = ("search",)
  c.tools.search_backend, c.tools.search_corpus = "local", _corpus(tmp_path / "corpus.jsonl")
  c.tools.search_mode = "browse"
  with pytest.raises(ConfigError, match="tools.browse.summarizer_url"):
    validate(c)
  c.tools.browse.summarizer_url, c.tools.browse.summarizer_model = summariser_url, "m"
  validate(c)
  tools = _wiring.make_toolset(c, mode="eval")
  try:
    assert isinstance(tools.tools["search"], BrowseTool) and tools.tools["search"].pages is not None
    out = tools.execute(ToolCall("search", "Campfire Tales film"), CallState())
    assert out.ok and out.text == "summary of Campfire Tales film"
    assert "Campfire Tales is a 1997 horror anthology film." in requests[-1]["messages"][0]["content"]
  finally:
    tools.shutdown()
  c.tools.search_mode = "snipets"
  with pytest.raises(ConfigError, match=r"tools.search_mode='snipets' is not registered; did you mean 'snippets'"):
    validate(c)


def test_evaluation_checks_browse_inputs(tmp_path, summariser):
  summariser_url = summariser[0]
  from aepo_jax.eval import EvalInputError, EvalSettings, build_tools, check_inputs

  corpus = _corpus(tmp_path / "corpus.jsonl")
  kw = dict(search_backend="local", search_options={"corpus": corpus})
  with pytest.raises(EvalInputError, match="--summarizer_url"):
    check_inputs("smollm2-135m-instruct", "math500", browse={"pages": corpus}, **kw)
  with pytest.raises(EvalInputError, match="--browse_pages='.*nowhere' does not exist"):
    check_inputs(
      "smollm2-135m-instruct",
      "math500",
      browse={"pages": str(tmp_path / "nowhere"), "summarizer_url": summariser_url, "summarizer_model": "m"},
      **kw,
    )
  plan = check_inputs(
    "smollm2-135m-instruct",
    "math500",
    browse={"pages": corpus, "summarizer_url": summariser_url, "summarizer_model": "m"},
    **kw,
  )
  tools = build_tools(plan, EvalSettings())
  try:
    assert isinstance(tools.tools["search"], BrowseTool)
    assert tools.execute(ToolCall("search", "Paris"), CallState()).text == "summary of Paris"
  finally:
    tools.shutdown()
