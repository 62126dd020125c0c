"""The HTTP front: OpenAI-compatible routes over a `Scheduler`, on the standard library's ThreadingHTTPServer.

Each connection has its own thread, which parses the request, submits its jobs, turns their token updates into
text (`ChoiceText`) and writes the response or the server-sent events; every engine call stays on the
scheduler's thread, so /health answers while the engine decodes. A waiting thread polls its socket: a client
that disconnects has its jobs cancelled and its slots released before the next decode chunk. The request handler
is in `_http.py`, one request's choices and response objects in `_run.py`; this module holds the `Server`.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import queue
import threading
import time
from typing import Optional, Sequence

from aepo_jax.rollout import make_engine
from aepo_jax.serve._http import _POLL_S, _Handler, _HTTPServer
from aepo_jax.serve._scheduler import Job, Scheduler

_MAX_BODY = 64 << 20  # the most any body may hold, whatever max_len says
_MIN_BODY = 1 << 20
_CHARS_PER_TOKEN = 32  # a prompt longer than max_len x this many characters cannot fit: refused before tokenizing
_IDLE_TIMEOUT_S = 60.0  # a connection that sends nothing (or stops reading a response) for this long is closed
_LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


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
    prefill variant requests can meet (n jobs joining together, n a power of two up to max_slots or one of the
    engine's compact decode row sizes, times each prefill chunk size), so no request waits for a compilation later.
    Needs the scheduler started."""
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
    if full:  # n jobs together decode in the engine's compact row size for n active slots: one variant each
      widths = sorted(set(widths) | set(eng.decode_row_sizes()))
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
