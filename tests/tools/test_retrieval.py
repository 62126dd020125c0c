"""The retrieval server on loopback: correct top-1 for known made-up facts, Search-R1's API, index reuse, and a
client that survives the server being killed and restarted (and never hangs on a silent server)."""

import json
import os
import random
import re
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
  req = urllib.request.Request(
    url + "/retrieve", data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
  )
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
  path.write_text(
    json.dumps({"id": "a", "title": "T", "text": "body"})
    + "\n\n"
    + json.dumps({"id": "b", "contents": "\"Quoted\"\nline1\nline2"})
    + "\n"
  )
  assert load_corpus(str(path)) == [
    {"id": "a", "title": "T", "text": "body"},
    {"id": "b", "title": "Quoted", "text": "line1\nline2"},
  ]
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
  proc = subprocess.Popen(
    [
      sys.executable,
      os.path.join(ROOT, "launch", "retrieval_server.py"),
      "--corpus",
      corpus_path,
      "--index",
      index_dir,
      "--port",
      str(port),
      *extra,
    ],
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    text=True,
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=ROOT),
  )
  line = proc.stdout.readline()  # blocks until READY (or the process dies)
  assert line.startswith("READY"), f"server did not start: {line!r}"
  return proc


def test_client_survives_server_kill_and_restart(corpus_path, tmp_path, free_port):
  port, index_dir = free_port, str(tmp_path / "idx")
  url = f"http://127.0.0.1:{port}"
  proc = _start_server(corpus_path, index_dir, port)
  try:
    backend = RetrievalBackend(url, timeout_s=30, retries=0)
    assert backend.search("highest peak of the Tarrow range", 1)[0].title == "Mount Kessa"
    proc.kill()
    proc.wait()
    start = time.monotonic()
    with pytest.raises(SearchError, match="failed after 1 attempts"):
      backend.search("highest peak", 1)  # connection refused: a clean error, at once
    assert time.monotonic() - start < 15  # at once, not at the 30 s timeout (slack for a loaded machine)

    # Restart the server while a patient client is retrying: the call then succeeds. Backoffs 0.25 s doubling over
    # 8 retries span ~64 s: room for a loaded machine to start the server (a process importing the package).
    patient = RetrievalBackend(url, timeout_s=10, retries=8, backoff_s=0.25)
    restarted = []
    threading.Timer(0.5, lambda: restarted.append(_start_server(corpus_path, index_dir, port))).start()
    hits = patient.search("capital city of the kingdom of Quenmar", 1)
    assert hits[0].title == "Zorblat"
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
    assert time.monotonic() - start < 15  # 2 x 0.5 s + backoff, not forever (slack for a loaded machine)


def test_slow_body_frees_its_slot_at_the_deadline(dribble_server, bm25_server):
  # One slot: a call stuck on a server that dribbles its body (~70 s) must give the slot back at its own deadline.
  backend = RetrievalBackend(dribble_server, timeout_s=2, retries=0, max_concurrency=1)
  errors = []
  stuck = threading.Thread(target=lambda: errors.append(pytest.raises(SearchError, backend.search, "q", 3)))
  start = time.monotonic()
  stuck.start()
  while backend.client.stats["requests"] == 0:  # counted once the stuck call holds the slot
    time.sleep(0.01)
  # The healthy call may wait 30 s for the slot, so it does not race its own deadline against the stuck call's 2 s.
  backend.client.timeout_s = 30
  backend.url = bm25_server  # same client, same single slot, a healthy server
  assert backend.search("highest peak of the Tarrow range", 1)[0].title == "Mount Kessa"
  stuck.join()
  # Done well before the ~70 s body: the slot came back at the 2 s deadline. The message names the remaining time
  # of that attempt's 2 s (.3g), which reads 1.99 when taking the slot took over 5 ms.
  assert time.monotonic() - start < 30
  assert re.search(r"no complete answer within (2|1\.9\d) s", str(errors[0].value)), errors[0].value


