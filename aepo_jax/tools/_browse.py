"""The browse form of search used by the deep-search evaluation ("SDS", spec §2.5): search, fetch the hits'
pages, and let an LLM condense them into the result.

    store = PageStore("pages/")                     # or a corpus JSONL, e.g. the retrieval server's corpus
    tool = BrowseTool(backend, ChatClient(url, model), pages=store)
    tool("Amy Smart film debut")                    # -> the summariser's text about what the pages say

Pages come from a local store: a corpus JSONL ({"id", "contents": "title\\ntext"}, {"id", "title", "text"} or
{"url", "title", "text"} per line) or a directory of such JSONL / JSON files and of .txt / .md / .html pages
(named by their stem and by their path inside the directory). A hit's page is looked up by its url (the
document id for the retrieval backends), then by its title; a hit with no page keeps its snippet, unless
`live=True` fetches its http(s) URL. The store keeps only an index of byte offsets in memory, so a
multi-gigabyte corpus costs one pass to index and then one read per page.

This module's BrowseTool is the project's browser (its own prompt, the first `page_chars` of each page). The official
SDS browser as released (previous reasoning in the prompt, snippet-anchored windows, `**Final Information**`) is
`_sds.SdsBrowseTool`, over the same PageStore (browse variant 'sds' / 'sds_cn').
"""

import html.parser
import json
import logging
import os
import threading

from aepo_jax.tools._search import NO_RESULTS, SearchBackend, SearchHit, clean_query

log = logging.getLogger(__name__)

SEARCH_MODES = ("snippets", "browse")  # tools.search_mode: the training tool's Page lines | this module
# browse.variant: this module's BrowseTool | the official SDS browser as released, English | Chinese (_sds.py)
BROWSE_VARIANTS = ("project", "sds", "sds_cn")

SUMMARY_PROMPT = (
  "You are a research assistant reading web pages for another agent.\n\n"
  "Search query: {query}\n\n"
  "Pages:\n{pages}\n\n"
  "Write down, concisely and factually, everything in these pages that helps answer the search query: names, "
  "numbers, dates and the page each fact comes from. Do not add knowledge that is not in the pages. If the "
  "pages hold nothing relevant, say \"No relevant information found.\""
)
_TEXT_SUFFIXES = (".txt", ".md", ".html", ".htm")


