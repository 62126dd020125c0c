"""The HTTP front: OpenAI-compatible routes over a `Scheduler`, on the standard library's ThreadingHTTPServer.

Each connection has its own thread, which parses the request, submits its jobs, turns their token updates into
text (`ChoiceText`) and writes the response or the server-sent events; every engine call stays on the
scheduler's thread, so /health answers while the engine decodes. A waiting thread polls its socket: a client
that disconnects has its jobs cancelled and its slots released before the next decode chunk.
"""

from __future__ import annotations

import hmac
import http.server
import ipaddress
import json
import logging
import queue
import random
import select
import socket
import threading
import time
import uuid
from typing import Optional, Sequence
from urllib.parse import urlsplit

from aepo_jax.rollout import make_engine
from aepo_jax.serve._protocol import ApiError, GenRequest, parse_request
from aepo_jax.serve._scheduler import Job, QueueFull, Scheduler, ShuttingDown
from aepo_jax.serve._text import ChoiceText

_MAX_BODY = 64 << 20  # the most any body may hold, whatever max_len says
_MIN_BODY = 1 << 20
_CHARS_PER_TOKEN = 32  # a prompt longer than max_len x this many characters cannot fit: refused before tokenizing
_MAX_DEPTH = 32  # JSON nesting a request may have (OpenAI's bodies need 5)
_IDLE_TIMEOUT_S = 60.0  # a connection that sends nothing (or stops reading a response) for this long is closed
_POLL_S = 0.2
_LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


class _ClientGone(Exception):
  pass


