"""The search tool: one small backend interface, query cleaning and result text (spec §4).

    tool = SearchTool(ReplayBackend("../shared/data/arpo/search_cache.json"))
    tool("Amy Smart film debut Campfire Tales")  # "Page 1: ...\\nPage 2: ..."

Backends: ReplayBackend (the official cache), CachedBackend (persistent sqlite cache around any backend),
RetrievalBackend (_retrieval.py, our Search-R1-style server) and the web backends (_web.py).
"""

import dataclasses
import json
import logging
import os
import re
import sqlite3
import threading
from typing import Protocol

log = logging.getLogger(__name__)

NO_RESULTS = "No search results found."
SNIPPET_CHARS = 1000  # each "Page i:" snippet is cut to this many characters (official tool)


class SearchError(RuntimeError):
  """A backend could not answer (network failure after retries, bad response, cache miss in 'error' mode)."""


@dataclasses.dataclass(frozen=True)
class SearchHit:
  title: str
  text: str
  url: str = ""


class SearchBackend(Protocol):
  def search(self, query: str, topk: int) -> list[SearchHit]: ...


def clean_query(query: str) -> str:
  """As the official tool: strip whitespace and remove double quotes."""
  return query.strip().replace('"', "")


def format_hits(hits: list[SearchHit], include_titles: bool = False, snippet_chars: int = SNIPPET_CHARS) -> str:
  """`Page i: <snippet>` lines (snippet cut to `snippet_chars`), or 'No search results found.'."""
  lines = []
  for i, hit in enumerate(hits, start=1):
    snippet = f"{hit.title}: {hit.text}" if include_titles and hit.title else hit.text
    lines.append(f"Page {i}: {snippet[:snippet_chars]}")
  return "\n".join(lines) if lines else NO_RESULTS


_PAGE_RE = re.compile(r"(?:^|\n)Page (\d+): ")


def parse_pages(text: str) -> list[SearchHit]:
  """Inverse of format_hits (without titles): cached text back into hits, so format(parse(t)) == t."""
  if text == NO_RESULTS or not text:
    return []
  marks = list(_PAGE_RE.finditer(text))
  # Only consecutive "Page 1:", "Page 2:", ... start a page; anything else belongs to the snippet.
  starts, expect = [], 1
  for m in marks:
    if int(m.group(1)) == expect:
      starts.append(m)
      expect += 1
  if not starts or starts[0].start() != 0:
    return [SearchHit(title="", text=text)]
  hits = []
  for i, m in enumerate(starts):
    end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
    hits.append(SearchHit(title="", text=text[m.end() : end]))
  return hits


class SearchTool:
  """The `search` tool for ToolSet: query -> result text."""

  tag = "search"

  def __init__(
    self, backend: SearchBackend, topk: int = 10, include_titles: bool = False, snippet_chars: int = SNIPPET_CHARS
  ):
    self.backend, self.topk = backend, topk
    self.include_titles, self.snippet_chars = include_titles, snippet_chars

  def __call__(self, query: str) -> str:
    query = clean_query(query)
    if not query:
      return ""  # empty output: ToolSet reports it as such
    hits = self.backend.search(query, self.topk)
    return format_hits(hits[: self.topk], self.include_titles, self.snippet_chars)

  def metrics(self) -> dict[str, float]:
    """The backend's own cumulative counters (e.g. RetrievalBackend's HTTP retries), for ToolSet.metrics()."""
    counters = getattr(self.backend, "metrics", None)
    return counters() if callable(counters) else {}


class ReplayBackend:
  """Exact lookup in a {query: formatted text} cache such as ../shared/data/arpo/search_cache.json.

  on_miss='error' raises SearchError naming the query; on_miss='empty' logs it and returns no hits
  (the tool then says 'No search results found.'). `misses` counts misses.
  """

  def __init__(self, path: str, on_miss: str = "error"):
    if on_miss not in ("error", "empty"):
      raise ValueError(f"ReplayBackend(on_miss={on_miss!r}); expected 'error' or 'empty'")
    if not os.path.exists(path):
      raise FileNotFoundError(f"search cache {path!r} does not exist (expected a JSON object query -> text)")
    with open(path, encoding="utf-8") as f:
      table = json.load(f)
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
      raise ValueError(f"search cache {path!r} must be a JSON object mapping query strings to result strings")
    self.path, self.on_miss, self.misses = path, on_miss, 0
    self._table = {clean_query(k): v for k, v in table.items()}
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return len(self._table)

  def lookup(self, query: str) -> str | None:
    return self._table.get(clean_query(query))

  def search(self, query: str, topk: int) -> list[SearchHit]:
    text = self.lookup(query)
    if text is None:
      with self._lock:
        self.misses += 1
      if self.on_miss == "error":
        raise SearchError(
          f"query {clean_query(query)!r} is not in the replay cache {self.path!r} "
          f"({len(self._table)} entries); use on_miss='empty' to answer '{NO_RESULTS}'"
        )
      log.info("replay cache miss: %r", query)
      return []
    return parse_pages(text)[:topk]


class CachedBackend:
  """Persistent on-disk cache (sqlite, one table) in front of another backend; safe to share between threads.

  Only successful answers are stored; errors propagate and are retried next time.
  """

  def __init__(self, backend: SearchBackend, path: str, namespace: str = ""):
    self.backend, self.path = backend, path
    self.namespace = namespace or type(backend).__name__
    self.hits = self.misses = 0
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self._lock = threading.Lock()
    self._db = sqlite3.connect(path, check_same_thread=False, timeout=30)
    with self._lock, self._db:
      self._db.execute("PRAGMA journal_mode=WAL")
      self._db.execute(
        "CREATE TABLE IF NOT EXISTS search (ns TEXT, query TEXT, topk INTEGER, hits TEXT, "
        "PRIMARY KEY (ns, query, topk))"
      )

  def search(self, query: str, topk: int) -> list[SearchHit]:
    key = (self.namespace, query, topk)
    with self._lock:
      row = self._db.execute("SELECT hits FROM search WHERE ns=? AND query=? AND topk=?", key).fetchone()
      if row is not None:
        self.hits += 1
        return [SearchHit(**h) for h in json.loads(row[0])]
      self.misses += 1
    hits = self.backend.search(query, topk)  # outside the lock: slow backends run concurrently
    blob = json.dumps([dataclasses.asdict(h) for h in hits], ensure_ascii=False)
    with self._lock, self._db:
      self._db.execute("INSERT OR REPLACE INTO search VALUES (?, ?, ?, ?)", (*key, blob))
    return hits

  def close(self) -> None:
    with self._lock:
      self._db.close()
