"""Checkpoints: an Orbax `CheckpointManager` behind one small class, local or gs:// paths.

A checkpoint holds two items: `state` (params, optimizer state, step, RNG key data; arrays through
tensorstore) and `meta` (JSON: data-iterator state, metrics of record, the config, the phase). Orbax writes
into a temporary directory and commits by rename (local) or a commit marker (gs://), so a checkpoint killed
mid-save is never returned by `latest_step()`.

  ckpt = Checkpointer(workdir + "/checkpoints/rl", keep=3, best_metric="eval/accuracy")
  step = ckpt.latest_step()
  state, meta = ckpt.restore(step, abstract_state, config)   # checks the model section of the config
  ckpt.save(step, state, meta, metrics={...}, force=True)
"""
from __future__ import annotations

import base64
import dataclasses
import errno
import json
import logging
import os
import shutil
import uuid
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from aepo_jax.train import _config

_MIN_FREE_BYTES = 64 << 20  # refuse to start with less free space than this in the work directory


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be written or read as asked; the message says which and why."""


def is_remote(path: str) -> bool:
  return str(path).startswith("gs://")


def check_writable(workdir: str, need_bytes: int = _MIN_FREE_BYTES) -> None:
  """Fail at start-up, not at the first save, on a read-only, missing or full work directory."""
  path = epath.Path(workdir)
  probe = path / f".write_probe_{uuid.uuid4().hex[:8]}"
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe.write_bytes(b"\0" * 4096)
    probe.unlink()
  except OSError as e:
    reason = {errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
              errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exhausted"}.get(e.errno, str(e))
    raise CheckpointError(f"work directory {workdir!r} is not writable ({reason}); choose another "
                          "--config.workdir or free/mount it read-write.") from e
  if not is_remote(workdir):
    free = shutil.disk_usage(os.fspath(path)).free
    if free < need_bytes:
      raise CheckpointError(f"work directory {workdir!r} has {free / 2**20:.1f} MiB free but a checkpoint needs about "
                            f"{need_bytes / 2**20:.1f} MiB; free space or choose another --config.workdir.")


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
    for k in ("model.dtype", "model.remat", "model.tokenizer", "model.init", "model.overrides.attention_impl",
              "model.overrides.scan_unroll"):
      d.pop(k, None)  # these do not change parameter shapes
    return d
  canon = lambda d: {k: json.loads(json.dumps(v, default=str)) for k, v in d.items()}  # tuples == lists
  a, b = canon(flat(saved_config)), canon(flat(config))
  return [f"{k}: checkpoint={a.get(k, '<unset>')!r} current={b.get(k, '<unset>')!r}"
          for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _pytree_restore(target, partial: bool = False):
  """Restore args for the "state" item (also reads checkpoints written with StandardSave): arrays as `target`'s
  abstract arrays (shape, dtype, sharding); `partial` reads only the subtree `target` names."""
  return ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                partial_restore=partial)


class Checkpointer:
  """Keep-last-N plus best-by-metric, async saves, automatic resume; one directory per training phase."""

  def __init__(self, directory: str, *, keep: int = 3, best_metric: str = "", best_mode: str = "max",
               async_save: bool = True, ocdbt: bool = True, compression: bool = True):
    """compression: zstd-compress the arrays (Orbax's default; ~20% smaller for float32 weights, but several
    CPU-seconds per GB that an async save takes from training on a small machine)."""
    self.directory = str(directory)
    self.best_metric = best_metric
    self._best_mode = best_mode
    policies = [ocp.checkpoint_managers.LatestN(n=keep)]
    if best_metric:
      policies.append(ocp.checkpoint_managers.BestN(
          get_metric_fn=lambda m: float(m[best_metric]), reverse=best_mode == "min", n=1,
          keep_checkpoints_without_metrics=False))
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
        enable_async_checkpointing=async_save, create=True, cleanup_tmp_directories=True,
        # best_fn also makes Orbax write each step's metrics to disk, so the best survives a restart.
        best_fn=(lambda m: float(m[best_metric])) if best_metric else None, best_mode=best_mode,
        keep_checkpoints_without_metrics=True)
    try:
      self._mgr = ocp.CheckpointManager(
          epath.Path(self.directory), options=options,
          item_handlers={"state": ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_compression=compression),
                         "meta": ocp.JsonCheckpointHandler()})
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
    scored = [(m[self.best_metric], s) for s in self.all_steps()
              if (m := self._mgr.metrics(s)) and self.best_metric in m]
    if not scored:
      return None
    return (max(scored) if self._best_mode == "max" else min(scored))[1]

  # -- save / restore -----------------------------------------------------------------------------------
  def save(self, step: int, state, meta: dict, *, metrics: Optional[dict] = None, force: bool = False) -> bool:
    """Save (asynchronously when enabled) `state` (a pytree of arrays) and `meta` (JSON-serialisable).

    `metrics` feed the best-checkpoint policy; a checkpoint saved without the best metric is kept only as
    one of the last N.
    """
    state = jax.tree.map(_no_numpy_scalar, state)  # orbax rejects numpy scalar leaves (np.int32(3))
    meta = json.loads(json.dumps(meta, default=_json_default))
    if metrics is not None and self.best_metric and self.best_metric not in metrics:
      metrics = None
    try:
      return self._mgr.save(int(step), args=ocp.args.Composite(
          state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
          metrics={k: float(v) for k, v in metrics.items()} if metrics else None, force=force)
    except OSError as e:
      raise CheckpointError(f"saving step {step} to {self.directory!r} failed: {e}") from e

  def restore(self, step: Optional[int], abstract_state, config=None):
    """(state, meta) at `step` (default: latest). `abstract_state` gives shapes, dtypes and shardings.

    With `config`, first compares the checkpoint's model section with it and names every differing field.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"no committed checkpoint in {self.directory!r}.")
    if is_remote(self.directory):
      self._refresh()
    meta = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if config is not None and "config" in meta:
      diff = model_mismatch(_config.from_json(meta["config"]), config)
      if diff:
        raise CheckpointError(
            f"checkpoint {self.directory}/{step} was written for another model; differing fields:\n  "
            + "\n  ".join(diff) + "\nuse a fresh --config.workdir, or set these fields to the checkpoint's values.")
    target = jax.tree.map(_abstract, abstract_state)
    try:
      state = self._mgr.restore(step, args=ocp.args.Composite(state=_pytree_restore(target)))["state"]
    except (ValueError, KeyError, TypeError) as e:
      raise CheckpointError(f"checkpoint {self.directory}/{step} does not match the current model/optimizer "
                            f"state structure ({e}); use a fresh --config.workdir.") from e
    return state, meta

  def restore_params(self, step: Optional[int], abstract_params):
    """Only the parameters of a checkpoint (export, evaluation): the optimizer state is never read."""
    step = self.latest_step() if step is None else step
    if is_remote(self.directory):
      self._refresh()
    target = {"params": jax.tree.map(_abstract, abstract_params)}
    args = ocp.args.Composite(state=_pytree_restore(target, partial=True))
    return self._mgr.restore(step, args=args)["state"]["params"]

  def restore_meta(self, step: Optional[int] = None) -> dict:
    step = self.latest_step() if step is None else step
    if is_remote(self.directory):
      self._refresh()
    return self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def wait(self):
    self._mgr.wait_until_finished()

  def close(self):
    self._mgr.wait_until_finished()
    self._mgr.close()


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
