"""Checkpoints: an Orbax `CheckpointManager` behind one small class, local or gs:// paths.

A checkpoint holds two items: `state` (params, optimizer state, step, RNG key data; arrays through
tensorstore) and `meta` (JSON: data-iterator state, metrics of record, the config, the phase). Orbax writes
into a temporary directory and commits by rename (local) or a commit marker (gs://), so a checkpoint killed
mid-save is never returned by `latest_step()`.

Integrity (`_checkpoint_integrity.py`): a save records a checksum of every array (in `meta`) and the size and hash
of every file (`integrity.json`); a restore checks both, and that every value is finite, and raises
`CheckpointCorruptError` naming the damaged files or arrays. `restore_newest_intact` then moves a damaged step aside
(`<step>.damaged`) and resumes from the newest intact one, which `keep` never deletes while this run lasts.

  ckpt = Checkpointer(workdir + "/checkpoints/rl", keep=3, best_metric="eval/accuracy")
  step, state, meta = ckpt.restore_newest_intact(abstract_state, config)  # (None, None, {}) without checkpoints
  state, meta = ckpt.restore(step, abstract_state, config)   # one step; checks the model section of the config
  ckpt.save(step, state, meta, metrics={...}, force=True)
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import gc
import json
import logging
import os
import re
import shutil
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from aepo_jax import parallel
from aepo_jax.train import _checkpoint_integrity as integrity
from aepo_jax.train import _config

log = logging.getLogger("aepo_jax.train")

_MIN_FREE_BYTES = 64 << 20  # refuse to start with less free space than this in the work directory
_PROBE_TIMEOUT_S = 5.0  # gcsfs retries an unreachable service for 60-90 s before it fails
# After a failed async save, Orbax's signalling threads wait (300 s each, non-daemon) for a step that will never
# come; the interpreter's exit waits for them. A failed save therefore bounds the exit: this long after the
# interpreter starts shutting down, the process ends with status 1.
_EXIT_GRACE_S = 15.0


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be written or read as asked; the message says which and why."""


class CheckpointCorruptError(CheckpointError):
  """A checkpoint whose files or values differ from what was saved, hold NaN/inf, or cannot be read.
  `step` is the damaged step, `problems` names its files or arrays."""

  def __init__(self, message: str, step: Optional[int] = None, problems: tuple = ()):
    super().__init__(message)
    self.step, self.problems = step, list(problems)


def is_remote(path: str) -> bool:
  return str(path).startswith("gs://")


def _no_answer(url: str, timeout_s: float) -> Optional[str]:
  """Why `url` gives no HTTP answer within `timeout_s` (whole call, DNS included), or None if it answers.

  One deadline, one message: a socket time-out and the join's deadline both read "no answer within N s", whichever
  fires first; other failures (refused, unknown host) say what they are.
  """
  result = {}

  def probe():
    try:
      urllib.request.urlopen(url, timeout=timeout_s).close()
    except urllib.error.HTTPError:  # any status: the service is there
      pass
    except Exception as e:  # noqa: BLE001 - reported as the reason
      reason = getattr(e, "reason", e)
      timed_out = isinstance(reason, (socket.timeout, TimeoutError)) or isinstance(e, (socket.timeout, TimeoutError))
      result["error"] = None if timed_out else str(reason)
      result["timed_out"] = timed_out

  thread = threading.Thread(target=probe, daemon=True)
  thread.start()
  thread.join(timeout_s)
  if thread.is_alive() or result.get("timed_out"):
    return f"no answer within {timeout_s:g} s"
  return result.get("error")


