"""HTTP that never hangs: one deadline per call, and a JSON client with bounded retries and a concurrency cap.

`http_request` bounds everything one request does by a single deadline: name resolution, connect, TLS, sending,
the response headers and the whole body. Socket timeouts alone bound each read, so a server that dribbles its
answer one byte at a time could hold a call for ever; here a watchdog shuts the connection down when the
deadline passes, whatever the call is blocked in.
"""

import http.client
import ipaddress
import json
import logging
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from aepo_jax.tools._search import SearchError

log = logging.getLogger(__name__)
_RETRY_STATUS = (429, 500, 502, 503, 504)
MAX_RESPONSE_BYTES = 32 << 20


class _Watch:
  """The sockets of one call; `expire()` shuts them all down (through duplicated descriptors, so a socket that
  TLS has since wrapped is reached too)."""

  def __init__(self):
    self._lock, self._dups, self.expired = threading.Lock(), [], False

  def add(self, sock: socket.socket) -> None:
    dup = socket.socket(fileno=os.dup(sock.fileno()))
    with self._lock:
      self._dups.append(dup)
      if not self.expired:
        return
    _shutdown(dup)

  def expire(self) -> None:
    with self._lock:
      self.expired = True
      dups = list(self._dups)
    for dup in dups:
      _shutdown(dup)

  def close(self) -> None:
    with self._lock:
      for dup in self._dups:
        dup.close()
      self._dups = []


def _shutdown(sock: socket.socket) -> None:
  try:
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass


def _resolve(host: str, port: int, timeout_s: float) -> list:
  """getaddrinfo within `timeout_s` (a resolver can stall for many seconds; it runs in a helper thread)."""
  try:
    ipaddress.ip_address(host.strip("[]"))
    return socket.getaddrinfo(host.strip("[]"), port, 0, socket.SOCK_STREAM)  # a literal: no lookup
  except ValueError:
    pass
  box: list = []

  def lookup():
    try:
      box.append(socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM))
    except OSError as e:
      box.append(e)

  t = threading.Thread(target=lookup, daemon=True, name="http_resolve")
  t.start()
  t.join(max(0.0, timeout_s))
  if not box:
    raise TimeoutError(f"could not resolve {host} within {timeout_s:.3g} s")
  if isinstance(box[0], Exception):
    raise box[0]
  return box[0]


def _connector(watch: _Watch, deadline: float):
  """A replacement for socket.create_connection whose every step ends by `deadline`."""

  def create_connection(address, timeout=None, source_address=None, *args):
    host, port = address
    error: Exception | None = None
    for family, kind, proto, _, addr in _resolve(host, port, deadline - time.monotonic()):
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        break
      sock = socket.socket(family, kind, proto)
      try:
        watch.add(sock)
        sock.settimeout(remaining)
        if source_address:
          sock.bind(source_address)
        sock.connect(addr)
        return sock
      except OSError as e:
        error = e
        sock.close()
    raise error or TimeoutError(f"could not connect to {host}:{port} in time")

  return create_connection


def _handlers(watch: _Watch, deadline: float):
  connect = _connector(watch, deadline)

  class Http(http.client.HTTPConnection):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      self._create_connection = connect

  class Https(http.client.HTTPSConnection):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      self._create_connection = connect

  class HttpHandler(urllib.request.HTTPHandler):
    def http_open(self, req):
      return self.do_open(Http, req)

  class HttpsHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):
      return self.do_open(Https, req, context=self._context)

  return HttpHandler(), HttpsHandler()