class Server:
  """An OpenAI-compatible server for one model: `start()` (background threads) or `serve_forever()`, then
  `shutdown(drain_s)`: new requests get 503 while running ones finish, for at most drain_s seconds."""

  def __init__(
    self,
    config,
    params,
    tokenizer,
    *,
    model_name: str,
    max_slots: int = 16,
    max_len: int = 2048,
    host: str = "127.0.0.1",
    port: int = 8000,
    steps_per_call: int = 8,
    max_queue: int = 64,
    prefill_chunk: int = 128,
    cache_dtype: Optional[str] = None,
    api_key: Optional[str] = None,
    allowed_hosts: Optional[Sequence[str]] = None,
    idle_timeout_s: float = _IDLE_TIMEOUT_S,
  ):
    """api_key: every route but /health needs `Authorization: Bearer <api_key>` (None: no key).
    allowed_hosts: Host header names accepted besides the bound address, localhost and (bound to every interface)
    IP literals; ('*',) accepts any (DNS rebinding then reaches the server)."""
    context = int(getattr(config, "max_position_embeddings", 0) or 0)
    if context and max_len > context:
      raise ValueError(
        f"max_len={max_len} exceeds the model's context of {context} tokens (max_position_embeddings); use "
        f"--max_len={context} or less."
      )
    if api_key is not None and not api_key.strip():
      raise ValueError("api_key is empty; give a key, or none to serve without one.")
    self.api_key = api_key
    self.allowed_hosts = {h.lower().strip("[]") for h in (allowed_hosts or ()) if h}
    self.idle_timeout_s = idle_timeout_s
    self.max_prompt_chars = max_len * _CHARS_PER_TOKEN
    self.max_body = max(_MIN_BODY, min(_MAX_BODY, 2 * max_slots * self.max_prompt_chars))
    self.engine = make_engine(
      config,
      max_slots=max_slots,
      max_len=max_len,
      tokenizer=tokenizer,
      tokenizer_eos=True,
      per_slot_sampling=True,
      prefill_chunk=prefill_chunk,
      cache_dtype=cache_dtype,
    )
    self.scheduler = Scheduler(self.engine, params, steps_per_call=steps_per_call, max_queue=max_queue)
    self.tokenizer, self.model_name, self.eos_ids = tokenizer, model_name, self.engine.eos_ids
    self.created = int(time.time())
    self.draining = False
    self._counts = {}
    self._lock = threading.Lock()
    self.httpd = _HTTPServer((host, port), _Handler)
    self.httpd.app = self
    self._thread = None
    self.bound_host = host.lower().strip("[]")

  def host_allowed(self, header: Optional[str]) -> bool:
    """The Host header names this server: the bound address, localhost, an allowed name, or (bound to every
    interface) an IP literal. A page's DNS name pointing here (DNS rebinding) is none of these."""
    if "*" in self.allowed_hosts:
      return True
    if not header:
      return False
    name = header.strip().lower()
    if name.startswith("["):  # [::1]:8000
      name = name[1:].split("]", 1)[0]
    elif name.count(":") == 1:
      name = name.rsplit(":", 1)[0]
    if name in _LOCAL_NAMES or name == self.bound_host or name in self.allowed_hosts:
      return True
    if self.bound_host in ("0.0.0.0", "::", ""):
      try:
        ipaddress.ip_address(name)
        return True
      except ValueError:
        return False
    return False

  def authorized(self, header: Optional[str]) -> bool:
    if self.api_key is None:
      return True
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

  @property
  def url(self) -> str:
    host, port = self.httpd.server_address[:2]
    return f"http://{host}:{port}"

  def start(self) -> "Server":
    self.scheduler.start()
    self._thread = threading.Thread(
      target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="aepo-serve-http", daemon=True
    )
    self._thread.start()
    return self

  def serve_forever(self):
    """Serves on the calling thread until `shutdown` (called from another thread)."""
    self.scheduler.start()
    self.httpd.serve_forever(poll_interval=0.1)

  def warmup(self, full: bool = False):
    """Compiles before serving: one short job (the first-token step and a full chunk); with `full`, also every
    prefill variant requests can meet (n jobs joining together, n a power of two up to max_slots, times each
    prefill chunk size), so no request waits for a compilation later. Needs the scheduler started."""
    from aepo_jax.rollout import SamplingParams

    eng = self.engine
    lens = [2]
    if full:
      lens, c = [], 16
      while c <= min(eng.prefill_chunk, eng.max_len - 1):
        lens.append(min(c + 1, eng.max_len - self.scheduler.steps_per_call - 2))
        c *= 2
    from tqdm.auto import tqdm

    widths = [1 << i for i in range(max(eng.max_slots, 1).bit_length())] if full else [1]
    bar = tqdm(total=len(lens) * len(widths), desc=f"warm-up: compiling {len(lens) * len(widths)} programs")
    for length in lens:
      for n in widths:
        sink = queue.Queue()
        jobs = [
          Job(
            [1 + (i + k) % (eng.config.vocab_size - 1) for k in range(length)],
            1,
            self.scheduler.steps_per_call + 2,
            SamplingParams(0.0, ignore_eos=True),
            [0],
            sink,
            tag=i,
          )
          for i in range(n)
        ]
        self.scheduler.submit(jobs)
        left = n
        while left:
          u = sink.get(timeout=1800)
          if u.error:
            raise RuntimeError(f"warmup failed: {u.error}")
          left -= u.finish is not None
        bar.update(1)
    bar.close()

  def shutdown(self, drain_s: float = 30.0):
    """Stops taking requests, lets running ones finish for at most drain_s seconds, then ends the rest."""
    self.draining = True
    self.scheduler.close()
    deadline = time.monotonic() + drain_s
    while self.scheduler.busy and time.monotonic() < deadline:
      time.sleep(0.05)
    if self.scheduler.busy:
      logging.warning(
        "serve: drain deadline passed; ending %d running and %d waiting requests",
        self.scheduler.slots_in_use,
        self.scheduler.queue_length,
      )
      self.scheduler.abort()
    self.scheduler.join(10)
    time.sleep(_POLL_S)  # let the request threads write their last bytes
    self.httpd.shutdown()
    self.httpd.server_close()

  def model_card(self) -> dict:
    return {
      "id": self.model_name,
      "object": "model",
      "created": self.created,
      "owned_by": "aepo_jax",
      "max_model_len": self.engine.max_len,
    }

  def count(self, route: str, status: int):
    with self._lock:
      key = (route, status)
      self._counts[key] = self._counts.get(key, 0) + 1

  def metrics_text(self) -> str:
    s = self.scheduler
    lines = [
      "# HELP aepo_serve_requests_total HTTP requests by route and status.",
      "# TYPE aepo_serve_requests_total counter",
    ]
    with self._lock:
      for (route, status), n in sorted(self._counts.items()):
        lines.append(f'aepo_serve_requests_total{{route="{route}",status="{status}"}} {n}')
    for name, kind, value, what in (
      ("prompt_tokens_total", "counter", s.prompt_tokens, "Prompt tokens prefilled."),
      ("generated_tokens_total", "counter", s.generated_tokens, "Tokens generated."),
      ("tokens_per_second", "gauge", round(s.tokens_per_second(), 3), "Tokens generated per second, last 10 s."),
      ("queue_length", "gauge", s.queue_length, "Requests waiting for slots."),
      ("slots_in_use", "gauge", s.slots_in_use, "Engine slots decoding a request."),
      ("slots", "gauge", self.engine.max_slots, "Engine slots."),
    ):
      lines += [f"# HELP aepo_serve_{name} {what}", f"# TYPE aepo_serve_{name} {kind}", f"aepo_serve_{name} {value}"]
    return "\n".join(lines) + "\n"


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
  def app(self) -> Server:
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