def check_remote(path: str, timeout_s: float = _PROBE_TIMEOUT_S) -> None:
  """Fail in seconds, naming the settings, when the storage service behind a gs:// path cannot be reached."""
  emulator, ts_url = os.environ.get("STORAGE_EMULATOR_HOST"), os.environ.get("TENSORSTORE_GCS_HTTP_URL")
  if emulator and not ts_url:  # tensorstore would try the real service and hang
    raise CheckpointError(
      f"{path}: STORAGE_EMULATOR_HOST={emulator} is set but TENSORSTORE_GCS_HTTP_URL is not, so "
      "array data would go to the real service; set TENSORSTORE_GCS_HTTP_URL to the emulator too."
    )
  urls = [u if "://" in u else f"http://{u}" for u in (emulator or "https://storage.googleapis.com", ts_url) if u]
  for url in dict.fromkeys(urls):
    reason = _no_answer(url, timeout_s)
    if reason:
      raise CheckpointError(
        f"{path}: the storage service at {url} does not answer ({reason}). Check the network and any proxy "
        "(HTTPS_PROXY); an emulator needs STORAGE_EMULATOR_HOST and TENSORSTORE_GCS_HTTP_URL; credentials come "
        "from GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default login` or the VM's service "
        "account. Or use a local path."
      )


def check_writable(workdir: str, need_bytes: int = _MIN_FREE_BYTES) -> None:
  """Fail at start-up, not at the first save, on a read-only, missing, full or unreachable work directory."""
  if is_remote(workdir):
    check_remote(workdir)
  path = epath.Path(workdir)
  probe = path / f".write_probe_{uuid.uuid4().hex[:8]}"
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe.write_bytes(b"\0" * 4096)
    probe.unlink()
  except OSError as e:
    reason = {
      errno.EROFS: "the file system is read-only",
      errno.EACCES: "permission denied",
      errno.ENOSPC: "the disk is full",
      errno.EDQUOT: "the disk quota is exhausted",
    }.get(e.errno, str(e))
    raise CheckpointError(
      f"work directory {workdir!r} is not writable ({reason}); choose another "
      "--config.workdir or free/mount it read-write."
    ) from e
  if not is_remote(workdir):
    free = shutil.disk_usage(os.fspath(path)).free
    if free < need_bytes:
      raise CheckpointError(
        f"work directory {workdir!r} has {free / 2**20:.1f} MiB free but a checkpoint needs about "
        f"{need_bytes / 2**20:.1f} MiB; free space or choose another --config.workdir."
      )


def save_failure(directory: str, step: int, e: BaseException, intact: Optional[int] = None) -> str:
  """One line: which step's save failed, where, why, and what to do (permission, disk full, other)."""
  text = _first_line(e)
  code, path, x = None, directory, e
  for _ in range(8):  # the OSError in the chain, if any, has the errno and the path
    if x is None:
      break
    if isinstance(x, OSError):
      code, path = x.errno, x.filename or directory
      break
    x = x.__cause__ or x.__context__
  if code in (errno.EACCES, errno.EPERM, errno.EROFS) or "Permission denied" in text or "Read-only" in text:
    why, fix = f"permission denied on {path}", f"make {directory} writable (or choose another --config.workdir)"
  elif code in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text or "RESOURCE_EXHAUSTED" in text:
    why, fix = f"the disk holding {directory} is full", "free space there (or choose another --config.workdir)"
  else:
    why, fix = text, f"check {directory} (or choose another --config.workdir)"
  if intact is None:
    kept = "no checkpoint was committed before it, so a rerun starts afresh"
  else:
    kept = f"the newest committed checkpoint (step {intact}) is untouched and a rerun resumes from it"
  return f"saving step {step} to {directory!r} failed: {why} ({text}). {fix}; {kept}."


_exit_bounded = False


def bound_exit(grace_s: float = _EXIT_GRACE_S) -> None:
  """Make the interpreter's exit end within `grace_s` even if non-daemon threads (Orbax's, after a failed save)
  never finish: a daemon watchdog, started as the exit begins (before threads are joined), ends the process with
  status 1. A process that exits sooner never sees it."""
  global _exit_bounded
  if _exit_bounded:
    return
  _exit_bounded = True

  def watchdog():
    time.sleep(grace_s)
    try:
      sys.stderr.write(f"(checkpoint save threads still waiting {grace_s:g} s after exit; ending the process)\n")
      sys.stdout.flush()
      sys.stderr.flush()
    finally:
      os._exit(1)

  def arm():
    threading.Thread(target=watchdog, name="aepo_jax-exit-watchdog", daemon=True).start()

  register = getattr(threading, "_register_atexit", None)  # CPython: runs before non-daemon threads are joined
  try:
    register(arm)
  except Exception:  # noqa: BLE001 - no hook before the joins: start the watchdog's clock now
    arm()


