"""The Python tool: each call runs model-written code in a fresh isolated process (spec §4).

    result = run_python("x = 6 * 7\\nx", timeout_s=10)
    result.text  # "42": stdout, or stderr on error, as the official tool returns

Limits: wall clock (kills the whole process tree/namespace), CPU seconds, address space, processes, file size,
open files, and captured output (truncated with a marker; a program that keeps writing is killed).
"""

import concurrent.futures
import dataclasses
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time

from aepo_jax.tools import _isolation
from aepo_jax.tools._pycode import wrap_last_expression

# Runs inside the sandbox: set rlimits, then exec the model's code read from stdin as file "<python>".
_BOOT = r"""
import os, sys, resource, linecache, traceback
cpu, mem, nproc, fsize, nofile = (int(a) for a in sys.argv[1:6])
src = sys.stdin.read()
sys.stdin.close()
sys.stdin = open(os.devnull)
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash must not spend seconds writing a core file
for lim, val in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_FSIZE, fsize),
                                  (resource.RLIMIT_NOFILE, nofile)):
        if val > 0:
                resource.setrlimit(lim, (val, val))
linecache.cache["<python>"] = (len(src), None, src.splitlines(True), "<python>")
sys.argv = ["<python>"]
try:
        exec(compile(src, "<python>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
        raise
except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)
"""
TRUNCATION_MARKER = "\n[... output truncated at {n} characters]"
# stderr fragments that tell which rlimit a program ran into (checked in this order).
_LIMIT_SIGNS = (
  ("memory", "MemoryError"),
  ("processes", "Resource temporarily unavailable"),
  ("file_size", "File too large"),
  ("open_files", "Too many open files"),
)


@dataclasses.dataclass(frozen=True)
class PythonResult:
  """Outcome of one sandboxed run. `text` is what the model sees."""

  stdout: str
  stderr: str
  exit_code: int  # negative: killed by that signal
  timed_out: bool
  limit_hit: str | None  # 'wall' | 'cpu' | 'memory' | 'processes' | 'file_size' | 'open_files' | 'output'
  truncated: bool
  isolation: str  # 'bwrap' | 'unshare' | 'none'
  wall_s: float

  @property
  def ok(self) -> bool:
    return self.exit_code == 0 and not self.timed_out

  @property
  def crashed(self) -> bool:
    """Killed by a signal that no limit of ours explains: SIGKILL from outside (the OOM killer, an operator),
    a segfault. The program did not finish, so its output is no answer."""
    return self.exit_code < 0 and not self.timed_out and self.limit_hit is None

  @property
  def text(self) -> str:
    """stdout on success, else stderr (official tool); a timeout note is appended to what was printed."""
    if self.timed_out:
      return (self.stdout + "\n" if self.stdout.strip() else "") + self.stderr.strip()
    return (self.stdout if self.exit_code == 0 else self.stderr).strip()


@dataclasses.dataclass(frozen=True)
class PythonLimits:
  """Resource limits of one call. 0 disables a limit (not recommended)."""

  timeout_s: float = 120.0  # wall clock (spec §4: 120 s)
  cpu_s: int = 0  # 0: ceil(timeout_s) + 1
  memory_mb: int = 4096  # address space
  max_processes: int = 64  # processes+threads of the sandbox uid
  max_file_mb: int = 64
  max_open_files: int = 256
  tmpfs_mb: int = 256
  max_output_chars: int = 16384  # per stream; more is cut with TRUNCATION_MARKER
  kill_output_bytes: int = 4 << 20  # a program that writes more than this in total is killed


def _count_user_processes(uid: int) -> int:
  n = 0
  for pid in os.listdir("/proc"):
    if pid.isdigit():
      try:
        if os.stat(f"/proc/{pid}").st_uid == uid:
          n += 1
      except OSError:
        pass
  return n


def _signal_name(num: int) -> str:
  try:
    return signal.Signals(num).name
  except ValueError:
    return f"signal {num}"


