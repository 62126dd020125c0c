"""How a sandboxed Python process is started: bubblewrap, `unshare`, or (only when asked) nothing.

bwrap:   new pid/net/ipc/uts (and, when not root, user) namespaces; the system dirs and the Python installation
         read-only; an empty tmpfs as /tmp and working dir; no /etc, /root, /home, /work or project files.
unshare: new pid/net/ipc/uts/mount namespaces; a tmpfs over /tmp and over the hidden dirs (project, cwd, /work,
         /home, /root, $HOME); the rest of the file system stays visible under normal permissions. Weaker.
none:    a plain child process with a scrubbed environment and rlimits. Needs allow_unsandboxed=True.

When the host runs as root, the sandboxed program is switched to its own unprivileged uid (one per concurrent
call, see _UidPool) so that RLIMIT_NPROC counts only its own processes and file permissions apply.
"""
import functools
import logging
import os
import shutil
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

ISOLATIONS = ("bwrap", "unshare", "none")
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")
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
    return os.path.realpath(sys.executable)


def _python_roots() -> list[str]:
    """Installation dirs the interpreter needs (base prefix, and the venv when there is one)."""
    roots = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    return sorted(r for r in roots if not any(r == d or r.startswith(d + "/") for d in ("/usr",)))


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


@functools.lru_cache(maxsize=1)
def _bwrap_version() -> tuple[int, ...]:
    try:
        out = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=10).stdout
        return tuple(int(x) for x in out.split()[-1].split("."))
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return (0,)


def _bwrap_prefix(uid: int | None, tmpfs_bytes: int) -> list[str]:
    cmd = ["bwrap", "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net", "--unshare-ipc",
           "--unshare-uts", "--unshare-cgroup-try"]
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
    for root in _python_roots():
        # Parents are created world-traversable; otherwise e.g. /root (0700) hides a pyenv interpreter.
        parents, p = [], os.path.dirname(root)
        while p != "/":
            parents.append(p)
            p = os.path.dirname(p)
        for p in reversed(parents):
            cmd += ["--perms", "0755", "--dir", p]
        cmd += ["--ro-bind", root, root]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777"]
    if _bwrap_version() >= (0, 8):  # --size arrived in bubblewrap 0.8; older ones rely on RLIMIT_FSIZE alone
        cmd += ["--size", str(tmpfs_bytes)]
    cmd += ["--tmpfs", "/tmp", "--chdir", "/tmp", "--"]
    if uid is not None:
        cmd += _drop_privileges(uid)
    return cmd


def _hidden_dirs() -> list[str]:
    candidates = [_project_root(), os.getcwd(), "/work", "/home", "/root", os.path.expanduser("~")]
    hidden = []
    for d in candidates:
        d = os.path.realpath(d)
        if os.path.isdir(d) and d not in ("/", "/usr", "/tmp") and d not in hidden:
            hidden.append(d)
    return hidden


def _unshare_prefix(uid: int | None, tmpfs_bytes: int) -> list[str]:
    cmd = ["unshare", "--fork", "--kill-child", "--pid", "--mount-proc", "--net", "--ipc", "--uts", "--mount"]
    if not _is_root():
        cmd += ["--user", "--map-root-user"]
    roots = _python_roots()
    steps = [f"mount -t tmpfs -o size={tmpfs_bytes},mode=1777 tmpfs /tmp"]
    # Stash the interpreter dirs, cover the hidden dirs with empty tmpfs, then put the interpreter back read-only
    # (a pyenv under /root must stay usable while the rest of /root disappears).
    for i, r in enumerate(roots):
        steps += [f"mkdir -p /tmp/.py{i}", f"mount --bind '{r}' /tmp/.py{i}"]
    steps += [f"mount -t tmpfs -o size=1m,mode=0755 tmpfs '{d}'" for d in _hidden_dirs()]
    for i, r in enumerate(roots):
        steps += [f"mkdir -p '{r}'", f"mount --bind /tmp/.py{i} '{r}'", f"mount -o remount,bind,ro '{r}'",
                  f"umount /tmp/.py{i}", f"rmdir /tmp/.py{i}"]
    # sh stays pid 1 of the namespace (no exec): a signal-killed program then reports 128+N like bwrap.
    script = " && ".join(steps) + ' && cd /tmp && "$@"'
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


def _works(isolation: str) -> bool:
    exe = shutil.which(isolation)
    if exe is None:
        return False
    uid = UID_POOL.acquire() if _is_root() else None
    try:
        cmd = command_prefix(isolation, uid, 1 << 20) + [python_executable(), "-I", "-c", "import socket"]
        run = subprocess.run(cmd, capture_output=True, timeout=30, env=SANDBOX_ENV, stdin=subprocess.DEVNULL)
        if run.returncode != 0:
            log.info("isolation %s does not work here: %s", isolation, run.stderr.decode(errors="replace")[-500:])
        return run.returncode == 0
    except (OSError, subprocess.TimeoutExpired) as e:
        log.info("isolation %s does not work here: %s", isolation, e)
        return False
    finally:
        if uid is not None:
            UID_POOL.release(uid)


@functools.lru_cache(maxsize=None)
def _probe(isolation: str) -> bool:
    return _works(isolation)


def resolve_isolation(isolation: str = "auto", allow_unsandboxed: bool = False) -> str:
    """Picks the isolation to use, checking once per process that it really starts a program.

    'auto' prefers bwrap, then unshare. If neither works, raises SandboxUnavailableError unless
    allow_unsandboxed=True, in which case it logs a loud warning and returns 'none'.
    """
    if isolation not in ISOLATIONS + ("auto",):
        raise ValueError(f"isolation={isolation!r}; expected one of {ISOLATIONS} or 'auto'")
    if isolation == "none":
        if not allow_unsandboxed:
            raise SandboxUnavailableError("isolation='none' runs model-written code unsandboxed; pass "
                                          "allow_unsandboxed=True if you really mean it")
        _warn_unsandboxed()
        return "none"
    wanted = ("bwrap", "unshare") if isolation == "auto" else (isolation,)
    for candidate in wanted:
        if _probe(candidate):
            return candidate
    if allow_unsandboxed:
        _warn_unsandboxed()
        return "none"
    raise SandboxUnavailableError(
        f"cannot isolate the Python tool on this host: {' and '.join(wanted)} failed to start a sandboxed "
        "process (install bubblewrap, e.g. `apt-get install bubblewrap`, and allow user namespaces). To run "
        "model-written code WITHOUT isolation anyway, pass allow_unsandboxed=True (config: "
        "tools.python.allow_unsandboxed).")


@functools.lru_cache(maxsize=1)
def _warn_unsandboxed() -> None:
    msg = ("!!! The Python tool runs model-written code WITHOUT a sandbox (allow_unsandboxed=True): it can read "
           "and write your files and reach the network. Use this only on a throwaway machine. !!!")
    log.warning(msg)
    print(msg, file=sys.stderr, flush=True)
