"""A process pool for reward functions with a per-item wall-clock timeout.

A reward is computed on model output, which can be anything: a regex that backtracks forever, a
sympy expression with a billion-digit power, a scorer stuck in C code where no signal reaches it.
Each item therefore runs in a worker process; when an item passes its deadline the worker is
killed (SIGKILL), replaced, and the item gets `default`. One step can never hang on one answer.
Workers are started with 'spawn' (the trainer process holds JAX threads, which fork would copy).

Every request carries a sequence number that the worker echoes, so a result can only ever reach
the item it belongs to: an answer left over from an interrupted `map` is discarded, never handed on.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import itertools
import multiprocessing as mp
import pickle
import threading
import time
from multiprocessing import connection
from typing import Any, Callable, Sequence


@dataclasses.dataclass
class PoolResult:
  value: Any
  status: str  # 'ok' | 'timeout' | 'error'
  error: str | None
  seconds: float


def _worker_main(conn, preload: tuple[str, ...], memory_limit_mb: int | None) -> None:
  if memory_limit_mb:
    import resource  # a memory bomb then fails inside the worker, not the host

    limit = memory_limit_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  for name in preload:
    importlib.import_module(name)
  conn.send("ready")
  while True:
    msg = conn.recv()
    if msg is None:
      return
    seq, blob = msg
    try:
      fn, args = pickle.loads(blob)
      out = (seq, "ok", fn(*args), None)
    except BaseException as e:  # noqa: BLE001 - report everything, keep serving
      out = (seq, "error", None, f"{type(e).__name__}: {e}"[:2000])
    try:
      conn.send(out)
    except (pickle.PicklingError, TypeError, AttributeError) as e:  # an unpicklable return value
      conn.send((seq, "error", None, f"result of {getattr(fn, '__name__', fn)!r} cannot be sent back: {e}"))


class _Worker:
  def __init__(self, ctx, preload, memory_limit_mb, start_timeout_s):
    self.conn, child = ctx.Pipe(duplex=True)
    self.proc = ctx.Process(target=_worker_main, args=(child, preload, memory_limit_mb), daemon=True)
    self.proc.start()
    child.close()
    if not self.conn.poll(start_timeout_s):
      self.kill()
      raise RuntimeError(
        f"reward worker did not start within {start_timeout_s} s (preload={preload}); check that those modules import"
      )
    assert self.conn.recv() == "ready"

  def kill(self) -> None:
    self.proc.kill()
    self.proc.join(5)
    self.conn.close()


class RewardPool:
  """`pool.map(fn, [(args...), ...])` -> values in order; a timed-out or failed item gets `default`.

  fn must be picklable by reference (a module-level function); an item whose function or
  arguments cannot be pickled gets status 'error' and the others still run. Cumulative counters
  in `pool.stats`: items, timeouts, errors, restarts. Use as a context manager or call `close()`.
  """

  def __init__(
    self,
    num_workers: int = 2,
    *,
    timeout_s: float = 10.0,
    preload: Sequence[str] = ("aepo_jax.rewards", "math_verify"),
    memory_limit_mb: int | None = 4096,
    start_timeout_s: float = 120.0,
  ):
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    self.timeout_s = timeout_s
    self._args = (mp.get_context("spawn"), tuple(preload), memory_limit_mb, start_timeout_s)
    self._workers: list[_Worker | None] = [_Worker(*self._args) for _ in range(num_workers)]
    self._seq = itertools.count()
    self._lock = threading.Lock()
    self.stats = dict(items=0, timeouts=0, errors=0, restarts=0)

  def _discard(self, i: int) -> None:
    """Kills worker i; a fresh one is started when it is next needed."""
    if self._workers[i] is not None:
      self._workers[i].kill()
      self._workers[i] = None
      self.stats["restarts"] += 1

  def _worker(self, i: int) -> _Worker:
    if self._workers[i] is None:
      self._workers[i] = _Worker(*self._args)
    return self._workers[i]

  def map_results(self, fn: Callable, items: Sequence[tuple], *, timeout_s: float | None = None) -> list[PoolResult]:
    timeout_s = self.timeout_s if timeout_s is None else timeout_s
    results: list[PoolResult | None] = [None] * len(items)
    with self._lock:
      if not self._workers:
        raise RuntimeError("RewardPool is closed")
      todo = list(range(len(items)))[::-1]
      busy: dict[int, tuple[int, int, float]] = {}  # worker -> (item, sequence number, start time)
      try:
        while todo or busy:
          for w in range(len(self._workers)):
            while w not in busy and todo:
              j = todo.pop()
              try:
                blob = pickle.dumps((fn, tuple(items[j])))
              except Exception as e:  # noqa: BLE001 - this item fails, the map goes on
                results[j] = PoolResult(
                  None, "error", f"cannot send item {j} to a worker: {type(e).__name__}: {e}"[:2000], 0.0
                )
                continue
              seq = next(self._seq)
              self._worker(w).conn.send((seq, blob))
              busy[w] = (j, seq, time.monotonic())
          if not busy:
            continue
          now = time.monotonic()
          wait_s = max(0.0, min(t0 + timeout_s for _, _, t0 in busy.values()) - now)
          ready = connection.wait([self._workers[w].conn for w in busy], timeout=wait_s)
          now = time.monotonic()
          for w in list(busy):
            j, seq, t0 = busy[w]
            conn = self._workers[w].conn
            if conn in ready:
              try:
                got, status, value, err = conn.recv()
              except (EOFError, OSError):  # the worker died (e.g. killed by the OS)
                got, status, value, err = seq, "error", None, "reward worker died"
                self._discard(w)
              if got != seq:  # an answer to an earlier, abandoned request: drop it
                continue
              results[j] = PoolResult(value, status, err, now - t0)
              del busy[w]
            elif now - t0 >= timeout_s:
              self._discard(w)
              results[j] = PoolResult(None, "timeout", f"over {timeout_s} s", now - t0)
              del busy[w]
      finally:
        for w in busy:  # left by an exception (e.g. KeyboardInterrupt): no work may outlive the map
          self._discard(w)
      self.stats["items"] += len(items)
      self.stats["timeouts"] += sum(r.status == "timeout" for r in results)
      self.stats["errors"] += sum(r.status == "error" for r in results)
    return results  # type: ignore[return-value]

  def map(self, fn: Callable, items: Sequence[tuple], *, timeout_s: float | None = None, default: Any = None) -> list:
    return [r.value if r.status == "ok" else default for r in self.map_results(fn, items, timeout_s=timeout_s)]

  def close(self) -> None:
    with self._lock:
      for w in self._workers:
        if w is None:
          continue
        try:
          w.conn.send(None)
        except OSError:
          pass
        w.proc.join(2)
        if w.proc.is_alive():
          w.kill()
      self._workers = []

  def __enter__(self) -> "RewardPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


_SHARED: RewardPool | None = None
_SHARED_LOCK = threading.Lock()


def shared_pool(num_workers: int = 2) -> RewardPool:
  """The process's RewardPool for production scoring (trainer reward, DAPO filter, evaluation).

  Started on first use (later calls get the same pool whatever they pass) and closed at exit, so
  one process keeps one set of workers however many scorers it builds. Pass per-call timeouts to
  `map`.
  """
  global _SHARED
  with _SHARED_LOCK:
    if _SHARED is None or not _SHARED._workers:
      _SHARED = RewardPool(num_workers)
      atexit.register(_SHARED.close)
    return _SHARED
