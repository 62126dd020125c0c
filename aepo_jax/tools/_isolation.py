"""How a sandboxed Python process is started: bubblewrap, `unshare`, or (only when asked) nothing.

bwrap:   new pid/net/ipc/uts (and, when not root, user) namespaces; the system dirs and the Python installation
         (the venv too) read-only at their own paths; an empty tmpfs as /tmp and working dir; its own /proc and
         /dev; a few /etc files; no /var, /run, /root, /home, /work or project files.
unshare: new pid/net/ipc/uts/mount namespaces; empty tmpfs over /tmp, /var/tmp, /run/lock, /dev/shm, /etc (a few
         files put back) and the hidden dirs (project, cwd, /work, /home, /root, $HOME); the Python installation put
         back read-only at its own path; the rest of the file system stays visible under normal permissions. Weaker.
none:    a plain child process with a scrubbed environment and rlimits. Needs allow_unsandboxed=True.

Both sandboxes work wherever the interpreter, its venv (symlinked or `--copies`) and the working directory live,
/tmp included: the interpreter dirs are mounted after the tmpfs that would hide them. When the host runs as root,
the sandboxed program is switched to its own unprivileged uid (one per concurrent call, see _UidPool) so that
RLIMIT_NPROC counts only its own processes and file permissions apply.
"""

import functools
import logging
import os
import shlex
import shutil
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

ISOLATIONS = ("bwrap", "unshare", "none")
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")
_PRIVATE_DIRS = ("/var/tmp", "/run/lock")  # world-writable host dirs the unshare sandbox replaces
_STASH = "/dev/shm"  # unshare: where the interpreter dirs wait while /tmp and the hidden dirs are covered
_FIX_UNSANDBOXED = (
  "or, to run model-written code WITHOUT isolation (a throwaway machine only), set the config "
  "switch tools.allow_unsandboxed=True (allow_unsandboxed=True in code)"
)
# Environment the program sees (nothing is inherited from the parent: secrets stay outside).
SANDBOX_ENV = {
  "PATH": "/usr/local/bin:/usr/bin:/bin",
  "HOME": "/tmp",
  "TMPDIR": "/tmp",
  "LANG": "C.UTF-8",
  "PYTHONDONTWRITEBYTECODE": "1",
  "PYTHONUNBUFFERED": "1",
  "PYTHONHASHSEED": "0",
  "MPLBACKEND": "Agg",
  "MPLCONFIGDIR": "/tmp",
  # One BLAS/OpenMP thread: thread pools reserve address space and count against RLIMIT_NPROC.
  "OMP_NUM_THREADS": "1",
  "OPENBLAS_NUM_THREADS": "1",
  "MKL_NUM_THREADS": "1",
}


class SandboxUnavailableError(RuntimeError):
  """Neither bubblewrap nor unshare can isolate a process on this host."""


def python_executable() -> str:
  """The interpreter the sandbox runs: this process's `sys.executable` with its directory resolved but its own
  name kept, so a venv's bin/python (often a symlink) still finds pyvenv.cfg and the venv's packages."""
  exe = sys.executable
  if not exe:
    raise SandboxUnavailableError("sys.executable is empty: cannot tell which interpreter to sandbox")
  return os.path.join(os.path.realpath(os.path.dirname(exe)), os.path.basename(exe))


def _under(path: str, root: str) -> bool:
  return path == root or path.startswith(root.rstrip("/") + "/")


def _outermost(paths) -> list[str]:
  """The paths not inside another one of them, sorted."""
  paths = sorted(set(paths))
  return [p for p in paths if not any(q != p and _under(p, q) for q in paths)]


def _python_roots() -> list[str]:
  """Installation dirs the interpreter needs at their real paths: the base installation and the venv (its
  pyvenv.cfg and packages), outside the system dirs that every sandbox shows anyway."""
  exe = python_executable()
  candidates = {
    sys.base_prefix,
    sys.base_exec_prefix,
    sys.prefix,
    sys.exec_prefix,
    os.path.dirname(os.path.dirname(exe)),
    os.path.dirname(os.path.realpath(exe)),
  }
  roots = {os.path.realpath(p) for p in candidates if p}
  return _outermost(
    r for r in roots if r not in ("/", "/tmp") and not any(_under(r, d) for d in _SYSTEM_DIRS + ("/proc", "/dev"))
  )


def _project_root() -> str:
  return os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


def _is_root() -> bool:
  return os.geteuid() == 0