def _collect(proc: subprocess.Popen, limits: PythonLimits, deadline: float):
  """Reads stdout/stderr until exit or deadline. Returns (out, err, timed_out, over_output)."""
  bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
  total, timed_out, over = 0, False, False
  sel = selectors.DefaultSelector()
  for f in (proc.stdout, proc.stderr):
    os.set_blocking(f.fileno(), False)
    sel.register(f.fileno(), selectors.EVENT_READ)
  open_fds = set(bufs)
  exited_at = None
  while open_fds:
    now = time.monotonic()
    if now >= deadline:
      timed_out = True
      break
    if exited_at is None and proc.poll() is not None:
      exited_at = now
    if exited_at is not None and now - exited_at > 0.5:
      break  # the program exited but something (an escaped child, in 'none' mode) keeps the pipes open.
    for key, _ in sel.select(timeout=min(0.1, deadline - now)):
      try:
        chunk = os.read(key.fd, 65536)
      except BlockingIOError:
        continue
      if not chunk:
        sel.unregister(key.fd)
        open_fds.discard(key.fd)
        continue
      total += len(chunk)
      buf = bufs[key.fd]
      keep = 4 * limits.max_output_chars + 4  # enough bytes for max_output_chars UTF-8 characters, plus one
      if len(buf) < keep:
        buf += chunk[: keep - len(buf)]
    if limits.kill_output_bytes and total > limits.kill_output_bytes:
      over = True
      break
  sel.close()
  return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), timed_out, over


def _kill_tree(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)  # the sandbox is its own process group (start_new_session)
  except (ProcessLookupError, PermissionError):
    pass
  try:
    proc.kill()
  except ProcessLookupError:
    pass


def _decode(raw: bytes, limit: int) -> tuple[str, bool]:
  text = raw.decode("utf-8", errors="replace")
  if len(text) > limit:
    return text[:limit] + TRUNCATION_MARKER.format(n=limit), True
  return text, False


def run_python(
  code: str,
  timeout_s: float = 120.0,
  *,
  isolation: str = "auto",
  allow_unsandboxed: bool = False,
  wrap_last_expr: bool = True,
  limits: PythonLimits | None = None,
  **limit_overrides,
) -> PythonResult:
  """Runs `code` in a fresh sandboxed Python process and returns what happened.

  Args:
      code: the program (the content of a `<python>` block).
      timeout_s: wall-clock limit; on expiry the whole sandbox is killed and `timed_out` is set.
      isolation: 'auto' (bwrap, else unshare), 'bwrap', 'unshare' or 'none'.
      allow_unsandboxed: permit running without isolation when none works (a loud warning is logged).
      wrap_last_expr: print a final bare expression, like the official tool.
      limits / **limit_overrides: PythonLimits, or its fields as keywords (e.g. memory_mb=1024).
  """
  if not isinstance(code, str):
    raise TypeError(f"run_python(code=...) needs a str, got {type(code).__name__}")
  limits = dataclasses.replace(limits or PythonLimits(), timeout_s=timeout_s, **limit_overrides)
  mode = _isolation.resolve_isolation(isolation, allow_unsandboxed)
  source = wrap_last_expression(code) if wrap_last_expr else code
  uid = _isolation.UID_POOL.acquire() if mode != "none" and _isolation._is_root() else None
  nproc = limits.max_processes
  if nproc and uid is None and not _isolation._is_root():
    nproc += _count_user_processes(os.getuid())  # RLIMIT_NPROC counts all processes of our uid.
  if _isolation._is_root() and uid is None:
    nproc = 0  # root is exempt from RLIMIT_NPROC anyway ('none' mode as root).
  cpu_s = limits.cpu_s or int(limits.timeout_s) + 1
  argv = [
    str(cpu_s),
    str(limits.memory_mb << 20),
    str(nproc),
    str(limits.max_file_mb << 20),
    str(limits.max_open_files),
  ]
  cmd = _isolation.command_prefix(mode, uid, limits.tmpfs_mb << 20)
  cmd += [_isolation.python_executable(), "-I", "-c", _BOOT, *argv]
  workdir = tempfile.mkdtemp(prefix="aepo_py_") if mode == "none" else None
  env = dict(_isolation.SANDBOX_ENV, **({"HOME": workdir, "TMPDIR": workdir} if workdir else {}))
  start = time.monotonic()
  try:
    proc = subprocess.Popen(
      cmd,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      env=env,
      cwd=workdir,
      start_new_session=True,
      close_fds=True,
    )
    try:
      proc.stdin.write(source.encode("utf-8"))  # the boot code reads it all before running anything
      proc.stdin.close()
    except BrokenPipeError:
      pass
    out, err, timed_out, over = _collect(proc, limits, start + limits.timeout_s)
    _kill_tree(proc)  # also reaps anything left in 'none' mode; the namespaces are gone already otherwise.
    status = proc.wait()
  finally:
    if uid is not None:
      _isolation.UID_POOL.release(uid)
    if workdir is not None:
      shutil.rmtree(workdir, ignore_errors=True)
  wall_s = time.monotonic() - start
  stdout, t_out = _decode(out, limits.max_output_chars)
  stderr, t_err = _decode(err, limits.max_output_chars)
  if timed_out or over:
    status = -signal.SIGKILL
  elif mode != "none" and status > 128:
    status = -(status - 128)  # bwrap and sh (unshare) report a child killed by signal N as 128+N
  limit_hit, note = _classify(status, timed_out, over, stderr, wall_s, cpu_s, limits)
  return PythonResult(
    stdout=stdout,
    stderr=stderr + note,
    exit_code=status,
    timed_out=timed_out,
    limit_hit=limit_hit,
    truncated=t_out or t_err,
    isolation=mode,
    wall_s=wall_s,
  )


