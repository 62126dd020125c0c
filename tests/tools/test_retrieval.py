"""The retrieval server on loopback: correct top-1 for known made-up facts, Search-R1's API, index reuse, and a
client that survives the server being killed and restarted (and never hangs on a silent server)."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from aepo_jax.tools import (
    RetrievalBackend,
    RetrievalIndex,
    SearchError,
    SearchTool,
    load_corpus,
    make_search_backend,
    serve_in_thread,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUESTIONS = [
    ("capital city of the kingdom of Quenmar", "Zorblat"),
    ("which river flows through Dorra into the Sea of Vask", "Flin River"),
    ("highest peak of the Tarrow range", "Mount Kessa"),
    ("where was Queen Ysolde born", "Ysolde of Quenmar"),
    ("currency and anthem of the island nation Ossary", "Ossary"),
    ("orbital period of comet Varo-7", "Varo-7"),
]


@pytest.fixture(scope="module")
def bm25_server(corpus_path, tmp_path_factory):
    index = RetrievalIndex(corpus_path, str(tmp_path_factory.mktemp("index")))
    server, url = serve_in_thread(index)
    yield url
    server.shutdown()
    server.server_close()


def _post(url, payload):
    req = urllib.request.Request(url + "/retrieve", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_top1_for_known_facts(bm25_server):
    backend = RetrievalBackend(bm25_server, timeout_s=5)
    for question, title in QUESTIONS:
        hits = backend.search(question, 3)
        assert hits[0].title == title, (question, hits)
    text = SearchTool(backend, topk=2, include_titles=True)("capital city of the kingdom of Quenmar")
    assert text.startswith("Page 1: Zorblat: Zorblat is the capital city of the kingdom of Quenmar")
    assert SearchTool(backend)("qwxz nonexistentword") == "No search results found."


def test_search_r1_api_shape(bm25_server, facts):
    out = _post(bm25_server, {"queries": ["Flin River Dorra", "Mount Kessa"], "topk": 2, "return_scores": True})
    assert len(out["result"]) == 2 and len(out["result"][0]) == 2
    first = out["result"][0][0]
    assert set(first) == {"document", "score"} and first["score"] > 0
    assert first["document"]["contents"].split("\n")[0] == "Flin River" and first["document"]["id"] == "1"
    plain = _post(bm25_server, {"queries": ["Mount Kessa"], "topk": 1})
    assert set(plain["result"][0][0]) == {"id", "contents"}
    with urllib.request.urlopen(bm25_server + "/health", timeout=5) as r:
        assert json.loads(r.read()) == {"status": "ok", "docs": len(facts), "method": "bm25"}
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(bm25_server, {"queries": "not a list", "topk": 2})
    assert e.value.code == 400


def test_corpus_formats_and_errors(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "a", "title": "T", "text": "body"}) + "\n\n" +
                    json.dumps({"id": "b", "contents": "\"Quoted\"\nline1\nline2"}) + "\n")
    assert load_corpus(str(path)) == [{"id": "a", "title": "T", "text": "body"},
                                      {"id": "b", "title": "Quoted", "text": "line1\nline2"}]
    path.write_text('{"id": "a", "contents": "x"}\n{broken\n')
    with pytest.raises(ValueError, match=r"c.jsonl:2: not valid JSON"):
        load_corpus(str(path))
    path.write_text('{"id": "a", "body": "x"}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:1: needs a string field 'contents'"):
        load_corpus(str(path))


def test_index_is_saved_and_reused(corpus_path, tmp_path):
    d = str(tmp_path / "idx")
    RetrievalIndex(corpus_path, d)
    stamp = os.path.getmtime(os.path.join(d, "bm25", "params.index.json"))
    again = RetrievalIndex(corpus_path, d)  # loads, does not rebuild
    assert os.path.getmtime(os.path.join(d, "bm25", "params.index.json")) == stamp
    assert again.search(["Pell Observatory comet"], 1)[0][0][0]["title"] == "Pell Observatory"


def _start_server(corpus_path, index_dir, port, *extra):
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "retrieval_server.py"), "--corpus",
                             corpus_path, "--index", index_dir, "--port", str(port), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    line = proc.stdout.readline()  # blocks until READY (or the process dies)
    assert line.startswith("READY"), f"server did not start: {line!r}"
    return proc


def test_client_survives_server_kill_and_restart(corpus_path, tmp_path, free_port):
    port, index_dir = free_port, str(tmp_path / "idx")
    url = f"http://127.0.0.1:{port}"
    proc = _start_server(corpus_path, index_dir, port)
    try:
        backend = RetrievalBackend(url, timeout_s=2, retries=0)
        assert backend.search("highest peak of the Tarrow range", 1)[0].title == "Mount Kessa"
        proc.kill()
        proc.wait()
        start = time.monotonic()
        with pytest.raises(SearchError, match="failed after 1 attempts"):
            backend.search("highest peak", 1)  # connection refused: a clean error, at once
        assert time.monotonic() - start < 2

        # Restart the server while a patient client is retrying: the call then succeeds.
        patient = RetrievalBackend(url, timeout_s=2, retries=6, backoff_s=0.25)
        restarted = []
        threading.Timer(0.5, lambda: restarted.append(_start_server(corpus_path, index_dir, port))).start()
        start = time.monotonic()
        hits = patient.search("capital city of the kingdom of Quenmar", 1)
        assert hits[0].title == "Zorblat" and time.monotonic() - start < 20
        assert patient.client.stats["retries"] >= 1
        proc = restarted[0]
    finally:
        proc.kill()
        proc.wait()


def test_silent_server_times_out():
    # A listener that accepts connections and never answers: the client gives up within its bounds.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        backend = RetrievalBackend(url, timeout_s=0.5, retries=1, backoff_s=0.1)
        start = time.monotonic()
        with pytest.raises(SearchError, match="failed after 2 attempts"):
            backend.search("anything", 3)
        assert time.monotonic() - start < 3


def test_concurrency_cap(bm25_server):
    backend = RetrievalBackend(bm25_server, timeout_s=5, max_concurrency=2)
    results = []
    threads = [threading.Thread(target=lambda: results.append(backend.search("Hallit glass lanterns", 1)))
               for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 10 and all(r[0].title == "Hallit" for r in results)


@pytest.mark.slow
def test_dense_retrieval(corpus_path, tmp_path, facts):
    index = RetrievalIndex(corpus_path, str(tmp_path / "dense"), dense=True)
    assert index.method == "dense"
    # Paraphrases with little word overlap: dense embeddings still find the fact.
    for question, title in [("Which town is famous for making glass lamps?", "Hallit"),
                            ("space object that returns every eleven years", "Varo-7")]:
        top = index.search([question], 1)[0][0]
        assert top[0]["title"] == title, (question, top)
    reloaded = RetrievalIndex(corpus_path, str(tmp_path / "dense"), dense=True)
    assert reloaded.faiss_index.ntotal == len(facts)


def test_local_backend_and_factory(corpus_path, tmp_path):
    backend = make_search_backend("local", corpus=corpus_path, index_dir=str(tmp_path / "local"), url=None)
    assert backend.search("glass lanterns", 1)[0].title == "Hallit"
    with pytest.raises(TypeError, match="search backend 'retrieval'"):
        make_search_backend("retrieval", corpus=corpus_path)


def test_tools_and_server_never_import_jax(corpus_path, tmp_path):
    # tools/ runs in worker processes: importing it, building an index and serving must not pull in jax.
    code = ("import sys\nfrom aepo_jax.tools import RetrievalIndex, serve_in_thread, run_python\n"
            f"index = RetrievalIndex({corpus_path!r}, {str(tmp_path / 'nojax')!r})\n"
            "server, url = serve_in_thread(index)\nserver.shutdown()\n"
            "assert 'jax' not in sys.modules, 'jax was imported'\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
