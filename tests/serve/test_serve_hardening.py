"""The server refuses strangers and requests it can never serve, cheaply, and stays responsive: an API key on every
route but /health, JSON content type only, Host checked (DNS rebinding), body and prompt bounded before
tokenization, nesting bounded, never-admissible requests 400 (not 429), --max_len within the model's context, idle
connections closed. After each case /health answers and greedy output is unchanged."""

import socket
import time

import pytest

from serve_helpers import MAX_LEN, MAX_SLOTS, http_request

KEY = "s3cret-key"
GREEDY = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0.0}


def call(url, method, path, body=None, raw=None, headers=None, timeout=120):
  return http_request(url, method, path, body, raw, timeout=timeout, headers=headers)


def healthy(url, headers=None):
  """/health answers 200 within 1 s (10 s: a loaded 2-core machine)."""
  t0 = time.monotonic()
  status = call(url, "GET", "/health", headers=headers, timeout=30)[0]
  return status == 200 and time.monotonic() - t0 < 10


@pytest.fixture
def make_server(tiny):
  """Started servers with the shared server's engine shape (so they reuse its compiled functions)."""
  from aepo_jax.serve import Server

  made = []

  def make(**kw):
    cfg, params, tok = tiny
    kw = {"max_slots": MAX_SLOTS, "max_len": MAX_LEN, "port": 0, **kw}
    srv = Server(cfg, params, tok, model_name="tiny", **kw).start()
    made.append(srv)
    return srv

  yield make
  for srv in made:
    srv.shutdown(0.5)


@pytest.fixture(scope="module")
def reference(server):
  status, _, body = call(server.url, "POST", "/v1/completions", GREEDY)
  assert status == 200
  return body["choices"][0]["text"]


def test_api_key_on_every_route_but_health(make_server, reference):
  srv = make_server(api_key=KEY)
  auth = {"Authorization": f"Bearer {KEY}"}
  assert healthy(srv.url)  # no key needed: load balancers probe it
  for method, path, body in [
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/nowhere", None),
    ("POST", "/v1/completions", GREEDY),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
  ]:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
      status, hdrs, answer = call(srv.url, method, path, body, headers=headers)
      assert status == 401 and hdrs["WWW-Authenticate"] == "Bearer", (method, path, headers)
      assert answer["error"]["code"] == "invalid_api_key"
  assert call(srv.url, "GET", "/v1/models", headers=auth)[0] == 200
  status, _, body = call(srv.url, "POST", "/v1/completions", GREEDY, headers=auth)
  assert status == 200 and body["choices"][0]["text"] == reference
  assert srv.scheduler.generated_tokens == 8  # the refused requests decoded nothing


def test_json_content_type_and_host_are_required(make_server, reference):
  srv = make_server(allowed_hosts=["serve.internal"])
  port = srv.url.rsplit(":", 1)[1]
  status, _, body = call(srv.url, "POST", "/v1/completions", GREEDY, headers={"Content-Type": "text/plain"})
  assert status == 415 and "application/json" in body["error"]["message"]
  for host in ("evil.example", f"evil.example:{port}", "10.0.0.1"):  # bound to 127.0.0.1: not its address either
    status, _, body = call(srv.url, "POST", "/v1/completions", GREEDY, headers={"Host": host})
    assert status == 403 and "--allowed_hosts" in body["error"]["message"], host
  for host in (f"127.0.0.1:{port}", f"localhost:{port}", "serve.internal:8000", "SERVE.internal"):
    status, _, body = call(srv.url, "POST", "/v1/completions", GREEDY, headers={"Host": host})
    assert status == 200 and body["choices"][0]["text"] == reference, host
  assert healthy(srv.url, {"Host": "evil.example"})  # /health: probes may name the server anyhow
  assert srv.scheduler.generated_tokens == 8 * 4


def test_hosts_when_listening_on_every_interface(tiny):
  from aepo_jax.serve._server import Server

  srv = Server.__new__(Server)  # only the Host rule, no engine
  srv.allowed_hosts, srv.bound_host = set(), "0.0.0.0"
  assert srv.host_allowed("10.1.2.3:8000") and srv.host_allowed("[fe80::1]:8000") and srv.host_allowed("localhost")
  assert not srv.host_allowed("rebind.attacker.example:8000") and not srv.host_allowed(None)
  srv.allowed_hosts = {"*"}
  assert srv.host_allowed("anything.example")


def test_huge_bodies_and_prompts_are_refused_before_tokenizing(make_server, reference):
  srv = make_server()
  host, port = srv.url.removeprefix("http://").split(":")
  # 50 MB announced: refused from its Content-Length (413) before the body is read, let alone tokenized.
  sock = socket.create_connection((host, int(port)), timeout=60)
  sock.sendall(
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n{\"prompt\": \"aaaa" % (50 << 20)
  )
  answer = b""
  while b"\r\n\r\n" not in answer:
    part = sock.recv(65536)
    if not part:
      break
    answer += part
  sock.close()
  assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
  assert healthy(srv.url)
  too_long = srv.max_prompt_chars + 1  # fits the body limit, not the context: 400 naming the limit
  status, _, body = call(srv.url, "POST", "/v1/completions", {"prompt": "b" * too_long, "max_tokens": 1})
  assert status == 400 and body["error"]["code"] == "context_length_exceeded"
  assert f"{MAX_LEN} tokens" in body["error"]["message"]
  chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "c" * too_long}]}]}
  assert call(srv.url, "POST", "/v1/chat/completions", chat)[0] == 400
  assert healthy(srv.url)
  assert call(srv.url, "POST", "/v1/completions", GREEDY)[2]["choices"][0]["text"] == reference


@pytest.mark.parametrize("depth", [40, 100_000])
def test_deep_nesting_is_400(make_server, reference, depth):
  srv = make_server()
  raw = b'{"prompt": ' + b"[" * depth + b"]" * depth + b', "max_tokens": 1}'
  status, _, body = call(srv.url, "POST", "/v1/completions", raw=raw)
  assert status == 400 and "nested deeper than" in body["error"]["message"]
  assert healthy(srv.url)
  assert call(srv.url, "POST", "/v1/completions", GREEDY)[2]["choices"][0]["text"] == reference


def test_a_request_that_can_never_be_admitted_is_400_not_429(make_server):
  srv = make_server(max_queue=8)
  status, headers, body = call(srv.url, "POST", "/v1/completions", {"prompt": [[1, 2]] * 9, "max_tokens": 1})
  assert status == 400 and "Retry-After" not in headers and "--max_queue" in body["error"]["message"]
  assert healthy(srv.url)


def test_max_len_beyond_the_models_context_is_refused(tiny):
  from aepo_jax.serve import Server

  cfg, params, tok = tiny
  with pytest.raises(ValueError, match=f"exceeds the model's context of {cfg.max_position_embeddings} tokens"):
    Server(cfg, params, tok, model_name="tiny", max_len=cfg.max_position_embeddings + 1, port=0)


def test_an_idle_connection_is_closed(make_server, reference):
  srv = make_server(idle_timeout_s=0.5)
  host, port = srv.url.removeprefix("http://").split(":")
  sock = socket.create_connection((host, int(port)), timeout=60)
  t0 = time.monotonic()
  assert sock.recv(1) == b""  # sends nothing: the server closes it
  assert time.monotonic() - t0 < 30
  sock.close()
  assert healthy(srv.url)
  assert call(srv.url, "POST", "/v1/completions", GREEDY)[2]["choices"][0]["text"] == reference
