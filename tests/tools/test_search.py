"""Search: query cleaning, page formatting, the replay cache, the sqlite cache, and web backends against a fake
server on 127.0.0.1 (nothing leaves the machine)."""

import http.server
import json
import os
import threading
import time
import urllib.parse

import pytest

from aepo_jax.tools import (
  NO_RESULTS,
  BingBackend,
  BraveBackend,
  CachedBackend,
  ReplayBackend,
  SearchError,
  SearchHit,
  SearchTool,
  SerperBackend,
  clean_query,
  format_hits,
  http_request,
  make_search_backend,
  parse_pages,
)

CACHE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "arpo", "search_cache.json")
CACHE = os.environ.get("AEPO_SEARCH_CACHE", os.path.abspath(CACHE))
needs_cache = pytest.mark.skipif(not os.path.exists(CACHE), reason=f"ARPO search cache not at {CACHE}")


def test_clean_query_and_format():
  assert clean_query('  "Amy Smart" film debut \n') == "Amy Smart film debut"
  hits = [SearchHit("T1", "a" * 1500), SearchHit("T2", "second")]
  text = format_hits(hits)
  assert text == "Page 1: " + "a" * 1000 + "\nPage 2: second"
  assert format_hits(hits, include_titles=True).splitlines()[1] == "Page 2: T2: second"
  assert format_hits([]) == NO_RESULTS == "No search results found."


@needs_cache
def test_replay_round_trips_every_cached_entry():
  with open(CACHE) as f:
    table = json.load(f)
  backend = ReplayBackend(CACHE)
  tool = SearchTool(backend, topk=10)
  assert len(backend) == len(table) == 1000
  for query, text in table.items():
    # The tool reproduces the cached text exactly (the official cache holds <= 10 pages, no titles).
    assert tool(query) == text, query
  assert parse_pages(NO_RESULTS) == []


@needs_cache
def test_replay_cleans_query_and_reports_misses():
  backend = ReplayBackend(CACHE)
  tool = SearchTool(backend)
  assert tool('  "Amy Smart film debut Campfire Tales" ').startswith("Page 1: The film is made up of")
  with pytest.raises(SearchError, match="not in the replay cache"):
    tool("a query nobody ever cached")
  lenient = SearchTool(ReplayBackend(CACHE, on_miss="empty"))
  assert lenient("a query nobody ever cached") == NO_RESULTS
  assert lenient.backend.misses == 1
  assert len(SearchTool(backend, topk=3)("Amy Smart film debut Campfire Tales").splitlines()) == 3


def test_replay_bad_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    ReplayBackend(str(tmp_path / "missing.json"))
  bad = tmp_path / "bad.json"
  bad.write_text("[1, 2]")
  with pytest.raises(ValueError, match="must be a JSON object"):
    ReplayBackend(str(bad))
  with pytest.raises(ValueError, match="on_miss='skip'"):
    ReplayBackend(str(bad), on_miss="skip")


class CountingBackend:
  def __init__(self):
    self.calls, self._lock = 0, threading.Lock()

  def search(self, query, topk):
    with self._lock:
      self.calls += 1
    return [SearchHit(f"title {query}", f"text {i}", f"u{i}") for i in range(topk)]


def test_cached_backend_persists_and_is_thread_safe(tmp_path):
  path = str(tmp_path / "cache" / "search.sqlite")
  inner = CountingBackend()
  cached = CachedBackend(inner, path)
  threads = [threading.Thread(target=lambda i=i: cached.search(f"q{i % 5}", 3)) for i in range(40)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert 5 <= inner.calls <= 40 and cached.hits + cached.misses == 40
  cached.close()
  # A new process (here: a new object) reads the stored answers without calling the backend.
  inner2 = CountingBackend()
  again = CachedBackend(inner2, path, namespace="CountingBackend")
  assert again.search("q3", 3) == inner.search("q3", 3) and inner2.calls == 0
  assert again.search("q3", 2) and inner2.calls == 1  # topk is part of the key


# ------------------------------------------------------------------ web backends against a loopback fake
class FakeSearchAPI(http.server.BaseHTTPRequestHandler):
  requests: list = []
  fail_first: int = 0

  def log_message(self, *a):
    pass

  def _reply(self, status, payload):
    body = json.dumps(payload).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)

  def _handle(self, method):
    url = urllib.parse.urlparse(self.path)
    length = int(self.headers.get("Content-Length") or 0)
    body = json.loads(self.rfile.read(length)) if length else None
    type(self).requests.append(
      {
        "method": method,
        "path": url.path,
        "query": urllib.parse.parse_qs(url.query),
        "headers": dict(self.headers),
        "body": body,
      }
    )
    if type(self).fail_first > 0:
      type(self).fail_first -= 1
      self._reply(503, {"error": "busy"})
      return
    if url.path == "/serper":
      if self.headers.get("X-API-KEY") != "k-serper":
        return self._reply(401, {"message": "bad key"})
      n = body["num"]
      organic = [{"title": f"S{i}", "link": f"https://s/{i}", "snippet": f"serper {body['q']} {i}"} for i in range(n)]
      self._reply(200, {"organic": organic})
    elif url.path == "/brave":
      q = urllib.parse.parse_qs(url.query)
      result = {"title": "B", "url": "https://b", "description": f"brave {q['q'][0]}"}
      self._reply(200, {"web": {"results": [result]}})
    elif url.path == "/bing":
      self._reply(200, {"webPages": {"value": [{"name": "N", "url": "https://n", "snippet": "bing snippet"}]}})
    elif url.path == "/broken":
      self._reply(200, {"unexpected": True})

  def do_GET(self):
    self._handle("GET")

  def do_POST(self):
    self._handle("POST")


