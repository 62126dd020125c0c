"""Fixtures for the tools tests: both isolations (each must work), a free loopback port, a small made-up corpus."""

import json
import socket
import threading
import time

import pytest

from aepo_jax.tools import _isolation


def isolation_or_fail(mode: str) -> str:
  """Both isolations must work on every host that runs this suite (CI installs bubblewrap); never skipped."""
  ok, why = _isolation._probe_result(mode)
  if not ok:
    pytest.fail(f"{mode} isolation cannot start a sandbox on this host: {why}")
  return mode


@pytest.fixture(params=["bwrap", "unshare"])
def isolation(request):
  return isolation_or_fail(request.param)


@pytest.fixture
def free_port() -> int:
  """A loopback port that was free a moment ago."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture
def dribble_server():
  """A loopback HTTP server that answers every request with a 200 whose JSON body arrives one byte every 0.5 s
  (each read is quick; the whole answer takes about a minute). Yields its URL."""
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(16)
  body = json.dumps({"result": [[]], "organic": [], "pad": "x" * 100}).encode()

  def answer(conn):
    with conn:
      try:
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        for i in range(len(body)):
          conn.sendall(body[i : i + 1])
          time.sleep(0.5)
      except OSError:  # the client gave up
        pass

  def serve():
    while True:
      try:
        conn, _ = listener.accept()
      except OSError:
        return
      threading.Thread(target=answer, args=(conn,), daemon=True).start()

  threading.Thread(target=serve, daemon=True).start()
  yield f"http://127.0.0.1:{listener.getsockname()[1]}"
  listener.close()


# Made-up facts: nothing here exists outside this test, so only retrieval can answer.
FACTS = [
  ("Zorblat", "Zorblat is the capital city of the kingdom of Quenmar, founded in 1213 by Queen Ysolde."),
  ("Flin River", "The Flin River flows 840 kilometres through Dorra and ends in the Sea of Vask."),
  ("Mount Kessa", "Mount Kessa is the highest peak of the Tarrow range, at 6,112 metres."),
  ("Ysolde of Quenmar", "Queen Ysolde of Quenmar was born in Hallit and reigned for 41 years."),
  ("Brennic language", "Brennic is spoken by about 2 million people on the island of Ossary."),
  ("Ossary", "Ossary is an island nation whose currency is the ossary mark and whose anthem is Blue Tides."),
  ("Pell Observatory", "The Pell Observatory on Mount Kessa discovered the comet Varo-7 in 1988."),
  ("Varo-7", "Varo-7 is a periodic comet with an orbital period of 11.4 years, found at Pell Observatory."),
  ("Hallit", "Hallit is a fishing town in western Quenmar known for its glass lanterns."),
  ("Dorra", "Dorra is a landlocked republic; its largest city is Mirefold and its river is the Flin."),
]


@pytest.fixture(scope="session")
def facts() -> list[tuple[str, str]]:
  return FACTS


@pytest.fixture(scope="session")
def corpus_path(tmp_path_factory):
  path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
  with open(path, "w") as f:
    for i, (title, text) in enumerate(FACTS):
      f.write(json.dumps({"id": str(i), "contents": f"{title}\n{text}"}) + "\n")
  return str(path)
