"""`--dist loadfile` that survives a crashed worker (registered by tests/conftest.py's `pytest_configure`).

pytest-xdist 3.8's LoadFileScheduling handles a worker that dies (segfault, abort, SIGKILL, a SIGINT that ends its
session) badly: it puts the dead worker's whole file back at the end of the queue, so tests that already passed run
again and the crashed test both fails and runs again; and the rescheduling can hand work to the replacement worker
before its collection is registered, after which the session can wait forever (upstream #784, #1313, #1363: one CI
run here sat until the CI limit). This scheduler, on a crash:
- names the test that was running (the first unfinished one of the dead worker's files, a worker runs its tests in
  the order it got them, if the worker had reported its start; a worker that died between tests blames none) and
  prints the crash;
- puts the dead worker's unfinished tests back at the front of the queue, in their order;
- runs the crashed test once more, on a worker started after the crash (its file waits for one): a crash that
  repeats, or one after which xdist starts no new worker (--max-worker-restart), fails the test (xdist's "worker
  crashed while running" report); one that does not is listed in the terminal summary, so a flaky crash is visible
  in the log without failing CI;
- hands work only to workers whose collection is registered, and shuts down a worker whose collection xdist
  rejected (it would be waited for forever).
And a worker that gets SIGINT prints every thread's stack to the real stderr and exits at once. xdist's controller
never sends one; execnet sends it to its own worker when the worker's input pipe has ended (and exits it 10 s
later), after which the worker can take no more work: as a KeyboardInterrupt it would end the whole session (xdist
stops everything when a worker reports one), as an exit it is a crash, rerun above. A Ctrl-C at the terminal still
stops the session: the controller gets it too.

Register it from a conftest's `pytest_configure` (trylast): `register(config)`.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from collections import OrderedDict

import pytest

from xdist.scheduler import LoadFileScheduling

RERUNS_AFTER_CRASH = 1


class CrashSafeLoadFileScheduling(LoadFileScheduling):
  def __init__(self, config, log=None):
    super().__init__(config, log)
    self.crashes: list[tuple[str, str, bool]] = []  # (worker id, test id, whether it runs again)
    self._crash_counts: dict[str, int] = {}
    self._reserved: OrderedDict[str, OrderedDict[str, bool]] = OrderedDict()  # for workers started after the crash
    self._survivors: set = set()
    self.started: set[str] = set()  # tests whose start a worker reported (CrashSafePlugin.pytest_runtest_logstart)

  @property
  def tests_finished(self) -> bool:
    return not self._reserved and super().tests_finished

  def add_node_collection(self, node, collection):
    super().add_node_collection(node, collection)
    if node not in self.registered_collections:
      node.shutdown()  # collection rejected: it never gets work, so it must not be waited for

  def _assign_work_unit(self, node):
    if node in self.registered_collections:  # schedule()'s first round calls this directly
      super()._assign_work_unit(node)

  def remove_node(self, node):
    workload = self.assigned_work.pop(node)
    unfinished = OrderedDict(
      (scope, OrderedDict((nodeid, False) for nodeid, done in unit.items() if not done))
      for scope, unit in workload.items()
    )
    unfinished = OrderedDict((scope, unit) for scope, unit in unfinished.items() if unit)
    if not unfinished:
      return None  # a clean finish
    crashitem = next(iter(next(iter(unfinished.values()))))  # a worker runs its tests in the order it got them
    running = crashitem in self.started
    self.started -= {nodeid for unit in unfinished.values() for nodeid in unit}  # they start afresh
    if not running:  # died starting up, or idle with its last test held back (xdist waits for more work first)
      self._say(f"worker {node.gateway.id} died between tests: its unfinished tests run again, none is blamed")
      self._requeue(unfinished)
      return None
    before = self._crash_counts.get(crashitem, 0)
    self._crash_counts[crashitem] = before + 1
    ds = self.config.pluginmanager.getplugin("dsession")
    limit = getattr(ds, "_max_worker_restart", None)
    last = limit is not None and getattr(ds, "_failed_nodes_count", 0) + 1 > limit  # DSession clones no worker
    rerun = before < RERUNS_AFTER_CRASH and not last
    self.crashes.append((node.gateway.id, crashitem, rerun))
    if not rerun:  # reported failed by xdist; the rest of its file still runs
      scope = self._split_scope(crashitem)
      del unfinished[scope][crashitem]
      if not unfinished[scope]:
        del unfinished[scope]
    self._say(
      f"worker {node.gateway.id} died while running {crashitem}"
      + (": running it once more on a fresh worker" if rerun else f" (crash {before + 1}: reported failed)")
    )
    self._requeue(unfinished, reserve=self._split_scope(crashitem) if rerun else None)
    return None if rerun else crashitem

  def _requeue(self, unfinished, reserve=None) -> None:
    """The dead worker's unfinished files go first, in the order it had them (a file another worker has already
    started is never split: `scope` keys are unique across the queue and the assigned work). `reserve`: the file of
    a test to rerun, held for a worker that starts after this crash."""
    self.workqueue = OrderedDict(
      list(unfinished.items()) + [kv for kv in self.workqueue.items() if kv[0] not in unfinished]
    )
    if reserve is not None:
      self._reserved[reserve] = self.workqueue.pop(reserve)
      self._survivors = set(self.registered_collections)
    for other in list(self.assigned_work):
      self._reschedule(other)

  def _reschedule(self, node):
    if node not in self.registered_collections:
      return  # a replacement worker still collecting: `schedule()` runs again once it has
    if self._reserved and node not in self._survivors and not node.shutting_down:
      self.workqueue.update(self._reserved)
      for scope in reversed(self._reserved):
        self.workqueue.move_to_end(scope, last=False)
      self._reserved.clear()
    super()._reschedule(node)

  def _say(self, message: str) -> None:
    reporter = self.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
      reporter.write_line(f"\n[crash-safe loadfile] {message}", red=True, bold=True)

  def summary_lines(self) -> list[str]:
    return [
      f"{nodeid}: worker {worker} died while running it; "
      + ("it ran again on a fresh worker (its result is above)" if rerun else "reported failed")
      for worker, nodeid, rerun in self.crashes
    ]


class CrashSafePlugin:
  def __init__(self):
    self.scheduler = None

  def pytest_xdist_make_scheduler(self, config, log):
    if config.getvalue("dist") != "loadfile":
      return None  # other --dist modes are xdist's own
    self.scheduler = CrashSafeLoadFileScheduling(config, log)
    return self.scheduler

  def pytest_runtest_logstart(self, nodeid, location):
    if self.scheduler is not None:  # the controller: a worker reported the start of a test
      self.scheduler.started.add(nodeid)

  def pytest_terminal_summary(self, terminalreporter):
    if self.scheduler is not None and self.scheduler.crashes:
      terminalreporter.write_sep("=", "workers that died (tests/xdist_crash_safe.py)", red=True)
      for line in self.scheduler.summary_lines():
        terminalreporter.write_line(line)

  @pytest.hookimpl(tryfirst=True)
  def pytest_unconfigure(self, config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
      signal.signal(signal.SIGINT, signal.default_int_handler)  # before pytest closes the stderr copy it writes to


def register(config) -> None:
  from _pytest.faulthandler import fault_handler_stderr_fd_key

  config.pluginmanager.register(CrashSafePlugin(), "xdist_crash_safe")
  if os.environ.get("PYTEST_XDIST_WORKER"):
    fd = config.stash.get(fault_handler_stderr_fd_key, None)
    signal.signal(signal.SIGINT, lambda signum, frame: _exit_on_sigint(fd))


def _exit_on_sigint(fd) -> None:
  worker = os.environ.get("PYTEST_XDIST_WORKER")
  if fd is not None:
    os.write(
      fd, f"\n[crash-safe loadfile] worker {worker} (pid {os.getpid()}) got SIGINT: exiting; its threads:\n".encode()
    )
    faulthandler.dump_traceback(file=fd, all_threads=True)
  os._exit(1)