@pytest.fixture
def fake_api():
  FakeSearchAPI.requests, FakeSearchAPI.fail_first = [], 0
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeSearchAPI)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  yield f"http://127.0.0.1:{server.server_address[1]}"
  server.shutdown()
  server.server_close()


def test_serper_request_and_response(fake_api, monkeypatch):
  monkeypatch.setenv("SERPER_API_KEY", "k-serper")
  backend = SerperBackend(base_url=fake_api + "/serper")
  text = SearchTool(backend, topk=3)('"Zorblat" capital')
  assert text == (
    "Page 1: serper Zorblat capital 0\nPage 2: serper Zorblat capital 1\nPage 3: serper Zorblat capital 2"
  )
  req = FakeSearchAPI.requests[-1]
  assert req["method"] == "POST" and req["body"] == {"q": "Zorblat capital", "num": 3}
  assert req["headers"]["Content-Type"] == "application/json"


def test_brave_and_bing_requests(fake_api, monkeypatch):
  monkeypatch.setenv("BRAVE_API_KEY", "k-brave")
  monkeypatch.setenv("MY_BING", "k-bing")
  hits = BraveBackend(base_url=fake_api + "/brave").search("flin river", 5)
  assert hits == [SearchHit("B", "brave flin river", "https://b")]
  req = FakeSearchAPI.requests[-1]
  assert req["method"] == "GET" and req["query"] == {"q": ["flin river"], "count": ["5"]}
  assert req["headers"]["X-Subscription-Token"] == "k-brave"
  hits = BingBackend(api_key_env="MY_BING", base_url=fake_api + "/bing").search("x", 10)
  assert hits[0].text == "bing snippet"
  assert FakeSearchAPI.requests[-1]["headers"]["Ocp-Apim-Subscription-Key"] == "k-bing"
  assert FakeSearchAPI.requests[-1]["query"]["mkt"] == ["en-US"]


def test_web_errors_are_clear(fake_api, monkeypatch):
  monkeypatch.delenv("SERPER_API_KEY", raising=False)
  with pytest.raises(SearchError, match="SERPER_API_KEY"):
    SerperBackend(base_url=fake_api + "/serper")
  monkeypatch.setenv("SERPER_API_KEY", "wrong")
  backend = SerperBackend(base_url=fake_api + "/serper", retries=3, backoff_s=0.01)
  with pytest.raises(SearchError, match="HTTP 401"):
    backend.search("q", 3)
  assert len(FakeSearchAPI.requests) == 1  # a 401 is not retried
  monkeypatch.setenv("BING_API_KEY", "k")
  with pytest.raises(SearchError, match="webPages.value"):
    BingBackend(base_url=fake_api + "/broken").search("q", 3)
  with pytest.raises(ValueError, match="unknown; choose one of"):
    make_search_backend("google")


def test_web_retries_transient_errors(fake_api, monkeypatch, tmp_path):
  monkeypatch.setenv("SERPER_API_KEY", "k-serper")
  FakeSearchAPI.fail_first = 2
  backend = make_search_backend(
    "serper", base_url=fake_api + "/serper", retries=3, backoff_s=0.01, cache_path=str(tmp_path / "web.sqlite")
  )
  assert backend.search("q", 1)[0].text == "serper q 0"
  assert len(FakeSearchAPI.requests) == 3 and backend.backend.client.stats["retries"] == 2
  backend.search("q", 1)
  assert len(FakeSearchAPI.requests) == 3  # second answer from the persistent cache


# ------------------------------------------------------------------ whole-call deadlines
def test_slow_body_cannot_hold_a_web_call(dribble_server, monkeypatch):
  monkeypatch.setenv("SERPER_API_KEY", "k")
  backend = SerperBackend(base_url=dribble_server + "/serper", timeout_s=2, retries=0)
  start = time.monotonic()
  # The message names what remained of the attempt's 2 s at the request (.3g): 1.99 if taking the slot took >5 ms.
  with pytest.raises(SearchError, match=r"no complete answer within (2|1\.9\d) s"):
    backend.search("q", 3)
  # The dribbled body takes ~70 s; ending within 20 s proves the 2 s deadline cut it (slack for a loaded machine).
  assert time.monotonic() - start < 20


def test_http_request_deadline_covers_headers_and_body(dribble_server, fake_api):
  start = time.monotonic()
  with pytest.raises(TimeoutError, match="no complete answer within 1 s"):
    http_request("GET", dribble_server, timeout_s=1)
  assert time.monotonic() - start < 15  # not the ~70 s the dribbled body takes (slack for a loaded machine)
  status, body = http_request("GET", fake_api + "/bing", timeout_s=5)
  assert status == 200 and json.loads(body)["webPages"]["value"][0]["name"] == "N"
  status, body = http_request("POST", fake_api + "/serper", data=b'{"q": "x", "num": 1}', timeout_s=5)
  assert status == 401 and json.loads(body) == {"message": "bad key"}  # an error status is returned, not raised