def tree_bytes(tree) -> int:
  return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def encode_iterator_state(state) -> Any:
  """Grain iterator state as JSON: MapDataset iterators give dicts, DataLoader iterators give bytes."""
  if isinstance(state, bytes):
    return {"__bytes__": base64.b64encode(state).decode("ascii")}
  return state


def decode_iterator_state(state) -> Any:
  if isinstance(state, dict) and set(state) == {"__bytes__"}:
    return base64.b64decode(state["__bytes__"])
  return state


def model_config_to_json(model_cfg) -> dict:
  return dataclasses.asdict(model_cfg)


def model_config_from_json(d: dict):
  """The ModelConfig saved in a checkpoint's meta (lists back to the tuples the frozen dataclass hashes)."""
  from aepo_jax.model import ModelConfig

  d = dict(d)
  d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
  if d.get("rope_scaling"):
    d["rope_scaling"] = tuple(tuple(kv) for kv in d["rope_scaling"])
  return ModelConfig(**d)


def model_mismatch(saved_config, config) -> list[str]:
  """`model.*` fields that differ between a checkpoint's config and the current one (dtype changes are allowed)."""

  def flat(c):
    d = dict(_config._flatten(c.model, "model."))
    d.update({f"model.overrides.{k}": v for k, v in dict(c.model.overrides).items()})
    d.pop("model.overrides", None)
    for k in (
      "model.dtype",
      "model.remat",
      "model.tokenizer",
      "model.init",
      "model.overrides.attention_impl",
      "model.overrides.splash_block_q",
      "model.overrides.splash_block_kv",
      "model.overrides.scan_unroll",
    ):
      d.pop(k, None)  # these do not change parameter shapes
    return d

  canon = lambda d: {k: json.loads(json.dumps(v, default=str)) for k, v in d.items()}  # tuples == lists
  a, b = canon(flat(saved_config)), canon(flat(config))
  return [
    f"{k}: checkpoint={a.get(k, '<unset>')!r} current={b.get(k, '<unset>')!r}"
    for k in sorted(set(a) | set(b))
    if a.get(k) != b.get(k)
  ]


def _pytree_restore(target, partial: bool = False):
  """Restore args for the "state" item (also reads checkpoints written with StandardSave): arrays as `target`'s
  abstract arrays (shape, dtype, sharding); `partial` reads only the subtree `target` names."""
  return ocp.args.PyTreeRestore(
    target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=partial
  )


class _Pinned:
  """Preservation policy: keep `steps` (the newest verified checkpoint) whatever keep-last-N says."""

  def __init__(self):
    self.steps: set = set()

  def should_preserve(self, checkpoints, *, context=None):
    return [c.step in self.steps for c in checkpoints]