class _Run:
  """The text, log-probs and finish state of one request's choices, and its OpenAI response objects."""

  def __init__(self, app: Server, req: GenRequest, jobs):
    self.app, self.req, self.jobs, self.sink = app, req, jobs, jobs[0].sink
    self.tok = app.tokenizer
    self.chat = req.chat
    self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex
    self.created = int(time.time())
    self.texts = {
      (i, c): ChoiceText(
        self.tok,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        include_stop=req.include_stop,
        skip_special_tokens=req.skip_special_tokens,
        eos_ids=app.eos_ids,
      )
      for i in range(len(jobs))
      for c in range(req.n)
    }
    self.finish = {}  # (i, c) -> 'stop' | 'length'
    self.prompt_lp = {}  # i -> Update with the prompt's log-probs

  @property
  def finished(self) -> bool:
    need_prompt = self.jobs[0].prompt_logprobs is not None
    return len(self.finish) == len(self.texts) and (not need_prompt or len(self.prompt_lp) == len(self.jobs))

  def index(self, key) -> int:
    return key[0] * self.req.n + key[1]

  def apply(self, u, stream: bool = False) -> list:
    """Takes one update; with stream, returns the chunks to send for it."""
    if u.choice < 0:
      self.prompt_lp[u.tag] = u
      return []
    key = (u.tag, u.choice)
    if key in self.finish:
      return []  # tokens decoded after a stop found on the host
    ct = self.texts[key]
    ct.push(u.tokens, u.logprobs, u.top_ids, u.top_logprobs, final=u.finish)
    if ct.stopped:
      self.finish[key] = "stop"
      self.app.scheduler.stop_choice(self.jobs[u.tag], u.choice)
    elif u.finish is not None:
      self.finish[key] = "length" if u.finish in ("length", "cache_full") else "stop"
    if not stream:
      return []
    delta, pieces = ct.take(done=key in self.finish)
    if not (delta or pieces or key in self.finish):
      return []
    chunk = self._chunk(key, delta, pieces, self.finish.get(key))
    if len(self.finish) == len(self.texts) and not self.req.include_usage:
      chunk["usage"] = self.usage()  # every response carries usage: here on the stream's last chunk
    return [chunk]

  # ------------------------------------------------------------------------------------------------
  # Objects
  # ------------------------------------------------------------------------------------------------
  def usage(self) -> dict:
    prompt = sum(len(p) for p in self.req.prompts)
    done = sum(ct.num_tokens for ct in self.texts.values())
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

  def _tstr(self, tid: int) -> str:
    return f"token_id:{tid}" if self.req.tokens_as_ids else self.tok.decode([tid])

  def _logprobs(self, pieces, base: int = 0, prompt: Optional[dict] = None):
    if self.req.logprobs is None:
      return None
    k = self.req.logprobs
    if self.chat:

      def entry(t, lp):
        s = self._tstr(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

      return {
        "content": [
          {**entry(p.token_id, p.logprob), "top_logprobs": [entry(t, lp) for t, lp in p.top[:k]]} for p in pieces
        ]
      }
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if prompt is not None:  # echo: the prompt's tokens first (the first has no log-prob)
      out = prompt
    for p in pieces:
      top = {self._tstr(t): lp for t, lp in p.top[:k]}
      top.setdefault(self._tstr(p.token_id), p.logprob)
      out["tokens"].append(self._tstr(p.token_id))
      out["token_logprobs"].append(p.logprob)
      out["top_logprobs"].append(top)
      out["text_offset"].append(base + p.offset)
    return out

  def _prompt_logprobs(self, i: int) -> dict:
    u = self.prompt_lp[i]
    ids = [int(t) for t in u.tokens]
    ct = ChoiceText(self.tok, skip_special_tokens=False)
    ct.push(ids)
    k = self.req.logprobs
    out = {
      "tokens": [self._tstr(t) for t in ids],
      "token_logprobs": [None] + [float(x) for x in u.logprobs],
      "top_logprobs": [None],
      "text_offset": [p.offset for p in ct.pieces],
    }
    for j in range(len(ids) - 1):
      top = {self._tstr(int(t)): float(v) for t, v in zip(u.top_ids[j][:k], u.top_logprobs[j][:k])}
      top.setdefault(self._tstr(ids[j + 1]), float(u.logprobs[j]))
      out["top_logprobs"].append(top)
    return out

  def _choice_extra(self, key) -> dict:
    ct = self.texts[key]
    extra = {"stop_reason": ct.stop_reason}
    if self.req.return_token_ids:
      extra["prompt_token_ids"] = self.req.prompts[key[0]]
      extra["token_ids"] = list(ct.token_ids)
    return extra

  def response(self) -> dict:
    choices = []
    for key in sorted(self.texts, key=self.index):
      ct = self.texts[key]
      if self.chat:
        choice = {
          "index": self.index(key),
          "message": {"role": "assistant", "content": ct.text},
          "logprobs": self._logprobs(ct.pieces),
          "finish_reason": self.finish[key],
        }
      else:
        echo = self.req.prompt_texts[key[0]] if self.req.echo else ""
        prompt = self._prompt_logprobs(key[0]) if (self.req.echo and self.req.logprobs is not None) else None
        choice = {
          "index": self.index(key),
          "text": echo + ct.text,
          "logprobs": self._logprobs(ct.pieces, len(echo), prompt),
          "finish_reason": self.finish[key],
        }
      choices.append({**choice, **self._choice_extra(key)})
    return {
      "id": self.id,
      "object": "chat.completion" if self.chat else "text_completion",
      "created": self.created,
      "model": self.app.model_name,
      "choices": choices,
      "usage": self.usage(),
    }

  def _envelope(self, choices) -> dict:
    return {
      "id": self.id,
      "object": "chat.completion.chunk" if self.chat else "text_completion",
      "created": self.created,
      "model": self.app.model_name,
      "choices": choices,
    }

  def _chunk(self, key, delta: str, pieces, finish) -> dict:
    if self.chat:
      choice = {
        "index": self.index(key),
        "delta": {"content": delta} if delta or not finish else {},
        "logprobs": self._logprobs(pieces),
        "finish_reason": finish,
      }
    else:
      choice = {"index": self.index(key), "text": delta, "logprobs": self._logprobs(pieces), "finish_reason": finish}
    if finish is not None:
      choice.update(self._choice_extra(key))
    return self._envelope([choice])

  def opening_chunks(self) -> list:
    """Chat: the assistant role per choice. Completions with echo: the prompt text per choice."""
    out = []
    for key in sorted(self.texts, key=self.index):
      if self.chat:
        out.append(
          self._envelope(
            [
              {
                "index": self.index(key),
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
              }
            ]
          )
        )
      elif self.req.echo:
        out.append(
          self._envelope(
            [{"index": self.index(key), "text": self.req.prompt_texts[key[0]], "logprobs": None, "finish_reason": None}]
          )
        )
    return out

  def closing_chunks(self) -> list:
    if self.req.include_usage:
      return [{**self._envelope([]), "usage": self.usage()}]
    return []
