"""Checkpoints: an Orbax `CheckpointManager` behind one small class, local or gs:// paths.

A checkpoint holds two items: `state` (params, optimizer state, step, RNG key data; arrays through
tensorstore) and `meta` (JSON: data-iterator state, metrics of record, the config, the phase). Orbax writes
into a temporary directory and commits by rename (local) or a commit marker (gs://), so a checkpoint killed
mid-save is never returned by `latest_step()`.

Integrity (`_integrity.py`): a save records a checksum of every array (in `meta`) and the size and hash
of every file (`integrity.json`; with several hosts each hashes the files it wrote); a restore checks both (each
host its share of the files), and that every value is finite, and raises `CheckpointCorruptError` naming the damaged
files or arrays, the same on every host. `restore_newest_intact` then moves a damaged step aside
(`<step>.damaged`) and resumes from the newest intact one, which `keep` never deletes while this run lasts.

  ckpt = Checkpointer(workdir + "/checkpoints/rl", keep=3, best_metric="eval/accuracy")
  step, state, meta = ckpt.restore_newest_intact(abstract_state, config)  # (None, None, {}) without checkpoints
  state, meta = ckpt.restore(step, abstract_state, config)   # one step; checks the model section of the config
  ckpt.save(step, state, meta, metrics={...}, force=True)
"""

from __future__ import annotations

import json
import logging
from typing import Optional

import jax
import orbax.checkpoint as ocp
from etils import epath

from aepo_jax import parallel
from aepo_jax.checkpoint import _integrity as integrity
from aepo_jax.checkpoint._meta import _abstract, _json_default, _no_numpy_scalar, model_mismatch
from aepo_jax.checkpoint._storage import (
  CheckpointCorruptError,
  CheckpointError,
  _finalize_quietly,
  _first_line,
  _quiet_failed_read_noise,
  _read_error,
  bound_exit,
  check_remote,
  is_remote,
  save_failure,
)

log = logging.getLogger("aepo_jax.checkpoint")


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
    self._closed = False
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
      async_options=ocp.AsyncOptions(
        post_finalization_callback=self._manifest_before_commit,
        barrier_sync_fn=self._barrier_hashing_own_files() if jax.process_count() > 1 else None,
      )
      if async_save
      else None,
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
    if saved and not self._async:  # committed: a kill before this costs the manifest
      self._manifest_after_commit(self._step_dir(step))
    return saved

  def _step_dir(self, step: int) -> str:
    return f"{self.directory}/{step}"

  def _saving_dir(self) -> str:
    """Where the async save of step `_saving` writes: its tmp directory (local), the step itself (gs://)."""
    tmp = sorted(epath.Path(self.directory).glob(f"{self._saving}.orbax-checkpoint-tmp*"))
    return str(tmp[-1]) if tmp else self._step_dir(self._saving)

  def _barrier_hashing_own_files(self):
    """Orbax's barrier for its save thread, where each host first hashes the files it wrote (`integrity.p<N>.json`).

    Its 'async_write_complete' barrier is the last point at which every host runs (this host's data is written;
    process 0 finalizes and runs `_manifest_before_commit` after all have passed it). Should Orbax rename that
    barrier, no part is written and process 0 hashes every file, as with one process."""
    barrier = ocp.multihost.get_barrier_sync_fn()

    def sync(*, key: str, timeout_ms: int) -> None:
      if "async_write_complete" in key and self._saving is not None and not is_remote(self.directory):
        try:
          integrity.write_part(self._saving_dir(), jax.process_index())
        except Exception as e:  # noqa: BLE001 - never skip the barrier: process 0 hashes these files instead
          log.warning("step %s: this host's files not hashed (%s); process 0 hashes them.", self._saving, e)
      barrier(key=key, timeout_ms=timeout_ms)

    return sync

  def _manifest_before_commit(self):
    """Runs in Orbax's save thread (process 0) once every process has written its data, before the commit."""
    if self._saving is None or jax.process_index() != 0:
      return
    self._write_manifest(self._saving_dir())

  def _manifest_after_commit(self, step_dir: str):
    """A sync save's manifest: each host hashes its own files, process 0 gathers them and writes it."""
    parts = None
    if jax.process_count() > 1 and not is_remote(step_dir):  # gs://: the listing has every crc32c
      own = {}
      try:
        own = integrity.hash_own_files(step_dir, jax.process_index())
      except Exception as e:  # noqa: BLE001 - every host must reach the gather; process 0 hashes them instead
        log.warning("%s: this host's files not hashed (%s); process 0 hashes them.", step_dir, e)
      parts = parallel.allgather_json(own)
    if jax.process_index() == 0:
      self._write_manifest(step_dir, parts)

  def _write_manifest(self, step_dir: str, parts=None):
    try:
      integrity.write_manifest(step_dir, parts)
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
    problems = integrity.agreed_file_problems(self._step_dir(step)) if check_files else []
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
    _quiet_failed_read_noise()  # before the read: a failing read's other callbacks report from their threads
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
      saved = meta["config"]
      diff = model_mismatch(json.loads(saved) if isinstance(saved, str) else saved, config)
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
      # hosts first agree on the files (each hashes its share, in its own view: a read error on its own disk or
      # network path counts), and only then read; a step that fails on one host is damaged for all.
      problems = integrity.agreed_file_problems(self._step_dir(step))
      err = self._corrupt(step, problems) if problems else None
      agreed = err is None
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
    """Wait for the save in flight (CheckpointError if it failed), then release the manager; a second call does
    nothing."""
    if self._closed:
      return
    self._closed = True
    try:
      self.wait()
    finally:
      self._mgr.close()

  def close_after_error(self):
    """close() for a run that is already failing (an exception, Ctrl-C): the save in flight still finishes, so its
    step directory is whole or absent when the same command runs again; a failure of that save is logged, not
    raised over the run's own error."""
    try:
      self.close()
    except Exception as e:  # noqa: BLE001 - the run's own exception is the one to raise
      log.error("while stopping: %s", e)
