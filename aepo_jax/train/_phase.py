"""What the SFT and RL phases share: the run they belong to (`Run`), the training state they carry and checkpoint
(`TrainState`), resuming and saving it, and the non-finite-update budget."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import jax
import numpy as np

from aepo_jax import checkpoint as _checkpoint
from aepo_jax.train import _config, _step

log = logging.getLogger("aepo_jax.train")


class TrainingError(RuntimeError):
  """A run that cannot continue (too many non-finite losses, an exhausted data source, ...)."""


class NothingToDo(_config.ConfigError):
  """A run that would train nothing (already finished, or zero steps): said, and the process exits non-zero."""


@dataclasses.dataclass(frozen=True)
class Run:
  """One run's fixed parts, handed to each phase: its config, model, tokenizer and mesh, where metrics go, the
  preemption flag the hosts agree on, and whether this host shows progress bars."""

  config: Any
  model_cfg: Any
  tokenizer: Any
  mesh: Any
  writer: Any
  preempt: Any
  progress: bool = False
  opened: list = dataclasses.field(default_factory=list, repr=False, compare=False)  # the phases' checkpointers

  @property
  def rules(self) -> tuple:
    """The training mesh's logical-axis rules (`_config.mesh_rules`: expert parallelism per mesh.expert_axis)."""
    return _config.mesh_rules(self.config)

  def checkpointer(self, phase: str) -> _checkpoint.Checkpointer:
    """The checkpoints of `phase` ('sft' | 'rl') under workdir/checkpoints/."""
    ck = self.config.checkpoint
    ckpt = _checkpoint.Checkpointer(
      f"{self.config.workdir}/checkpoints/{phase}",
      keep=ck.keep,
      best_metric=ck.best_metric if phase == "rl" else "",
      best_mode=ck.best_mode,
      async_save=ck.async_save,
      ocdbt=ck.ocdbt,
      compression=ck.compression,
    )
    self.opened.append(ckpt)
    return ckpt

  def close_after_error(self) -> None:
    """A run stopping on an exception (Ctrl-C included): every checkpointer's save in flight finishes before the
    exception leaves the run, so no background save is still writing (or half-renamed) when the same command, in
    this process or the next, opens the directory again."""
    for ckpt in self.opened:
      ckpt.close_after_error()


@dataclasses.dataclass
class TrainState:
  """What a phase carries from step to step and checkpoints: parameters, optimizer state, the RNG key data, the
  step, and the metadata restored with them (data-iterator state, counters)."""

  params: Any
  opt_state: Any
  rng: np.ndarray
  step: int = 0
  meta: dict = dataclasses.field(default_factory=dict)


def resume(
  run: Run, ckpt, params, optimizer, seed: int, *, keep_start: bool = False, on_corrupt: Optional[str] = None
) -> tuple[TrainState, Any]:
  """(state, start params): the newest intact checkpoint of `ckpt`, or a fresh start from `params`. A damaged
  newer checkpoint is named and moved aside, or stops the run (checkpoint.on_corrupt).

  start params: with keep_start, a copy of the given (sharded) parameters, e.g. the RL start as the KL
  reference (a copy: the update step donates the parameters it is given); else None.
  """
  params, opt_state = _step.init_train_state(run.model_cfg, params, optimizer, run.mesh, run.rules)
  start_params = jax.tree.map(lambda x: x.copy(), params) if keep_start else None
  rng = np.asarray(jax.random.key_data(jax.random.key(seed)))
  step, restored, meta = ckpt.restore_newest_intact(
    {"params": params, "opt_state": opt_state, "rng": rng},
    run.config,
    on_corrupt=on_corrupt or run.config.checkpoint.on_corrupt,
  )
  if step is None:
    return TrainState(params, opt_state, rng), start_params
  log.info("resuming from step %d (%s)", step, ckpt.directory)
  state = TrainState(restored["params"], restored["opt_state"], np.asarray(restored["rng"]), step, meta)
  return state, start_params


def save(run: Run, ckpt, state: TrainState, data_state, extra: dict, *, metrics=None, force: bool = False) -> None:
  """Checkpoints `state` at its step with the data-iterator state, the config and model config, and `extra`."""
  meta = {
    "step": state.step,
    "data_state": _checkpoint.encode_iterator_state(data_state),
    "config": _config.to_json(run.config),
    "model_config": _checkpoint.model_config_to_json(run.model_cfg),
    **extra,
  }
  tree = {"params": state.params, "opt_state": state.opt_state, "rng": np.asarray(state.rng)}
  ckpt.save(state.step, tree, meta, metrics=metrics, force=force)


def needs_reference(config) -> bool:
  return config.algo.kl.coef > 0 or config.algo.kl.use_in_reward


def check_finite(metrics: dict, nan_count: int, limit: int, step: int) -> int:
  """nan_count plus the updates `metrics` says were skipped; past `limit` the run stops with a TrainingError."""
  skipped = int(round(float(metrics.get("train/nonfinite_skipped", 0.0))))
  nan_count += skipped
  if skipped:
    log.warning("step %d: non-finite loss or gradient, update skipped (%d so far, limit %d)", step, nan_count, limit)
  if nan_count > limit:
    raise TrainingError(
      f"{nan_count} updates had a non-finite loss or gradient norm (train.nan_limit={limit}); "
      "lower optim.lr, check the data for empty loss masks, or raise train.nan_limit."
    )
  return nan_count
