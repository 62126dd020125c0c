"""Several processes at once, the way the multi-process tests stand CPU processes in for the hosts of a pod."""

from __future__ import annotations

import socket
import subprocess
from typing import Optional, Sequence


def free_port() -> int:
  """A free TCP port on loopback (for `jax.distributed`'s coordinator)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(
  cmds: Sequence[Sequence[str]],
  *,
  timeout: float,
  env: Optional[dict] = None,
  cwd: Optional[str] = None,
  merge_stderr: bool = True,
  check: bool = True,
) -> list:
  """Starts every command at once (they wait for each other in collectives), waits for all of them, and kills any
  left running (a timeout or another's failure must not leave a process behind). Returns (returncode, stdout,
  stderr) per command, stderr None with `merge_stderr`; `check`: assert each exited 0, naming it with its output's
  tail."""
  procs = [
    subprocess.Popen(
      list(cmd),
      cwd=cwd,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
      text=True,
    )
    for cmd in cmds
  ]
  try:
    outs = [p.communicate(timeout=timeout) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  results = [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
  if check:
    for i, (code, out, err) in enumerate(results):
      assert code == 0, f"process {i} exited {code}:\n{(err or out or '')[-5000:]}"
  return results