class Checkpointer:
  """Keep-last-N plus best-by-metric, async saves, verified restores; one directory per training phase."""

  def __init__(
    self,
    directory: str,
    *,
    keep: int = 3,
    best_metric: str = "",
    best_mode: str = "max",
    async_save: bool = True,
    ocdbt: bool = True,
    compression: bool = True,
    read_only: bool = False,
  ):
    """compression: zstd-compress the arrays (Orbax's default; ~20% smaller for float32 weights, but several
    CPU-seconds per GB that an async save takes from training on a small machine).

    read_only: a reader (export, evaluation, serving): creates, cleans and deletes nothing in `directory`, so a
    trainer's save in flight there (`<step>.orbax-checkpoint-tmp-*`) survives; `save` is refused."""
    self.directory = str(directory).rstrip("/")
    self.best_metric = best_metric
    self._best_mode = best_mode
    self._read_only = read_only
    async_save = async_save and not read_only
    self._async = async_save
    self._saving: Optional[int] = None  # the step whose async save is in flight
    self._pending: Optional[int] = None  # the step whose async save has not been seen to finish
    self._pinned = _Pinned()
    if is_remote(self.directory):
      check_remote(self.directory)
    policies = [ocp.checkpoint_managers.LatestN(n=keep), self._pinned]
    if best_metric:
      policies.append(
        ocp.checkpoint_managers.BestN(
          get_metric_fn=lambda m: float(m[best_metric]),
          reverse=best_mode == "min",
          n=1,
          keep_checkpoints_without_metrics=False,
        )
      )
    options = ocp.CheckpointManagerOptions(
      preservation_policy=None if read_only else ocp.checkpoint_managers.AnyPreservationPolicy(policies),
      enable_async_checkpointing=async_save,
      create=not read_only,
      cleanup_tmp_directories=not read_only,
      read_only=read_only,
      # best_fn also makes Orbax write each step's metrics to disk, so the best survives a restart.
      best_fn=(lambda m: float(m[best_metric])) if best_metric else None,
      best_mode=best_mode,
      keep_checkpoints_without_metrics=True,
      # The file manifest is written in the save's background thread, after the data and before the commit.
      async_options=ocp.AsyncOptions(post_finalization_callback=self._manifest_before_commit) if async_save else None,
    )
    try:
      self._mgr = ocp.CheckpointManager(
        epath.Path(self.directory),
        options=options,
        item_handlers={
          "state": ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_compression=compression),
          "meta": ocp.JsonCheckpointHandler(),
        },
      )
    except OSError as e:
      raise CheckpointError(f"cannot open checkpoint directory {self.directory!r}: {e}") from e

  # -- queries ------------------------------------------------------------------------------------------
  def _refresh(self):
    """Re-read the step list; on gs:// drop gcsfs's listing cache first, or steps written by another
    process (a restarted trainer, an evaluator's poll) stay invisible to this one."""
    if is_remote(self.directory):
      from etils.epath import backend  # the fsspec instance epath (hence Orbax) lists through

      backend.fsspec_backend.fs(self.directory).invalidate_cache()
    self._mgr.reload()

  def latest_step(self) -> Optional[int]:
    """The newest *committed* checkpoint (tmp dirs of interrupted saves are ignored by Orbax)."""
    self._refresh()
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    self._refresh()
    return list(self._mgr.all_steps())

  def best_step(self) -> Optional[int]:
    """The kept step with the best `best_metric` (None without a metric or before any evaluation)."""
    if not self.best_metric:
      return None
    scored = [
      (m[self.best_metric], s) for s in self.all_steps() if (m := self._mgr.metrics(s)) and self.best_metric in m
    ]
    if not scored:
      return None
    return (max(scored) if self._best_mode == "max" else min(scored))[1]

  # -- save ---------------------------------------------------------------------------------------------
  def save(self, step: int, state, meta: dict, *, metrics: Optional[dict] = None, force: bool = False) -> bool:
    """Save (asynchronously when enabled) `state` (a pytree of arrays) and `meta` (JSON-serialisable).

    `metrics` feed the best-checkpoint policy; a checkpoint saved without the best metric is kept only as
    one of the last N. Records the arrays' checksums in meta and the files' sizes and hashes beside them.
    """
    if self._read_only:
      raise CheckpointError(f"{self.directory!r} was opened read-only (a reader); it cannot save step {step}.")
    state = jax.tree.map(_no_numpy_scalar, state)  # orbax rejects numpy scalar leaves (np.int32(3))
    sums = integrity.array_checksums(state)
    nonfinite = [k for k, v in sums.items() if v["nonfinite"]]
    if nonfinite:
      log.warning(
        "step %d: saving non-finite values in %s; restoring it will treat this checkpoint as damaged.",
        step,
        ", ".join(nonfinite[:5]),
      )
    meta = json.loads(json.dumps(meta, default=_json_default))
    meta["integrity"] = {"version": 1, "arrays": sums}
    if metrics is not None and self.best_metric and self.best_metric not in metrics:
      metrics = None
    self.wait()  # the previous save's commit thread still reads `_saving`; its failure names its own step
    self._saving = int(step)
    try:
      saved = self._mgr.save(
        int(step),
        args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
        metrics={k: float(v) for k, v in metrics.items()} if metrics else None,
        force=force,
      )
    except Exception as e:  # noqa: BLE001 - OSError, or tensorstore's RESOURCE_EXHAUSTED as a ValueError
      raise self._save_failed(int(step), e) from e
    if saved and self._async:
      self._pending = int(step)
    if saved and not self._async and jax.process_index() == 0:  # committed: a kill before this costs the manifest
      self._write_manifest(self._step_dir(step))
    return saved

  def _step_dir(self, step: int) -> str:
    return f"{self.directory}/{step}"

  def _manifest_before_commit(self):
    """Runs in Orbax's save thread once every process has written its data, before the commit."""
    if self._saving is None or jax.process_index() != 0:
      return
    base = epath.Path(self.directory)
    tmp = sorted(base.glob(f"{self._saving}.orbax-checkpoint-tmp*"))  # local; gs:// commits in place
    self._write_manifest(str(tmp[-1]) if tmp else self._step_dir(self._saving))

  def _write_manifest(self, step_dir: str):
    try:
      integrity.write_manifest(step_dir)
    except Exception as e:  # noqa: BLE001 - the array checksums still guard this checkpoint
      log.warning(
        "%s: no %s written (%s); its restore checks the array checksums only.", step_dir, integrity.MANIFEST, e
      )

  # -- restore ------------------------------------------------------------------------------------------
  def _corrupt(self, step: int, problems: list[str]) -> CheckpointCorruptError:
    more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
    return CheckpointCorruptError(
      f"checkpoint {self._step_dir(step)} is damaged: {'; '.join(problems[:6])}{more}.", step, tuple(problems)
    )

  def _verified_meta(self, step: Optional[int], check_files: bool = True):
    """(step, meta, recorded array checksums or None) after checking the step's files; raises on damage."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"no committed checkpoint in {self.directory!r}.")
    if is_remote(self.directory):
      self._refresh()
    problems = integrity.file_problems(self._step_dir(step)) if check_files else []
    if problems:
      raise self._corrupt(step, problems)
    try:
      meta = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001 - any failure to read the JSON is damage
      raise self._corrupt(step, [f"meta/ cannot be read ({_first_line(e)})"]) from e
    if not isinstance(meta, dict):
      raise self._corrupt(step, ["meta/ holds no JSON object"])
    recorded = (meta.pop("integrity", None) or {}).get("arrays")
    return step, meta, recorded

  def _read_state(self, step: int, target, recorded, partial: bool):
    """The arrays of `step` as `target` (abstract), checked against their checksums and for NaN/inf."""
    if recorded is not None:
      diff = integrity.structure_problems(recorded, target, partial=partial)
      if diff:
        raise CheckpointError(
          f"checkpoint {self._step_dir(step)} does not match the current model/optimizer state:\n  "
          + "\n  ".join(diff[:10])
          + "\nuse a fresh --config.workdir, or the config the checkpoint was written with."
        )
    target = jax.tree.map(_abstract, target)
    mismatch = unreadable = None
    try:
      state = self._mgr.restore(step, args=ocp.args.Composite(state=_pytree_restore(target, partial)))["state"]
    except Exception as e:  # noqa: BLE001 - sorted into a mismatch or damage below
      if recorded is None and isinstance(e, (ValueError, KeyError, TypeError)) and not _read_error(e):
        mismatch = _first_line(e)
      else:
        unreadable = _read_error(e) or _first_line(e)
    if mismatch or unreadable:
      _finalize_quietly()  # outside the except: the failed read's frames are released first
    if mismatch:
      raise CheckpointError(
        f"checkpoint {self._step_dir(step)} does not match the current model/optimizer "
        f"state structure ({mismatch}); use a fresh --config.workdir."
      )
    if unreadable:
      raise self._corrupt(step, [f"state/ cannot be read ({unreadable})"])
    problems = integrity.value_problems(recorded, state)
    if problems:
      raise self._corrupt(step, problems)
    return state

  def restore(self, step: Optional[int], abstract_state, config=None, *, check_files: bool = True):
    """(state, meta) at `step` (default: latest). `abstract_state` gives shapes, dtypes and shardings.

    With `config`, first compares the checkpoint's model section with it and names every differing field.
    Raises CheckpointCorruptError when the step's files or arrays differ from what was saved or are not finite.
    """
    step, meta, recorded = self._verified_meta(step, check_files=check_files)
    if config is not None and "config" in meta:
      diff = model_mismatch(_config.from_json(meta["config"]), config)
      if diff:
        raise CheckpointError(
          f"checkpoint {self._step_dir(step)} was written for another model; differing fields:\n  "
          + "\n  ".join(diff)
          + "\nuse a fresh --config.workdir, or set these fields to the checkpoint's values."
        )
    return self._read_state(step, abstract_state, recorded, partial=False), meta

  def restore_newest_intact(self, abstract_state, config=None, *, on_corrupt: str = "fallback"):
    """(step, state, meta) of the newest checkpoint that passes verification; (None, None, {}) if there is none.

    Damaged newer steps are logged with their files or arrays. on_corrupt='fallback' moves them aside to
    `<step>.damaged` (so the run can save those steps again) and resumes; 'stop' raises, naming the intact step.
    The step returned is never deleted by keep-last-N while this Checkpointer lives.
    """
    damaged = []
    for step in sorted(self.all_steps(), reverse=True):
      # Every host must resume from the same step, and Orbax's reads are collective (a barrier per restore): the
      # hosts first agree on the files (each checks its own view, e.g. a read error on its own disk or network
      # path), and only then read; a step that fails on one host is damaged for all.
      problems = integrity.file_problems(self._step_dir(step))
      err = self._corrupt(step, problems) if problems else None
      agreed = parallel.every_host(err is None)
      if agreed:
        try:
          state, meta = self.restore(step, abstract_state, config, check_files=False)
        except CheckpointCorruptError as e:
          err = e
        agreed = parallel.every_host(err is None)
      if err is None and not agreed:
        err = CheckpointCorruptError(
          f"checkpoint {self._step_dir(step)} failed verification on another host (its log names the file).", step
        )
      if err is None:
        break
      log.error("%s", err)
      damaged.append(err)
    else:
      if damaged:
        raise CheckpointCorruptError(
          " ".join(str(e) for e in damaged) + f" No checkpoint in {self.directory} is intact: restore the named "
          "files, or move the step directories aside to start afresh.",
          damaged[0].step,
        )
      return None, None, {}
    names = ", ".join(str(e.step) for e in damaged)
    if damaged and on_corrupt == "stop":
      raise CheckpointCorruptError(
        " ".join(str(e) for e in damaged) + f" Step {step} is intact: set --config.checkpoint.on_corrupt=fallback "
        "to resume from it (the damaged steps are then moved aside), or restore the named files.",
        damaged[0].step,
      )
    if damaged:
      moved = self._move_aside([e.step for e in damaged])
      log.warning(
        "resuming from step %d, the newest intact checkpoint in %s; damaged step(s) %s moved to %s.",
        step,
        self.directory,
        names,
        ", ".join(moved),
      )
    self._pinned.steps = {step}
    return step, state, meta

  def _move_aside(self, steps: list[int]) -> list[str]:
    """Renames damaged steps to `<step>.damaged[-i]` (chief only, after every process has checked them)."""
    multi = jax.process_count() > 1
    if multi:
      from jax.experimental import multihost_utils

      multihost_utils.sync_global_devices("aepo_jax_checkpoint_verified")
    moved = []
    for step in steps:
      src = epath.Path(self._step_dir(step))
      dst, i = src.with_name(f"{step}.damaged"), 1
      while dst.exists():
        dst, i = src.with_name(f"{step}.damaged-{i}"), i + 1
      if jax.process_index() == 0:
        src.rename(dst)
      moved.append(str(dst))
    if multi:
      multihost_utils.sync_global_devices("aepo_jax_checkpoint_moved_aside")
    self._refresh()
    return moved

  def restore_params(self, step: Optional[int], abstract_params):
    """Only the parameters of a checkpoint (export, evaluation): the optimizer state is never read. Verified like
    `restore` (the parameters' checksums and finiteness, every file of the step)."""
    step, _, recorded = self._verified_meta(step)
    return self._read_state(step, {"params": abstract_params}, recorded, partial=True)["params"]

  def restore_meta(self, step: Optional[int] = None) -> dict:
    """The `meta` item alone (its files are checked by the restore of the arrays that follows)."""
    return self._verified_meta(step, check_files=False)[1]

  def _save_failed(self, step: int, e: BaseException) -> CheckpointError:
    bound_exit()  # Orbax's threads of the failed save would hold the interpreter's exit
    try:
      intact = max([s for s in self._mgr.all_steps() if s != step], default=None)
    except Exception:  # noqa: BLE001 - the message only
      intact = None
    return CheckpointError(save_failure(self.directory, step, e, intact))

  def check(self):
    """Raise (CheckpointError naming the step) if the last async save has failed; never waits for a running one.
    The trainer calls it before every step, so a failed save stops the run at the next step, not the next save."""
    if self._pending is None or self._mgr.is_saving_in_progress():
      return
    self.wait()

  def wait(self):
    """Wait for the async save in flight; CheckpointError naming its step if it failed."""
    step, self._pending = self._pending, None
    try:
      self._mgr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - any failure of the background save
      raise self._save_failed(step if step is not None else (self._saving or 0), e) from e

  def close(self):
    self.wait()
    self._mgr.close()


def _is_failed_read_noise(exc, tb=None, obj=None) -> bool:
  """What a failed tensorstore read leaves behind: the other reads' callbacks raising asyncio's 'Event loop is
  closed', and their coroutines (orbax's) finalized with GeneratorExit or the read error."""
  if isinstance(exc, RuntimeError) and tb is not None:
    while tb.tb_next is not None:
      tb = tb.tb_next
    return tb.tb_frame.f_code.co_name == "_check_closed"  # asyncio's closed-loop check
  return "orbax" in getattr(getattr(obj, "cr_code", None), "co_filename", "")


def _finalize_quietly():
  """A failed tensorstore read leaves the other reads' coroutines pending; collect them now, and from then on
  drop the 'Event loop is closed' and coroutine-finalizer reports their callbacks print (some arrive from
  tensorstore's threads after this returns), passing every other report to the hooks that were there."""
  if not getattr(sys.unraisablehook, "_aepo_quiet", False):
    unraisable_hook, except_hook = sys.unraisablehook, sys.excepthook

    def quiet_unraisable(u):
      if not _is_failed_read_noise(u.exc_value, u.exc_traceback, u.object):
        unraisable_hook(u)

    def quiet_except(kind, value, tb):
      if not _is_failed_read_noise(value, tb):
        except_hook(kind, value, tb)

    quiet_unraisable._aepo_quiet = True
    sys.unraisablehook, sys.excepthook = quiet_unraisable, quiet_except
  gc.collect()


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return (text[0] if text else type(e).__name__)[:400]


def _read_error(e: BaseException) -> Optional[str]:
  """The storage layer's own message in `e`'s chain (tensorstore's "OUT_OF_RANGE: Error reading ...", an OSError),
  which names the array and what is wrong with it; None for errors of another kind (a tree that does not fit)."""
  chain, seen = [e], set()
  while chain:
    x = chain.pop(0)
    if x is None or id(x) in seen:
      continue
    seen.add(id(x))
    if isinstance(x, OSError) or re.match(r"(OUT_OF_RANGE|DATA_LOSS|NOT_FOUND): |.*Error reading", str(x)):
      return _first_line(x)
    chain += [x.__cause__, x.__context__]
  return None


def _no_numpy_scalar(x):
  if isinstance(x, np.generic):
    return np.asarray(x)
  return x


def _abstract(x):
  sharding = getattr(x, "sharding", None)
  if sharding is None:  # host arrays / plain shapes: restore onto the first local device
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def _json_default(x):
  if isinstance(x, (np.generic, np.ndarray)):
    return x.tolist()
  if isinstance(x, jax.Array):
    return np.asarray(x).tolist()
  if isinstance(x, bytes):
    return encode_iterator_state(x)
  return str(x)