class _TextOfHtml(html.parser.HTMLParser):
  def __init__(self):
    super().__init__()
    self.parts, self._skip = [], 0

  def handle_starttag(self, tag, attrs):
    if tag in ("script", "style", "noscript"):
      self._skip += 1

  def handle_endtag(self, tag):
    if tag in ("script", "style", "noscript") and self._skip:
      self._skip -= 1
    elif tag in ("p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "section"):
      self.parts.append("\n")

  def handle_data(self, data):
    if not self._skip:
      self.parts.append(data)


def html_to_text(markup: str) -> str:
  """Visible text of an HTML page (scripts and styles dropped, blank runs collapsed)."""
  parser = _TextOfHtml()
  parser.feed(markup)
  lines = (" ".join(line.split()) for line in "".join(parser.parts).splitlines())
  return "\n".join(line for line in lines if line)


def _record_page(rec) -> tuple:
  """(keys, title, text) of one corpus / page record, or None when it has no text."""
  if not isinstance(rec, dict):
    return None
  if isinstance(rec.get("contents"), str):
    title, _, text = rec["contents"].partition("\n")
  elif isinstance(rec.get("text"), str):
    title, text = str(rec.get("title", "")), rec["text"]
  else:
    return None
  title = title.strip().strip('"')
  keys = [str(rec[k]) for k in ("url", "id") if rec.get(k) not in (None, "")]
  return keys, title, text.strip()


class PageStore:
  """Pages by url / id / title from a corpus JSONL or a directory (see the module docstring)."""

  def __init__(self, path: str):
    if not os.path.exists(path):
      raise FileNotFoundError(
        f"page store {path!r} does not exist; give a directory of pages or a corpus JSONL "
        "(tools.browse.pages / --browse_pages)"
      )
    self.path = path
    self._by_key: dict = {}  # url / id / file key -> (file, offset or None)
    self._by_title: dict = {}  # title (case-folded) -> (file, offset or None)
    self._lock = threading.Lock()
    files = (
      [path]
      if os.path.isfile(path)
      else sorted(os.path.join(root, f) for root, _, names in os.walk(path) for f in names)
    )
    for f in files:
      if f.endswith((".jsonl", ".json")):
        self._index_jsonl(f)
      elif f.endswith(_TEXT_SUFFIXES):
        rel = os.path.relpath(f, path) if os.path.isdir(path) else os.path.basename(f)
        stem = os.path.splitext(os.path.basename(f))[0]
        for key in (rel, os.path.splitext(rel)[0], stem):
          self._by_key.setdefault(key, (f, None))
        self._by_title.setdefault(stem.replace("_", " ").casefold(), (f, None))
    if not self._by_key and not self._by_title:
      raise ValueError(
        f"page store {path!r} holds no pages (JSONL records with 'contents' or 'text', or "
        f"{'/'.join(_TEXT_SUFFIXES)} files)"
      )

  def _index_jsonl(self, f: str) -> None:
    with open(f, "rb") as fh:
      offset = 0
      for line_no, line in enumerate(fh, start=1):
        here, offset = offset, offset + len(line)
        if not line.strip():
          continue
        try:
          page = _record_page(json.loads(line))
        except ValueError as e:
          raise ValueError(
            f"{f}:{line_no}: not valid JSON ({e}); a page store holds one JSON object per line"
          ) from None
        if page is None:
          raise ValueError(
            f"{f}:{line_no}: a page needs a string field 'contents' (\"title\\ntext\") or "
            "'text' (with 'url' / 'id' / 'title' to find it by)"
          )
        keys, title, _ = page
        for key in keys:
          self._by_key.setdefault(key, (f, here))
        if title:
          self._by_title.setdefault(title.casefold(), (f, here))

  def __len__(self) -> int:
    return len(self._by_key)

  def _read(self, where) -> str:
    f, offset = where
    if offset is None:
      with open(f, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
      return html_to_text(text) if f.endswith((".html", ".htm")) else text.strip()
    with self._lock, open(f, "rb") as fh:
      fh.seek(offset)
      line = fh.readline()
    _, title, text = _record_page(json.loads(line))
    return f"{title}\n{text}" if title else text

  def get(self, hit: SearchHit):
    """The page text of a hit, or None when the store does not hold it."""
    where = self._by_key.get(hit.url) if hit.url else None
    if where is None and hit.title:
      where = self._by_title.get(hit.title.strip().strip('"').casefold())
    return None if where is None else self._read(where)


def fetch_page(url: str, *, timeout_s: float = 20.0, max_bytes: int = 4 << 20) -> str:
  """Text of a live http(s) page (HTML reduced to its visible text)."""
  from aepo_jax.tools._http import http_request

  status, body = http_request(
    "GET", url, headers={"User-Agent": "aepo_jax-browse"}, timeout_s=timeout_s, max_bytes=max_bytes
  )
  if status >= 400:
    raise OSError(f"GET {url} answered HTTP {status}")
  text = body.decode("utf-8", errors="replace")
  return html_to_text(text) if "<" in text[:2000] else text


class BrowseTool:
  """The `search` tool in browse form: query -> the summariser's account of the top hits' pages.

  backend: any SearchBackend; summarizer: anything with `complete(prompt) -> str` (e.g. `ChatClient`);
  pages: a PageStore or None (snippets only, or live pages); max_pages: hits read per query; page_chars: the
  characters of each page the summariser sees; live: fetch http(s) URLs the store lacks.
  A summariser failure raises, so the ToolSet retries it and then reports the error to the model.
  """

  tag = "search"

  def __init__(
    self,
    backend: SearchBackend,
    summarizer,
    *,
    pages: PageStore | None = None,
    topk: int = 10,
    max_pages: int = 10,
    page_chars: int = 5000,
    live: bool = False,
  ):
    if max_pages < 1 or page_chars < 1:
      raise ValueError(f"BrowseTool(max_pages={max_pages}, page_chars={page_chars}): both must be >= 1")
    self.backend, self.summarizer, self.pages = backend, summarizer, pages
    self.topk, self.max_pages, self.page_chars, self.live = topk, max_pages, page_chars, live
    self.stats = {"pages_from_store": 0, "pages_live": 0, "pages_snippet_only": 0}

  def page_text(self, hit: SearchHit) -> str:
    text = self.pages.get(hit) if self.pages is not None else None
    if text is not None:
      self.stats["pages_from_store"] += 1
      return text
    if self.live and hit.url.startswith(("http://", "https://")):
      try:
        text = fetch_page(hit.url)
        self.stats["pages_live"] += 1
        return text
      except (OSError, ValueError) as e:
        log.info("browse: %s could not be fetched (%s); using its snippet", hit.url, e)
    self.stats["pages_snippet_only"] += 1
    return f"{hit.title}\n{hit.text}" if hit.title else hit.text

  def __call__(self, query: str) -> str:
    query = clean_query(query)
    if not query:
      return ""  # empty output: the ToolSet reports it as such
    hits = self.backend.search(query, self.topk)[: self.max_pages]
    if not hits:
      return NO_RESULTS
    pages = "\n\n".join(
      f"Page {i} ({hit.url or hit.title or 'untitled'}):\n{self.page_text(hit)[: self.page_chars]}"
      for i, hit in enumerate(hits, start=1)
    )
    return self.summarizer.complete(SUMMARY_PROMPT.format(query=query, pages=pages)).strip()
