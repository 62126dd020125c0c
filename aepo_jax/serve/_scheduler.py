"""Continuous batching over one `Engine`: jobs (a prompt and its n choices) join free slots between decode chunks
and leave as they finish; every engine call happens on the scheduler's one thread.

A job's prompt is prefilled into one slot and forked into n - 1 more with `copy_slots`, so its choices share the
prompt's KV. Each slot samples with its own request's settings (`Engine(per_slot_sampling=True)`), and a row's
computation does not depend on the other rows, so a greedy job gives the same tokens alone or among others. After
a job joins, the next chunk is one step long, so its first token follows its prefill at once; later chunks are
`steps_per_call` steps. Outputs go to the job's `sink` (a queue.Queue read by the HTTP thread) as `Update`s;
the HTTP thread ends a choice early (stop string, disconnect) with `stop_choice` / `cancel`, and the slot is
released before the next chunk.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import queue
import threading
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from aepo_jax.model import forward
from aepo_jax.rollout import STOP_REASON_NAMES, SamplingParams


class QueueFull(Exception):
  """The waiting queue is full; retry after `retry_after` seconds."""

  def __init__(self, retry_after: int = 1):
    super().__init__(f"the server's queue is full; retry after {retry_after} s")
    self.retry_after = retry_after


class ShuttingDown(Exception):
  """The server drains and takes no new requests."""


@dataclasses.dataclass(eq=False)
class Job:
  """One prompt and its n choices. `tag` is the caller's index of the job (echoed in its updates)."""

  prompt: list
  n: int
  max_tokens: int
  sampling: SamplingParams
  seeds: list  # one per choice
  sink: queue.Queue
  tag: int = 0
  top_logprobs: int = 0  # top entries per generated token (0: only the token's own log-prob)
  prompt_logprobs: Optional[int] = None  # None: none; k: log-prob of each prompt token and its top k
  slots: list = dataclasses.field(default_factory=list)
  cancelled: bool = False
  submitted: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass
class Update:
  """New tokens of one choice (numpy arrays), its end (`finish`: None or the engine's stop reason name:
  'eos', 'length', 'cache_full'), an `error` message, or the prompt's log-probs (choice -1)."""

  tag: int
  choice: int
  tokens: np.ndarray = None
  logprobs: np.ndarray = None
  top_ids: np.ndarray = None
  top_logprobs: np.ndarray = None
  finish: Optional[str] = None
  error: Optional[str] = None


