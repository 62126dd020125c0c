"""The HTTP request handler of `Server`: routes, admission (Host, API key, draining), body checks, and the
JSON or server-sent-event responses of one request, whose text and log-probs `_Run` keeps."""

from __future__ import annotations

import http.server
import json
import logging
import queue
import random
import select
import socket
import time
from typing import Optional
from urllib.parse import urlsplit

from aepo_jax.serve._protocol import ApiError, parse_request
from aepo_jax.serve._run import _Run
from aepo_jax.serve._scheduler import Job, QueueFull, ShuttingDown

_MAX_DEPTH = 32  # JSON nesting a request may have (OpenAI's bodies need 5)
_POLL_S = 0.2


class _ClientGone(Exception):
  pass


class _HTTPServer(http.server.ThreadingHTTPServer):
  daemon_threads = True
  request_queue_size = 256
  allow_reuse_address = True


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  server_version = "aepo_jax"

  @property
  def timeout(self):  # the socket's timeout (StreamRequestHandler.setup): idle connections are closed
    return self.server.app.idle_timeout_s

  def log_message(self, fmt, *args):
    logging.debug("serve: %s " + fmt, self.address_string(), *args)

  @property
  def app(self):  # the Server this handler serves
    return self.server.app

  def handle(self):
    try:
      super().handle()
    except (ConnectionResetError, BrokenPipeError, TimeoutError):  # a client that left, or went idle
      self.close_connection = True

  # ------------------------------------------------------------------------------------------------
  # Routes
  # ------------------------------------------------------------------------------------------------
  def _admitted(self, path: str, route: str) -> bool:
    """Host and API key checks (every route but /health); answers and returns False when refused."""
    if path == "/health":
      return True
    app = self.app
    if not app.host_allowed(self.headers.get("Host")):
      self.close_connection = True
      self._error(
        ApiError(
          403,
          f"Host {self.headers.get('Host')!r} is not this server's; start it with --allowed_hosts=NAME to accept it.",
          type_="permission_error",
        ),
        route,
      )
      return False
    if not app.authorized(self.headers.get("Authorization")):
      self._error(
        ApiError(
          401,
          "a valid API key is required: send `Authorization: Bearer <key>`.",
          type_="authentication_error",
          code="invalid_api_key",
          headers={"WWW-Authenticate": "Bearer"},
        ),
        route,
      )
      return False
    return True

  def do_GET(self):
    path = urlsplit(self.path).path
    app = self.app
    known = path in ("/health", "/v1/models", f"/v1/models/{app.model_name}", "/metrics")
    if not self._admitted(path, path if known else "other"):
      return
    if path == "/health":
      self._json(503 if app.draining else 200, {"status": "draining" if app.draining else "ok"}, path)
    elif path == "/v1/models":
      self._json(200, {"object": "list", "data": [app.model_card()]}, path)
    elif path == f"/v1/models/{app.model_name}":
      self._json(200, app.model_card(), path)
    elif path == "/metrics":
      self._send(200, app.metrics_text().encode(), "text/plain; version=0.0.4", path)
    else:
      self._error(ApiError(404, f"no route GET {path}", type_="not_found_error"), "other")

  def do_POST(self):
    path = urlsplit(self.path).path
    if path not in ("/v1/completions", "/v1/chat/completions"):
      path = "other"  # one metrics label for every unknown route
    if not self._admitted(urlsplit(self.path).path, path):
      self._discard_body()
      return
    try:
      body = self._read_json()
      if path == "other":
        raise ApiError(404, f"no route POST {urlsplit(self.path).path}", type_="not_found_error")
      self._generate(body, chat=path == "/v1/chat/completions", route=path)
    except ApiError as e:
      self._error(e, path)
    except (_ClientGone, TimeoutError):
      self.close_connection = True
    except Exception as e:  # noqa: BLE001 (answer, then log)
      logging.exception("serve: request failed")
      self._error(ApiError(500, f"internal error: {e}", type_="server_error"), path)

  # ------------------------------------------------------------------------------------------------
  # Plain responses
  # ------------------------------------------------------------------------------------------------
  def _discard_body(self):
    """A refused request's body is not read: the connection closes instead of parsing what follows it."""
    if self.headers.get("Content-Length", "0") not in ("", "0"):
      self.close_connection = True

  def _read_json(self):
    ctype = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
    if ctype != "application/json":
      self._discard_body()
      raise ApiError(
        415, f"Content-Type must be application/json (got {ctype or 'none'!r}).", type_="invalid_request_error"
      )
    limit = self.app.max_body
    try:
      length = int(self.headers.get("Content-Length", "0"))
    except ValueError:
      length = -1
    if length < 0 or length > limit:
      self.close_connection = True
      raise ApiError(
        400 if length < 0 else 413,
        f"Content-Length must be an integer in [0, {limit}] (bytes; from --max_len and --max_slots).",
      )
    raw = self.rfile.read(length) if length else b""
    try:
      body = json.loads(raw or b"null")
    except RecursionError as e:
      raise ApiError(400, f"the body's JSON is nested deeper than {_MAX_DEPTH} levels.") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ApiError(400, f"the body is not valid JSON: {e}") from e
    if _depth_over(body, _MAX_DEPTH):
      raise ApiError(400, f"the body's JSON is nested deeper than {_MAX_DEPTH} levels.")
    return body

  def _send(self, status: int, data: bytes, ctype: str, route: str, headers: Optional[dict] = None):
    self.app.count(route, status)
    try:
      self.send_response(status)
      self.send_header("Content-Type", ctype)
      self.send_header("Content-Length", str(len(data)))
      for k, v in (headers or {}).items():
        self.send_header(k, v)
      self.end_headers()
      self.wfile.write(data)
    except (BrokenPipeError, ConnectionResetError):
      self.close_connection = True

  def _json(self, status: int, obj, route: str, headers: Optional[dict] = None):
    self._send(status, json.dumps(obj).encode(), "application/json", route, headers)

  def _error(self, e: ApiError, route: str):
    self._json(e.status, e.body(), route, e.headers)

  # ------------------------------------------------------------------------------------------------
  # Generation
  # ------------------------------------------------------------------------------------------------
  def _generate(self, body, *, chat: bool, route: str):
    app = self.app
    if app.draining:
      raise ApiError(503, "the server is shutting down", type_="service_unavailable")
    model = body.get("model") if isinstance(body, dict) else None
    if model is not None and model != app.model_name:
      raise ApiError(
        404,
        f"The model `{model}` does not exist; this server serves `{app.model_name}`.",
        "model",
        code="model_not_found",
      )
    eng = app.engine
    chars = _prompt_chars(body, chat)
    if chars > app.max_prompt_chars:
      raise ApiError(
        400,
        f"a prompt of {chars} characters cannot fit the server's context of {eng.max_len} tokens (at most "
        f"{app.max_prompt_chars} characters are tokenized).",
        "messages" if chat else "prompt",
        code="context_length_exceeded",
      )
    req = parse_request(
      body,
      chat=chat,
      tokenizer=app.tokenizer,
      vocab_size=eng.config.vocab_size,
      max_len=eng.max_len,
      max_slots=eng.max_slots,
    )
    base = req.seed if req.seed is not None else random.getrandbits(31)
    sink = queue.Queue()
    jobs = [
      Job(
        p,
        req.n,
        req.max_tokens[i],
        req.sampling,
        [(base + i * req.n + c) % 2**31 for c in range(req.n)],
        sink,
        tag=i,
        top_logprobs=req.logprobs or 0,
        prompt_logprobs=req.logprobs if (req.echo and req.logprobs is not None) else None,
      )
      for i, p in enumerate(req.prompts)
    ]
    if len(jobs) > app.scheduler.max_queue:  # would wait forever: not a matter of retrying later
      raise ApiError(
        400,
        f"{len(jobs)} prompts in one request can never be admitted: the server queues at most "
        f"{app.scheduler.max_queue} (--max_queue).",
        "prompt",
      )
    try:
      app.scheduler.submit(jobs)
    except QueueFull as e:
      raise ApiError(
        429, str(e), type_="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(e.retry_after)}
      ) from e
    except ShuttingDown as e:
      raise ApiError(503, str(e), type_="service_unavailable") from e
    run = _Run(app, req, jobs)
    try:
      if req.stream:
        self._stream(run, route)
      else:
        self._collect(run, route)
    finally:
      for job in jobs:
        app.scheduler.cancel(job)

  def _gone(self) -> bool:
    """The client closed its connection (readable with no data; pipelined bytes do not count)."""
    try:
      readable, _, _ = select.select([self.connection], [], [], 0)
      return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
      return True

  def _updates(self, run):
    """The run's updates as they come; raises _ClientGone when the client leaves."""
    last = time.monotonic()
    while not run.finished:
      try:
        u = run.sink.get(timeout=_POLL_S)
      except queue.Empty:
        u = None
      if u is None or time.monotonic() - last > _POLL_S:
        last = time.monotonic()
        if self._gone():
          raise _ClientGone
      if u is None:
        continue
      if u.error:
        raise ApiError(503, u.error, type_="server_error")
      yield u

  def _collect(self, run, route: str):
    for u in self._updates(run):
      run.apply(u)
    self._json(200, run.response(), route)

  def _stream(self, run, route: str):
    self.app.count(route, 200)
    try:
      self.send_response(200)
      self.send_header("Content-Type", "text/event-stream")
      self.send_header("Cache-Control", "no-cache")
      self.send_header("Transfer-Encoding", "chunked")
      self.end_headers()
      for chunk in run.opening_chunks():
        self._event(chunk)
      try:
        for u in self._updates(run):
          for chunk in run.apply(u, stream=True):
            self._event(chunk)
        for chunk in run.closing_chunks():
          self._event(chunk)
      except ApiError as e:  # the engine stopped mid-stream: say so in the stream
        self._event(e.body())
      self._event("[DONE]")
      self.wfile.write(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError) as e:
      raise _ClientGone from e

  def _event(self, obj):
    data = b"data: " + (obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()) + b"\n\n"
    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))


def _depth_over(obj, limit: int) -> bool:
  """Whether `obj` (parsed JSON) nests lists/objects deeper than `limit` (iterative: no recursion)."""
  stack = [(obj, 1)]
  while stack:
    x, d = stack.pop()
    if isinstance(x, (list, dict)):
      if d > limit:
        return True
      stack.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
  return False


def _prompt_chars(body, chat: bool) -> int:
  """The characters of the longest prompt in a request body (before any check of its form: 0 where the form is
  wrong, which parse_request then names). Chat: all message texts together."""
  if not isinstance(body, dict):
    return 0
  if chat:
    total, messages = 0, body.get("messages")
    for m in messages if isinstance(messages, list) else ():
      content = m.get("content") if isinstance(m, dict) else None
      if isinstance(content, str):
        total += len(content)
      elif isinstance(content, list):
        total += sum(
          len(p.get("text") or "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return total
  prompt = body.get("prompt")
  if isinstance(prompt, str):
    return len(prompt)
  if isinstance(prompt, list):
    return max((len(p) for p in prompt if isinstance(p, str)), default=0)
  return 0