class _UidPool:
  """Hands out distinct unprivileged uids to concurrent sandboxes when the host runs as root."""

  def __init__(self, base: int = 61000, size: int = 1024):
    self._base, self._size, self._used, self._lock = base, size, set(), threading.Lock()

  def acquire(self) -> int:
    with self._lock:
      for uid in range(self._base, self._base + self._size):
        if uid not in self._used:
          self._used.add(uid)
          return uid
    raise RuntimeError(f"more than {self._size} concurrent sandboxes; lower the pool size")

  def release(self, uid: int) -> None:
    with self._lock:
      self._used.discard(uid)


UID_POOL = _UidPool()


def _drop_privileges(uid: int) -> list[str]:
  return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"]


def _tool_path(name: str) -> str | None:
  """Where `bwrap` / `unshare` is on this process's PATH (the sandbox's own PATH is fixed)."""
  return shutil.which(name)


@functools.lru_cache(maxsize=4)
def _bwrap_version(exe: str) -> tuple[int, ...]:
  try:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
    return tuple(int(x) for x in out.split()[-1].split("."))
  except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
    return (0,)


def scratch_sizes(tmpfs_bytes: int) -> dict[str, int]:
  """Bytes of each writable scratch tmpfs of one call. Their pages are host memory outside the call's memory
  limit, so together they hold `tmpfs_bytes` (the call's tmpfs_mb), not that much each: /tmp three quarters,
  /dev/shm an eighth, /var/tmp and /run/lock a sixteenth each (a page at least: a tmpfs of size 0 is unbounded)."""
  page = 4096
  small = max(tmpfs_bytes // 16 // page * page, page)
  shm = max(tmpfs_bytes // 8 // page * page, page)
  return {
    "/tmp": max(tmpfs_bytes - shm - 2 * small, page),
    _STASH: shm,
    "/var/tmp": small,
    "/run/lock": small,
  }


def _bwrap_prefix(uid: int | None, tmpfs_bytes: int) -> list[str]:
  exe = _tool_path("bwrap") or "bwrap"
  cmd = [
    exe,
    "--die-with-parent",
    "--new-session",
    "--unshare-pid",
    "--unshare-net",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-cgroup-try",
  ]
  if not _is_root():
    cmd.append("--unshare-user")  # unprivileged bwrap needs a user namespace to mount anything.
  for d in _SYSTEM_DIRS:
    if os.path.islink(d):
      cmd += ["--symlink", os.readlink(d), d]
    elif os.path.isdir(d):
      cmd += ["--ro-bind", d, d]
  cmd += ["--perms", "0755", "--dir", "/etc"]
  for f in _ETC_FILES:
    cmd += ["--ro-bind-try", f, f]
  cmd += ["--proc", "/proc", "--dev", "/dev"]
  sizes, sized = scratch_sizes(tmpfs_bytes), _bwrap_version(exe) >= (0, 8)
  if sized:  # --size arrived in bubblewrap 0.8; older ones rely on RLIMIT_FSIZE alone
    cmd += ["--perms", "1777", "--size", str(sizes[_STASH]), "--tmpfs", _STASH]  # /dev/shm: not --dev's tmpfs
    cmd += ["--size", str(sizes["/tmp"])]
  cmd += ["--perms", "1777", "--tmpfs", "/tmp"]
  # The interpreter after /tmp: a venv under /tmp must sit on top of the new tmpfs, not under it.
  made = {"/", "/tmp"}
  for root in _python_roots():
    # Parents are created world-traversable; otherwise e.g. /root (0700) hides a pyenv interpreter.
    parents, p = [], os.path.dirname(root)
    while p not in made:
      parents.append(p)
      made.add(p)
      p = os.path.dirname(p)
    for p in reversed(parents):
      cmd += ["--perms", "0755", "--dir", p]
    cmd += ["--ro-bind", root, root]
  cmd += ["--chdir", "/tmp", "--"]
  if uid is not None:
    cmd += _drop_privileges(uid)
  return cmd


def _hidden_dirs() -> list[str]:
  """Host dirs the unshare sandbox covers with an empty tmpfs (those under /tmp vanish with /tmp itself)."""
  candidates = [_project_root(), os.getcwd(), "/work", "/home", "/root", os.path.expanduser("~")]
  real = {os.path.realpath(d) for d in candidates if os.path.isdir(d)}
  return _outermost(
    d
    for d in real
    if d not in ("/", "/usr", "/tmp", "/etc")
    and not _under(d, "/tmp")
    and not any(_under(d, s) for s in _SYSTEM_DIRS + ("/proc", "/dev"))
  )


def _unshare_script(tmpfs_bytes: int) -> str:
  """The mount steps run as root of the new mount namespace, before the program starts.

  1. stash: bind the interpreter dirs and the kept /etc files into a private tmpfs at /dev/shm;
  2. cover: empty tmpfs over /tmp, /var/tmp, /run/lock, the hidden dirs and /etc;
  3. restore: bind the stash back at the original paths (read-only), then replace the stash by an empty /dev/shm.
  """
  q = shlex.quote
  roots = _python_roots()
  etc = [(f, os.path.realpath(f)) for f in _ETC_FILES if os.path.exists(f)]
  steps = [f"mount -t tmpfs -o size=1m,mode=0700 tmpfs {_STASH}"]
  for i, r in enumerate(roots):
    steps += [f"mkdir {_STASH}/py{i}", f"mount --bind {q(r)} {_STASH}/py{i}"]
  for i, (_, src) in enumerate(etc):
    steps += [f"{'mkdir' if os.path.isdir(src) else 'touch'} {_STASH}/etc{i}", f"mount --bind {q(src)} {_STASH}/etc{i}"]
  sizes = scratch_sizes(tmpfs_bytes)  # the scratch mounts together hold tmpfs_bytes
  steps.append(f"mount -t tmpfs -o size={sizes['/tmp']},mode=1777 tmpfs /tmp")
  size_of = {os.path.realpath(d): sizes[d] for d in _PRIVATE_DIRS if os.path.isdir(d)}
  private = _outermost(size_of)
  steps += [
    f"mount -t tmpfs -o size={size_of.get(d, sizes['/run/lock'])},mode=1777 tmpfs {q(d)}"
    for d in private
    if d != "/tmp"
  ]
  steps += [f"mount -t tmpfs -o size=1m,mode=0755 tmpfs {q(d)}" for d in _hidden_dirs() + ["/etc"]]
  for i, (dst, src) in enumerate(etc):
    steps += [
      f"{'mkdir' if os.path.isdir(src) else 'touch'} {q(dst)}",
      f"mount --bind {_STASH}/etc{i} {q(dst)}",
      f"mount -o remount,bind,ro {q(dst)}",
      f"umount {_STASH}/etc{i}",
    ]
  for i, r in enumerate(roots):
    steps += [
      f"mkdir -p {q(r)}",
      f"mount --bind {_STASH}/py{i} {q(r)}",
      f"mount -o remount,bind,ro {q(r)}",
      f"umount {_STASH}/py{i}",
    ]
  steps += [f"umount {_STASH}", f"mount -t tmpfs -o size={sizes[_STASH]},mode=1777 tmpfs {_STASH}"]
  return " && ".join(steps)


def _unshare_prefix(uid: int | None, tmpfs_bytes: int) -> list[str]:
  exe = _tool_path("unshare") or "unshare"
  cmd = [exe, "--fork", "--kill-child", "--pid", "--mount-proc", "--net", "--ipc", "--uts", "--mount"]
  if not _is_root():
    cmd += ["--user", "--map-root-user"]
  # sh stays pid 1 of the namespace (no exec): a signal-killed program then reports 128+N like bwrap.
  script = _unshare_script(tmpfs_bytes) + ' && cd /tmp && "$@"'
  cmd += ["--", "/bin/sh", "-c", script, "sandbox"]
  if uid is not None:
    cmd += _drop_privileges(uid)
  return cmd


def command_prefix(isolation: str, uid: int | None, tmpfs_bytes: int) -> list[str]:
  """argv that precedes `python ...` for the given isolation."""
  if isolation == "bwrap":
    return _bwrap_prefix(uid, tmpfs_bytes)
  if isolation == "unshare":
    return _unshare_prefix(uid, tmpfs_bytes)
  if isolation == "none":
    return []
  raise ValueError(f"isolation={isolation!r}; expected one of {ISOLATIONS} or 'auto'")


# What bwrap and unshare print when the kernel or the container refuses new namespaces.
_NAMESPACE_SIGNS = (
  "No permissions to creat",
  "setting up uid map",
  "Creating new namespace failed",
  "unshare failed",
  "Failed to make / slave",
  "cannot open /proc/self/uid_map",
)
_PROBE = "import os, socket, sys\nprint(os.path.realpath(sys.prefix))"


def _diagnose(isolation: str, returncode: int, stderr: str) -> str:
  lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
  last = lines[-1][:300] if lines else f"exit status {returncode}, no error message"
  if any(sign in stderr for sign in _NAMESPACE_SIGNS):
    return (
      f"{isolation} could not create namespaces ({last}): the kernel or the container forbids them "
      "(Docker: run with --security-opt seccomp=unconfined or --privileged; Ubuntu 24.04: sysctl "
      "kernel.apparmor_restrict_unprivileged_userns=0; older kernels: sysctl "
      "kernel.unprivileged_userns_clone=1)"
    )
  return f"{isolation} failed to start {python_executable()} in the sandbox: {last}"


def _works(isolation: str) -> tuple[bool, str]:
  """(True, '') when `isolation` starts this interpreter, with its venv, in a sandbox; else (False, why)."""
  exe = _tool_path(isolation)
  if exe is None:
    if isolation == "bwrap":
      return False, "bubblewrap is not installed (no `bwrap` on PATH; `apt-get install bubblewrap`)"
    return False, "`unshare` (util-linux) is not on PATH"
  uid = UID_POOL.acquire() if _is_root() else None
  try:
    cmd = command_prefix(isolation, uid, 1 << 20) + [python_executable(), "-I", "-c", _PROBE]
    run = subprocess.run(cmd, capture_output=True, timeout=30, env=SANDBOX_ENV, stdin=subprocess.DEVNULL)
  except subprocess.TimeoutExpired:
    return False, f"{isolation} did not start a sandboxed interpreter within 30 s"
  except OSError as e:
    return False, f"{isolation} could not be run: {e}"
  finally:
    if uid is not None:
      UID_POOL.release(uid)
  if run.returncode != 0:
    return False, _diagnose(isolation, run.returncode, run.stderr.decode(errors="replace"))
  seen, want = run.stdout.decode(errors="replace").strip(), os.path.realpath(sys.prefix)
  if seen != want:  # the interpreter started, but without its venv: the program would miss its packages
    return False, (f"{isolation} started {python_executable()} but it found sys.prefix={seen!r}, not the venv {want!r}")
  return True, ""


@functools.lru_cache(maxsize=None)
def _probe_at(isolation: str, exe: str | None, python: str) -> tuple[bool, str]:
  ok, why = _works(isolation)
  if not ok:
    log.info("isolation %s does not work here: %s", isolation, why)
  return ok, why


def _probe_result(isolation: str) -> tuple[bool, str]:
  """Checked once per process for each (isolation, its binary, the interpreter)."""
  return _probe_at(isolation, _tool_path(isolation), python_executable())


def check_sandbox(allow_unsandboxed: bool = False, isolation: str = "auto") -> str:
  """The isolation the Python tool uses on this host: 'bwrap', 'unshare', or 'none' (only when allowed).

  Starts one sandboxed interpreter per candidate (about a second, once per process), so a trainer can call it
  at start-up, before any compute. When nothing works and `allow_unsandboxed` is False it raises
  SandboxUnavailableError: one paragraph naming what failed and the fix (install bubblewrap, allow namespaces,
  or the config switch tools.allow_unsandboxed=True).
  """
  return resolve_isolation(isolation, allow_unsandboxed)


def resolve_isolation(isolation: str = "auto", allow_unsandboxed: bool = False) -> str:
  """Picks the isolation to use, checking once per process that it really starts a program.

  'auto' prefers bwrap, then unshare. If neither works, raises SandboxUnavailableError unless
  allow_unsandboxed=True, in which case it logs a loud warning and returns 'none'.
  """
  if isolation not in ISOLATIONS + ("auto",):
    raise ValueError(f"isolation={isolation!r}; expected one of {ISOLATIONS} or 'auto'")
  if isolation == "none":
    if not allow_unsandboxed:
      raise SandboxUnavailableError(
        "isolation='none' runs model-written code unsandboxed; pass "
        "allow_unsandboxed=True (config tools.allow_unsandboxed=True) if you "
        "really mean it"
      )
    _warn_unsandboxed()
    return "none"
  wanted = ("bwrap", "unshare") if isolation == "auto" else (isolation,)
  reasons = []
  for candidate in wanted:
    ok, why = _probe_result(candidate)
    if ok:
      return candidate
    reasons.append(why)
  if allow_unsandboxed:
    _warn_unsandboxed()
    return "none"
  raise SandboxUnavailableError(
    f"cannot sandbox the Python tool on this host: {'; '.join(reasons)}. Fix: {_fix(reasons)}, {_FIX_UNSANDBOXED}."
  )


def _fix(reasons: list[str]) -> str:
  fixes = []
  if any("apt-get install bubblewrap" in r for r in reasons):
    fixes.append("install bubblewrap (`apt-get install bubblewrap`)")
  if any("could not create namespaces" in r for r in reasons):
    fixes.append("allow user namespaces as said above")
  if not fixes:
    fixes.append(
      "install bubblewrap (`apt-get install bubblewrap`) if it is missing, and report the error above if it is not"
    )
  return " and ".join(fixes)


@functools.lru_cache(maxsize=1)
def _warn_unsandboxed() -> None:
  msg = (
    "!!! The Python tool runs model-written code WITHOUT a sandbox (allow_unsandboxed=True): it can read "
    "and write your files and reach the network. Use this only on a throwaway machine. !!!"
  )
  log.warning(msg)
  print(msg, file=sys.stderr, flush=True)