def _classify(
  status: int, timed_out: bool, over: bool, stderr: str, wall_s: float, cpu_s: int, limits: PythonLimits
) -> tuple[str | None, str]:
  """(limit_hit, note appended to stderr) for a finished run."""
  if timed_out:
    return "wall", f"\nTimeoutError: execution exceeded the {limits.timeout_s:g} s time limit and was killed."
  if over:
    return "output", (
      f"\nOutputLimitError: the program wrote more than {limits.kill_output_bytes} bytes and was killed."
    )
  if status in (-signal.SIGXCPU, -signal.SIGKILL) and wall_s >= cpu_s * 0.9:
    return "cpu", f"\nCPU time limit of {cpu_s} s exceeded ({_signal_name(-status)})."
  limit_hit = next((name for name, sign in _LIMIT_SIGNS if sign in stderr), None)
  return limit_hit, (f"\nProcess killed by {_signal_name(-status)}." if status < 0 else "")


class PythonTool:
  """The `python` tool for ToolSet: content -> PythonResult (its `.text` is what the model sees)."""

  tag = "python"

  def __init__(
    self,
    timeout_s: float = 120.0,
    isolation: str = "auto",
    allow_unsandboxed: bool = False,
    limits: PythonLimits | None = None,
    **limit_overrides,
  ):
    self.limits = dataclasses.replace(limits or PythonLimits(), timeout_s=timeout_s, **limit_overrides)
    # Resolve now so a host without isolation fails at start-up, not at the first tool call.
    self.isolation = _isolation.resolve_isolation(isolation, allow_unsandboxed)
    self.allow_unsandboxed = allow_unsandboxed

  def __call__(self, code: str) -> PythonResult:
    return run_python(
      code,
      self.limits.timeout_s,
      isolation=self.isolation,
      allow_unsandboxed=self.allow_unsandboxed,
      limits=self.limits,
    )


class PythonPool:
  """Bounds how many sandboxes run at once. `submit(code) -> Future[PythonResult]`."""

  def __init__(self, max_workers: int = 8, **run_kwargs):
    self._tool_kwargs = run_kwargs
    self._isolation = _isolation.resolve_isolation(
      run_kwargs.pop("isolation", "auto"), run_kwargs.get("allow_unsandboxed", False)
    )
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="python_tool")

  def submit(self, code: str, **overrides) -> "concurrent.futures.Future[PythonResult]":
    kwargs = dict(self._tool_kwargs, isolation=self._isolation, **overrides)
    return self._pool.submit(run_python, code, **kwargs)

  def map(self, codes: list[str], **overrides) -> list[PythonResult]:
    return [f.result() for f in [self.submit(c, **overrides) for c in codes]]

  def shutdown(self, wait: bool = True) -> None:
    self._pool.shutdown(wait=wait)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.shutdown()
