"""A run's persistent XLA compilation cache (`train.compile_cache`, `launch/evaluate.py --compile_cache`): the
programs a run compiles are written to a folder (local or gs://) and read back by its restart and its resume, and by
any run given the same folder, instead of compiled again. A hit is the executable a compile would give: JAX keys each
program by its HLO, the compile options (devices included), the XLA flags and the jax, jaxlib and libtpu versions.
On this CPU a run whose programs come from the cache logs the metrics of the run that wrote them, bit for bit
(tests/parallel/test_compile_cache.py with the tests' fast compile; the shortened cpu_default job below with full
optimisation).

'auto' (default) is `<workdir>/compile_cache` (`<output>/compile_cache` for an evaluation), so a preempted pod run
restarts without compiling again what it compiled before (aepo_gaia's update and decode, Qwen3-14B at full depth for
v5p:4x4x2, compiled in 34 s and 43 s on this 2-core host); `$JAX_COMPILATION_CACHE_DIR` where set, or
`JAX_ENABLE_COMPILATION_CACHE=false`, stands instead.
The run's folder takes every program (`jax_persistent_cache_min_compile_time_secs` 0 unless
$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise; JAX's default of 1 s kept 4 of the 107 programs of a
shortened cpu_default job). That job, run twice on this 2-core CPU (2026-12-08): 89 s, then 71 s reading all 107
programs back; 80 s with JAX's 1 s threshold.

On several hosts JAX writes entries from process 0 only (to spare shared storage the contention) and every host
reads: on a TPU slice a cache on storage all hosts see (a gs:// workdir, or one the hosts share) serves the programs
the hosts share (the update, the log-probs, the policy's copy onto the rollout devices; same slice topology and
device assignment, so the same key on every host) to all of them, and host 0's engine programs to host 0. Another
host's engine runs on its own devices, so those programs have keys of their own that nobody writes: such a host
compiles its engine again at a restart. (CPU processes standing in for hosts each hash their own CPU topology into
every key: there only process 0 reads anything back.)

The cache is trusted code: whoever can write to the folder can run code in the run (JAX's warning); keep it where the
checkpoints are, which the run trusts the same way.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional

log = logging.getLogger("aepo_jax.parallel")

CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
MIN_COMPILE_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
FOLDER = "compile_cache"

_stats = {"requests": 0, "hits": 0, "saved_s": 0.0}
_lock = threading.Lock()
_listening = [False]


class CompileCacheError(RuntimeError):
  """The cache folder cannot be made or written: the message names the setting and the way out."""


def compile_cache_folder(setting: str, workdir: str) -> Optional[str]:
  """The folder `setting` gives a run writing to `workdir`, or None where the run leaves JAX's own settings as they
  are ('' always; 'auto' where $JAX_COMPILATION_CACHE_DIR is set or JAX_ENABLE_COMPILATION_CACHE is false)."""
  setting = str(setting)
  if setting == "":
    return None
  if setting == "auto":
    if os.environ.get(CACHE_ENV) or os.environ.get("JAX_ENABLE_COMPILATION_CACHE", "").lower() in ("0", "false"):
      return None
    return os.path.join(str(workdir), FOLDER)  # gs://bucket/run too
  return setting


def use_compile_cache(setting: str, workdir: str, name: str = "train.compile_cache") -> Optional[str]:
  """Point JAX's persistent compilation cache at the folder `compile_cache_folder` gives (made if missing) and count
  its hits from here on (`compile_cache_stats`). Returns the folder JAX uses now, or None when there is none. `name`:
  the setting's name in an error (CompileCacheError)."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  _listen()
  folder = compile_cache_folder(setting, workdir)
  if folder is not None:
    try:
      from etils import epath

      epath.Path(folder).mkdir(parents=True, exist_ok=True)
    except Exception as e:  # noqa: BLE001  (any storage error: name the setting and the way out)
      raise CompileCacheError(
        f"{name}={setting!r}: cannot make the folder {folder!r} ({type(e).__name__}: {e}). Give a folder this "
        f"run can write, or {name}='' to compile every program at each start."
      ) from e
    if MIN_COMPILE_ENV not in os.environ:
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if jax.config.jax_compilation_cache_dir != folder:
      jax.config.update("jax_compilation_cache_dir", folder)
      compilation_cache.reset_cache()  # an earlier compile in this process may have settled on another folder
  current = jax.config.jax_compilation_cache_dir
  if current and jax.config.jax_enable_compilation_cache:
    log.info("compilation cache: %s (programs that compile in >= %.1f s)", current, _min_compile_s())
    return current
  return None


def compile_cache_stats() -> dict:
  """Programs looked up in the persistent cache, found there, and the compile seconds those hits saved by JAX's
  estimate (each entry's compile time in whole seconds, less the read: a run of sub-second compiles shows ~0), since
  `use_compile_cache` was first called in this process."""
  with _lock:
    return dict(_stats)


def _min_compile_s() -> float:
  import jax

  return float(jax.config.jax_persistent_cache_min_compile_time_secs)


def _listen() -> None:
  from jax import monitoring

  with _lock:
    if _listening[0]:
      return
    _listening[0] = True

  def on_event(event: str, **_) -> None:
    key = {
      "/jax/compilation_cache/compile_requests_use_cache": "requests",
      "/jax/compilation_cache/cache_hits": "hits",
    }.get(event)
    if key:
      with _lock:
        _stats[key] += 1

  def on_duration(event: str, duration: float, **_) -> None:
    if event == "/jax/compilation_cache/compile_time_saved_sec":
      with _lock:
        _stats["saved_s"] += max(0.0, float(duration))

  monitoring.register_event_listener(on_event)
  monitoring.register_event_duration_secs_listener(on_duration)