def http_request(
  method: str,
  url: str,
  *,
  data: bytes | None = None,
  headers: dict | None = None,
  timeout_s: float = 10.0,
  max_bytes: int = MAX_RESPONSE_BYTES,
  response_headers: dict | None = None,
) -> tuple[int, bytes]:
  """(status, body) of one HTTP request, all of it (resolve, connect, send, headers, body) within `timeout_s`.

  Any status is returned, not raised. Raises TimeoutError when the deadline passes, OSError / ConnectionError
  when the connection fails, ValueError when the body exceeds `max_bytes`. `response_headers`, when given, is
  filled with the answer's headers (names lower-cased).
  """
  deadline = time.monotonic() + timeout_s
  watch = _Watch()
  timer = threading.Timer(timeout_s, watch.expire)
  timer.daemon = True
  timer.start()
  try:
    opener = urllib.request.build_opener(*_handlers(watch, deadline))
    req = urllib.request.Request(url, data=data, headers=headers or {}, method=method)
    try:
      resp = opener.open(req, timeout=timeout_s)
    except urllib.error.HTTPError as e:  # an error status: its body is read under the same deadline
      resp = e
    try:
      status = resp.status
      if response_headers is not None and resp.headers is not None:
        response_headers.update((k.lower(), v) for k, v in resp.headers.items())
      body = bytearray()
      while True:
        chunk = resp.read(65536) if resp.fp is not None else b""
        if not chunk:
          break
        body += chunk
        if len(body) > max_bytes:
          raise ValueError(f"{method} {url.split('?')[0]} sent more than {max_bytes} bytes")
        if time.monotonic() > deadline:
          raise TimeoutError
    finally:
      resp.close()
    if watch.expired:  # the watchdog cut the body short: what arrived is not the answer
      raise TimeoutError
    return status, bytes(body)
  except (OSError, http.client.HTTPException) as e:
    timed_out = isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)
    if watch.expired or timed_out or time.monotonic() >= deadline:
      raise TimeoutError(f"{method} {url.split('?')[0]}: no complete answer within {timeout_s:.3g} s") from e
    if isinstance(e, http.client.HTTPException):
      raise ConnectionError(f"{method} {url.split('?')[0]}: broken HTTP answer ({e!r})") from e
    raise
  finally:
    timer.cancel()
    watch.close()


class JsonClient:
  """Sends JSON requests; each attempt (waiting for a slot, then the whole request and its body) takes at most
  `timeout_s`, and at most `retries` extra attempts follow.

  Connection errors, timeouts, 429 and 5xx are retried after backoff_s * 2**attempt (+ jitter); other HTTP
  errors fail at once. At most `max_concurrency` requests are in flight. A call therefore ends within
  (retries + 1) * timeout_s plus the backoff, and a stuck attempt gives its slot back at its deadline.
  """

  def __init__(self, timeout_s: float = 10.0, retries: int = 3, backoff_s: float = 0.5, max_concurrency: int = 16):
    self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
    self._slots = threading.BoundedSemaphore(max_concurrency)
    self.stats = {"requests": 0, "retries": 0, "failures": 0}
    self._lock = threading.Lock()

  def _count(self, key: str) -> None:
    with self._lock:
      self.stats[key] += 1

  def request(
    self, method: str, url: str, *, params: dict | None = None, body: dict | None = None, headers: dict | None = None
  ) -> dict:
    if params:
      url = url + ("&" if "?" in url else "?") + urllib.parse.urlencode(params)
    data = json.dumps(body).encode() if body is not None else None
    hdrs = {"Accept": "application/json", **(headers or {})}
    if data is not None:
      hdrs["Content-Type"] = "application/json"
    where = f"{method} {url.split('?')[0]}"
    last_error = None
    for attempt in range(self.retries + 1):
      if attempt:
        self._count("retries")
        time.sleep(self.backoff_s * 2 ** (attempt - 1) * (1 + 0.1 * random.random()))
      deadline = time.monotonic() + self.timeout_s
      if not self._slots.acquire(timeout=self.timeout_s):
        last_error = TimeoutError(f"no free request slot within {self.timeout_s:g} s (concurrency cap)")
        continue
      try:
        self._count("requests")
        status, payload = http_request(
          method, url, data=data, headers=hdrs, timeout_s=max(0.001, deadline - time.monotonic())
        )
      except OSError as e:  # timeouts, refused or broken connections: worth another attempt
        last_error = e
        log.info("attempt %d/%d of %s failed: %s", attempt + 1, self.retries + 1, where, e)
        continue
      except ValueError as e:  # a bad URL, or an answer over the size limit: the same next time
        last_error = SearchError(f"{where}: {e}")
        break
      finally:
        self._slots.release()
      if status >= 400:
        last_error = SearchError(f"{where} returned HTTP {status}: {payload[:300].decode(errors='replace')}")
        if status not in _RETRY_STATUS:
          break
        log.info("attempt %d/%d of %s failed: %s", attempt + 1, self.retries + 1, where, last_error)
        continue
      try:
        return json.loads(payload)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        last_error = SearchError(f"{where} returned invalid JSON: {e}")
        break
    self._count("failures")
    if isinstance(last_error, SearchError):
      raise last_error
    raise SearchError(
      f"{where} failed after {self.retries + 1} attempts (timeout {self.timeout_s:g} s each): {last_error}"
    )
