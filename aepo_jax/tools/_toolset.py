"""ToolSet: what the agent loop calls for each tool call, with the spec's limits, retries and timeouts.

Training (spec §1.2 step 2.3-2.4): one total `call_limit` per trajectory; a call over it yields
`limit_reached` (the loop appends EOS and ends the trajectory); an empty call yields `empty_call` (the loop
ends the trajectory without a result, as the official code does). A tool that raises is tried up to
`retry_count` times; then the text is `Error: Tool(<tag>) execution failed with message: ...`. A tool that
answers with nothing (a program that prints nothing) has answered: the text is `Tool(<tag>) returned empty
output.` at once. A sandbox killed mid-call (`result.crashed`: SIGKILL from outside, a segfault) has not: its text
says so, `ok` is False, and `tools/<tag>_crashes` counts it.
Deliberate differences: the official rollout also retries empty output (a program that prints nothing ran
three times, for nothing) and reports a raising tool as "returned empty output"; we keep the exception
message, which tells the model (and whoever reads the logs) what went wrong.
Evaluation (spec §2.5): at most `eval_limits` calls per tool (default the registered ToolSpec.eval_limit: 5
python, 10 search); over the limit the model gets the official refusal text and continues; a repeated search query
gets the official "You have searched this query..." text. Refused calls do not count as calls.
A tool that declares `wants_trajectory = True` (the SDS browser) is called as `tool(content, trajectory=steps)`, with
the steps the caller passes to `submit` (`_protocol.trajectory_steps`: the trajectory's model turns and tool results so
far); every other tool is called as `tool(content)`. A tool's `call_timeout_s`, where it has one, replaces `timeout_s`
for its calls.
"""

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from aepo_jax.tools import _protocol, _registry
from aepo_jax.tools._protocol import ToolCall
from aepo_jax.tools._search import clean_query

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CallState:
  """Per-trajectory tool bookkeeping; a branch copies it (`copy()`) together with its tokens."""

  total_calls: int = 0
  calls_by_tag: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  queries: set = dataclasses.field(default_factory=set)

  def copy(self) -> "CallState":
    return CallState(self.total_calls, collections.Counter(self.calls_by_tag), set(self.queries))


@dataclasses.dataclass(frozen=True)
class ToolOutput:
  """text: what goes between the result tags. ok: the tool ran and answered (possibly with nothing: info['empty']).
  info: flags for the loop ('limit_reached', 'empty_call', 'refused', 'repeated', 'timeout', 'crashed'),
  'retries', and 'seconds' (real time from submission to the answer, all tries together)."""

  text: str
  ok: bool
  tag: str
  info: dict = dataclasses.field(default_factory=dict)

  @property
  def ends_trajectory(self) -> bool:
    return bool(self.info.get("limit_reached") or self.info.get("empty_call"))


def _text_of(result: Any) -> tuple[str, bool, bool]:
  """A tool returns a str or an object with `.text` (e.g. PythonResult); returns (text, timed_out, crashed)."""
  if isinstance(result, str):
    return result, False, False
  return (
    str(getattr(result, "text", "")),
    bool(getattr(result, "timed_out", False)),
    bool(getattr(result, "crashed", False)),
  )