def test_hostile_requests_get_json_errors(corpus_path, tmp_path):
  index = RetrievalIndex(corpus_path, str(tmp_path / "idx"))
  server, url = serve_in_thread(index, max_queries=8, max_body_bytes=1 << 20)
  port = server.server_address[1]

  def raw(body: bytes, method="POST", path="/retrieve", length=None):
    length = len(body) if length is None else length
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
      s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode() + body)
      data = b""
      while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
        [h for h in data.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1]
      ):
        chunk = s.recv(65536)
        assert chunk, f"the server dropped the connection: {data!r}"
        data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)

  try:
    # No scorable term (stop words, punctuation, nothing): an empty list each, beside a normal query.
    status, out = raw(json.dumps({"queries": ["The", "...", "", "a the of", "Mount Kessa"], "topk": 1}).encode())
    assert status == 200 and out["result"][:4] == [[], [], [], []]
    assert out["result"][4][0]["contents"].startswith("Mount Kessa")
    assert SearchTool(RetrievalBackend(url, timeout_s=5, retries=0))("The") == "No search results found."
    for body in (
      b"[1, 2]",
      b"[" * 100_000 + b"]" * 100_000,
      b"{not json",
      b"\xff\xfe",
      b'"queries"',
      b'{"queries": ["x"], "topk": true}',
      b'{"queries": [1]}',
    ):
      status, out = raw(body)
      assert status == 400 and out["error"], (body[:20], status, out)
    status, out = raw(json.dumps({"queries": ["x"] * 9}).encode())
    assert status == 413 and "limit is 8" in out["error"]
    status, out = raw(b"", length=(1 << 20) + 1)  # refused from the header alone, body never read
    assert status == 413 and "over the limit" in out["error"]
    assert raw(b"{}", method="PUT")[0] == 501
    index.search = lambda queries, topk: 1 / 0  # a bug in the handler: still an answer
    status, out = raw(b'{"queries": ["x"]}')
    assert status == 500 and "ZeroDivisionError" in out["error"]
  finally:
    server.shutdown()
    server.server_close()


def test_a_large_request_does_not_stall_a_small_one(tmp_path):
  rng = random.Random(0)
  words = [f"w{i}" for i in range(2000)]
  path = tmp_path / "big.jsonl"
  with open(path, "w") as f:
    for i in range(10000):
      f.write(json.dumps({"id": str(i), "contents": f"doc {i}\n" + " ".join(rng.choices(words, k=30))}) + "\n")
  index = RetrievalIndex(str(path), str(tmp_path / "idx"))
  server, url = serve_in_thread(index, max_queries=5000)
  client = RetrievalBackend(url, timeout_s=120, retries=0)
  big = [" ".join(rng.choices(words, k=8)) for _ in range(3000)]
  done = {}

  def large():
    client.client.request("POST", url + "/retrieve", body={"queries": big, "topk": 3})
    done["large"] = time.monotonic()

  try:
    start = time.monotonic()
    t = threading.Thread(target=large)
    t.start()
    time.sleep(0.3)
    asked = time.monotonic()
    assert client.search("w1 w2 w3", 3)
    done["small"] = time.monotonic()
    t.join()
  finally:
    server.shutdown()
    server.server_close()
  assert done["small"] < done["large"], "the small request waited for the whole large one"
  assert done["small"] - asked < 0.25 * (done["large"] - start), done


def test_concurrency_cap(bm25_server):
  backend = RetrievalBackend(bm25_server, timeout_s=5, max_concurrency=2)
  results = []
  threads = [
    threading.Thread(target=lambda: results.append(backend.search("Hallit glass lanterns", 1))) for _ in range(10)
  ]
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
  for question, title in [
    ("Which town is famous for making glass lamps?", "Hallit"),
    ("space object that returns every eleven years", "Varo-7"),
  ]:
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
  code = (
    "import sys\nfrom aepo_jax.tools import RetrievalIndex, serve_in_thread, run_python\n"
    f"index = RetrievalIndex({corpus_path!r}, {str(tmp_path / 'nojax')!r})\n"
    "server, url = serve_in_thread(index)\nserver.shutdown()\n"
    "assert 'jax' not in sys.modules, 'jax was imported'\nprint('ok')"
  )
  out = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=120,
    env=dict(os.environ, PYTHONPATH=ROOT),
  )
  assert out.stdout.strip() == "ok", out.stderr[-2000:]