def _bucket(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


@functools.partial(jax.jit, static_argnums=(0, 3))
def _prompt_logprobs(config, params, tokens_t, k: int):
  """Log-prob of each token given those before it (raw logits, T = 1), and the top k, for positions 1..T-1."""
  logp_tv = jax.nn.log_softmax(forward(config, params, tokens_t[None])[0].astype(jnp.float32), axis=-1)[:-1]
  chosen_t = jnp.take_along_axis(logp_tv, tokens_t[1:, None], axis=1)[:, 0]
  top_v, top_i = jax.lax.top_k(logp_tv, max(k, 1))
  return chosen_t, top_i[:, :k], top_v[:, :k]


class Scheduler:
  """Owns the engine's DecodeState and its thread. `submit` jobs; read their sinks."""

  def __init__(self, engine, params, *, steps_per_call: int = 8, max_queue: int = 64):
    if not engine.per_slot_sampling:
      raise ValueError("Scheduler: the engine must be built with per_slot_sampling=True (one request per slot).")
    self.engine, self.params = engine, params
    self.steps_per_call, self.max_queue = int(steps_per_call), int(max_queue)
    self._state = None
    self._cv = threading.Condition()
    self._pending = collections.deque()
    self._owner = {}  # slot -> (job, choice)
    self._fresh = set()  # slots that have not produced a token yet
    self._to_release = set()  # slots to end on the host (stop strings, cancelled jobs)
    self._free = list(range(engine.max_slots))
    self._closed = False
    self._exit = False
    self.error: Optional[BaseException] = None
    # metrics
    self.generated_tokens = 0
    self.prompt_tokens = 0
    self.jobs_done = 0
    self._recent = collections.deque()  # (time, tokens) of recent decode calls
    self._thread = threading.Thread(target=self._run, name="aepo-serve-scheduler", daemon=True)

  # ------------------------------------------------------------------------------------------------
  # Called from other threads
  # ------------------------------------------------------------------------------------------------
  def start(self):
    if self._state is None:
      self._state = self.engine.init_decode_state()
      self._thread.start()
    return self

  def submit(self, jobs):
    """Queues jobs (all or none). Raises QueueFull, ShuttingDown, or ValueError for n > slots."""
    with self._cv:
      if self._closed or self.error is not None:
        raise ShuttingDown("the server is shutting down" if self.error is None else f"engine failed: {self.error}")
      for job in jobs:
        if job.n > self.engine.max_slots:
          raise ValueError(f"n={job.n} exceeds the server's {self.engine.max_slots} slots")
      if len(self._pending) + len(jobs) > self.max_queue:
        raise QueueFull(retry_after=1)
      self._pending.extend(jobs)
      self._cv.notify_all()

  def cancel(self, job):
    """Ends the job: dropped if waiting, its slots released before the next chunk if running."""
    with self._cv:
      job.cancelled = True
      self._to_release.update(s for s in job.slots if self._owner.get(s, (None,))[0] is job)
      self._cv.notify_all()

  def stop_choice(self, job, choice: int):
    """Ends one running choice (e.g. a stop string found on the host)."""
    with self._cv:
      if choice < len(job.slots) and self._owner.get(job.slots[choice], (None,))[0] is job:
        self._to_release.add(job.slots[choice])
        self._cv.notify_all()

  def close(self):
    """No new jobs; running and waiting ones finish. The thread exits once idle."""
    with self._cv:
      self._closed = True
      self._exit = True
      self._cv.notify_all()

  def abort(self):
    """Ends every job now (their sinks get an error)."""
    with self._cv:
      jobs = list(self._pending) + [j for j, _ in self._owner.values()]
      self._pending.clear()
      for job in dict.fromkeys(jobs):
        job.cancelled = True
        job.sink.put(Update(job.tag, 0, error="the server shut down before the request finished"))
      self._to_release.update(self._owner)
      self._closed = self._exit = True
      self._cv.notify_all()

  def join(self, timeout: Optional[float] = None):
    if self._thread.ident is not None:  # started
      self._thread.join(timeout)

  @property
  def busy(self) -> bool:
    return bool(self._pending or self._owner)

  @property
  def queue_length(self) -> int:
    return len(self._pending)

  @property
  def slots_in_use(self) -> int:
    return len(self._owner)

  def tokens_per_second(self, window: float = 10.0) -> float:
    now = time.monotonic()
    recent = [(t, n) for t, n in list(self._recent) if t > now - window]
    return sum(n for _, n in recent) / window if recent else 0.0

  # ------------------------------------------------------------------------------------------------
  # The scheduler thread
  # ------------------------------------------------------------------------------------------------
  def _run(self):
    try:
      while True:
        with self._cv:
          while not (self._pending or self._owner or self._exit):
            self._cv.wait()
          if self._exit and not self._owner and not self._pending:
            return
          release = sorted(self._to_release)
          self._to_release.clear()
          for s in release:
            self._owner.pop(s, None)
            self._fresh.discard(s)
          self._free.extend(release)  # released below, before any admitted job's add
          admit = []
          while self._pending and (
            self._pending[0].cancelled or self._pending[0].n <= len(self._free) - sum(j.n for j in admit)
          ):
            job = self._pending.popleft()
            if not job.cancelled:
              admit.append(job)
        if release:
          self._state = self.engine.release(self._state, release)
        if admit:
          self._admit(admit)
        if self._owner:
          self._step()
    except BaseException as e:  # noqa: BLE001 (every waiting request must hear of it)
      logging.exception("serve: the scheduler failed")
      with self._cv:
        self.error = e
        jobs = list(self._pending) + [j for j, _ in self._owner.values()]
        self._pending.clear()
        self._owner.clear()
      for job in dict.fromkeys(jobs):
        job.sink.put(Update(job.tag, 0, error=f"the engine failed: {e}"))

  def _admit(self, jobs):
    eng = self.engine
    for job in jobs:
      job.slots = [self._free.pop(0) for _ in range(job.n)]
    # Prefill in groups of a power-of-two size (few compiled variants of the row edit).
    k, ok = 0, []
    while k < len(jobs):
      size = 1 << (len(jobs) - k).bit_length() - 1
      group = jobs[k : k + size]
      k += size
      try:
        self._state = eng.add(
          self.params,
          self._state,
          [j.slots[0] for j in group],
          [j.prompt for j in group],
          [j.seeds[0] for j in group],
          [j.max_tokens for j in group],
          sampling=[j.sampling for j in group],
        )
        ok += group
      except ValueError as e:  # checked before any compute: the state is unchanged
        for job in group:
          job.sink.put(Update(job.tag, 0, error=str(e)))
          self._free.extend(job.slots)
    jobs = ok
    src = [j.slots[0] for j in jobs for _ in j.slots[1:]]
    if src:
      dst = [s for j in jobs for s in j.slots[1:]]
      self._state = eng.copy_slots(self._state, src, dst, [sd for j in jobs for sd in j.seeds[1:]])
    with self._cv:
      for job in jobs:
        for c, s in enumerate(job.slots):
          self._owner[s] = (job, c)
          self._fresh.add(s)
        if job.cancelled:  # cancelled while prefilling
          self._to_release.update(job.slots)
    for job in jobs:
      self.prompt_tokens += len(job.prompt)
      if job.prompt_logprobs is not None:
        self._send_prompt_logprobs(job)

  def _send_prompt_logprobs(self, job):
    toks = np.asarray(job.prompt, np.int32)
    t = _bucket(max(toks.size, 16))
    padded = np.zeros((t,), np.int32)
    padded[: toks.size] = toks  # causal: the padding after the prompt changes nothing before it
    chosen, top_i, top_v = jax.device_get(
      _prompt_logprobs(self.engine.config, self.params, jnp.asarray(padded), int(job.prompt_logprobs))
    )
    m = toks.size - 1
    job.sink.put(Update(job.tag, -1, tokens=toks, logprobs=chosen[:m], top_ids=top_i[:m], top_logprobs=top_v[:m]))

  def _step(self):
    eng = self.engine
    owners = dict(self._owner)
    steps = 1 if self._fresh else self.steps_per_call
    want = max(j.top_logprobs for j, _ in owners.values())
    top = 0 if want == 0 else (5 if want <= 5 else 20)
    self._state, out = eng.decode(self.params, self._state, steps, top_logprobs=min(top, eng.config.vocab_size))
    out, info = jax.device_get(out), eng.host_info(self._state)
    finished, produced = [], 0
    for slot, (job, c) in owners.items():
      valid = out.valid[slot]
      n = int(valid.sum())
      active = bool(info["active"][slot])
      if n == 0 and active:
        continue
      produced += n
      self._fresh.discard(slot)
      finish = None if active else STOP_REASON_NAMES[int(info["stop_reason"][slot])]
      if not job.cancelled:
        k = job.top_logprobs
        job.sink.put(
          Update(
            job.tag,
            c,
            tokens=out.token[slot][valid],
            logprobs=out.logprob[slot][valid],
            top_ids=out.top_ids[slot][valid][:, :k] if k else None,
            top_logprobs=out.top_logprobs[slot][valid][:, :k] if k else None,
            finish=finish,
          )
        )
      if finish is not None:
        finished.append(slot)
    self.generated_tokens += produced
    now = time.monotonic()
    self._recent.append((now, produced))
    while self._recent and self._recent[0][0] < now - 60:
      self._recent.popleft()
    with self._cv:
      for slot in finished:
        job, _ = self._owner.pop(slot)
        self._to_release.discard(slot)
        self._free.append(slot)  # stopped on device: inactive already, `add` overwrites the row
        if all(s not in self._owner or self._owner[s][0] is not job for s in job.slots):
          self.jobs_done += 1