class ToolSet:
  """Tools by tag plus the limits of spec §4.

  Args:
      tools: {tag: callable(content) -> str | object with .text},
          e.g. {"python": PythonTool(), "search": SearchTool(...)}.
      mode: 'train' or 'eval'.
      call_limit: total calls per trajectory in training (3 reasoning / 6 deep search).
      eval_limits: per-tool limits in evaluation.
      retry_count: tries while the tool raises (official default 3).
      timeout_s: per-call bound on waiting (all tries together, from submission); a hung tool yields an error
          text that says how long it really waited.
      max_workers: thread pool size for submit().
      result_tags: {tag: the tag its results are wrapped in}; default 'result' (ToolSpec.result_tag).
  """

  def __init__(
    self,
    tools: dict[str, Callable[[str], Any]],
    mode: str = "train",
    call_limit: int = 3,
    eval_limits: dict[str, int] | None = None,
    retry_count: int = 3,
    timeout_s: float = 150.0,
    max_workers: int = 64,
    result_tags: dict[str, str] | None = None,
  ):
    if mode not in ("train", "eval"):
      raise ValueError(f"ToolSet(mode={mode!r}); expected 'train' or 'eval'")
    if not tools:
      raise ValueError("ToolSet needs at least one tool, e.g. {'python': PythonTool()}")
    if retry_count < 1:
      raise ValueError(f"ToolSet(retry_count={retry_count}) must be >= 1")
    self.tools, self.mode, self.call_limit = dict(tools), mode, call_limit
    self.eval_limits = {**_registry.default_eval_limits(), **(eval_limits or {})}
    self.result_tags = {tag: (result_tags or {}).get(tag, "result") for tag in self.tools}
    self.retry_count, self.timeout_s = retry_count, timeout_s
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="toolset")
    self._metrics = collections.Counter()
    self._tool_base: dict[str, float] = {}  # the tools' own counters at the last reset
    self._lock = threading.Lock()

  @property
  def tags(self) -> tuple[str, ...]:
    return tuple(self.tools)

  # ---------------------------------------------------------------- metrics
  def _count(self, key: str, n: float = 1) -> None:
    with self._lock:
      self._metrics[key] += n

  def _tool_counters(self) -> dict[str, float]:
    """Counters a tool keeps itself (`tool.metrics()`, cumulative), e.g. the search client's HTTP retries."""
    out = {}
    for tag, tool in self.tools.items():
      counters = getattr(tool, "metrics", None)
      if callable(counters):
        out.update({f"tools/{tag}_{k}": float(v) for k, v in counters().items()})
    return out

  def metrics(self) -> dict[str, float]:
    """Counters since the last reset, such as tools/python_calls, tools/python_timeouts, tools/python_crashes,
    tools/search_retries, tools/search_http_retries, tools/limit_reached."""
    tool_counters = self._tool_counters()
    with self._lock:
      out = dict(self._metrics)
      out.update({k: v - self._tool_base.get(k, 0.0) for k, v in tool_counters.items()})
    return out

  def reset_metrics(self) -> None:
    tool_counters = self._tool_counters()
    with self._lock:
      self._metrics.clear()
      self._tool_base = tool_counters

  # ---------------------------------------------------------------- admission (synchronous, updates state)
  def _admit(self, call: ToolCall, state: CallState) -> ToolOutput | None:
    """Applies the limits; returns an immediate ToolOutput, or None when the tool must run."""
    if call.tag not in self.tools:
      raise ValueError(f"no tool for tag {call.tag!r}; this ToolSet has {self.tags}")
    if self.mode == "train":
      if state.total_calls >= self.call_limit:
        self._count("tools/limit_reached")
        return ToolOutput("", False, call.tag, {"limit_reached": True})
      state.total_calls += 1  # counted before the content check, as in the official rollout
      state.calls_by_tag[call.tag] += 1
      if not call.content:
        self._count("tools/empty_calls")
        return ToolOutput("", False, call.tag, {"empty_call": True})
      return None
    # eval
    if state.calls_by_tag[call.tag] >= self.eval_limits.get(call.tag, self.call_limit):
      self._count(f"tools/{call.tag}_refusals")
      return ToolOutput(_protocol.limit_message(call.tag), False, call.tag, {"refused": True})
    if call.tag == "search":
      query = clean_query(call.content)
      if query in state.queries:
        self._count("tools/search_repeats")
        return ToolOutput(_protocol.REPEATED_QUERY_MESSAGE, False, call.tag, {"repeated": True})
      state.queries.add(query)
    state.total_calls += 1
    state.calls_by_tag[call.tag] += 1
    return None

  # ---------------------------------------------------------------- running
  def wants_trajectory(self, tag: str) -> bool:
    """Whether the tool answering `tag` reads the trajectory so far (then the caller passes it to `submit`)."""
    return bool(getattr(self.tools.get(tag), "wants_trajectory", False))

  def _call_timeout(self, tag: str) -> float:
    return float(getattr(self.tools[tag], "call_timeout_s", None) or self.timeout_s)

  def _run_with_retry(self, call: ToolCall, timing: dict, trajectory=None) -> ToolOutput:
    tool, tag = self.tools[call.tag], call.tag
    kwargs = {"trajectory": trajectory} if self.wants_trajectory(tag) else {}
    timing["started"] = time.monotonic()
    error = None
    for attempt in range(self.retry_count):
      if attempt:
        self._count(f"tools/{tag}_retries")
      try:
        text, timed_out, crashed = _text_of(tool(call.content, **kwargs))
      except Exception as e:  # noqa: BLE001 -- any tool failure becomes text for the model
        log.warning("Tool(%s) failed (try %d/%d): %s", tag, attempt + 1, self.retry_count, e)
        error = e
        continue
      seconds = time.monotonic() - timing["submitted"]
      self._count(f"tools/{tag}_timeouts", timed_out)
      self._count(f"tools/{tag}_seconds", time.monotonic() - timing["started"])
      info = {"retries": attempt, "timed_out": bool(timed_out), "seconds": seconds}
      if crashed:  # killed mid-call: no answer. Not retried: a program that crashes itself would again
        self._count(f"tools/{tag}_crashes")
        return ToolOutput(text, False, tag, dict(info, crashed=True))
      if not text:  # an answer all the same: running it again would print nothing again
        self._count(f"tools/{tag}_empty")
        return ToolOutput(_protocol.empty_output_message(tag), True, tag, dict(info, empty=True))
      return ToolOutput(text, True, tag, info)
    self._count(f"tools/{tag}_failures")
    self._count(f"tools/{tag}_seconds", time.monotonic() - timing["started"])
    return ToolOutput(
      _protocol.failure_message(tag, error),
      False,
      tag,
      {"retries": self.retry_count - 1, "error": repr(error), "seconds": time.monotonic() - timing["submitted"]},
    )

  def _timeout_output(self, tag: str, timing: dict) -> ToolOutput:
    self._count(f"tools/{tag}_timeouts")
    self._count(f"tools/{tag}_failures")
    now = time.monotonic()
    seconds = now - timing["submitted"]
    started = timing.get("started")
    queued = (started if started is not None else now) - timing["submitted"]
    why = f"no result after {seconds:.1f} s (limit {self._call_timeout(tag):g} s"
    why += f"; {queued:.1f} s of it waiting for a free tool worker)" if queued >= 0.1 else ")"
    return ToolOutput(_protocol.failure_message(tag, why), False, tag, {"timeout": True, "seconds": seconds})

  def submit(self, call: ToolCall, state: CallState, *, trajectory=None) -> "concurrent.futures.Future[ToolOutput]":
    """Admits the call now (updating `state`) and runs it in the pool. The future always resolves within
    about `timeout_s` (the tool's `call_timeout_s`): a hung tool resolves it with an error text while its thread
    finishes in the background. `trajectory`: the steps so far, given to a tool that wants them (module docstring)."""
    outer: concurrent.futures.Future = concurrent.futures.Future()
    immediate = self._admit(call, state)
    if immediate is not None:
      outer.set_result(immediate)
      return outer
    self._count(f"tools/{call.tag}_calls")
    timing = {"submitted": time.monotonic(), "started": None}
    inner = self._pool.submit(self._run_with_retry, call, timing, trajectory)
    timer = threading.Timer(
      self._call_timeout(call.tag), _resolve, (outer, lambda tag: self._timeout_output(tag, timing), call.tag)
    )
    timer.daemon = True
    timer.start()

    def _done(f):
      timer.cancel()
      try:
        out = f.result()
      except Exception as e:  # noqa: BLE001 -- _run_with_retry catches tool errors; this is a bug guard
        out = ToolOutput(_protocol.failure_message(call.tag, e), False, call.tag, {})
      _resolve(outer, lambda _tag: out, call.tag)

    inner.add_done_callback(_done)
    return outer

  def execute(self, call: ToolCall, state: CallState, *, trajectory=None) -> ToolOutput:
    return self.submit(call, state, trajectory=trajectory).result()

  def shutdown(self, wait: bool = False) -> None:
    self._pool.shutdown(wait=wait, cancel_futures=True)


_RESOLVE_LOCK = threading.Lock()


def _resolve(fut: concurrent.futures.Future, make: Callable[[str], ToolOutput], tag: str) -> None:
  """Sets the result once; whichever of completion and timeout comes first wins (and alone counts)."""
  with _RESOLVE_LOCK:
    if not fut.done():
      fut.set_result(make(tag))
