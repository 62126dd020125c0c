"""train: configs, the SFT and RL loops, metric writers; the checkpoint names of `aepo_jax.checkpoint` re-exported.

Config      base_config(), validate(config, num_devices=None), load_config(path, arg, overrides),
            load_sibling(__file__, "common") (shared config files), mesh_shape(mesh_cfg, num_devices), set_key,
            to_json/from_json, ConfigError
Command line split_model_overrides(argv) -> (argv, {field: value}) (`--config.model.overrides.FIELD=VALUE`),
            apply_model_overrides(config, overrides), unknown_key_hint(key) -> None or '; did you mean ...',
            resolve_config_flag(argv), find_config(path) (`configs/x.py` not here: the shipped config)
Checks      preflight_checklist(config) -> rows, format_checklist(rows, config_name), PreflightError
            (files, names, backends and URLs, no device claimed); compile_check(config, topology, programs,
            hlo_dir=, headroom=) -> exit status (every program compiled for a TPU topology: fits in HBM?)
Trainer     run(config, mode=None) -> summary dict  (cold-start SFT, then RL; resumes automatically), TrainingError
Checkpoints Checkpointer(directory, keep, best_metric, best_mode, async_save): save/restore/latest_step,
            restore_newest_intact (checksums verified; a damaged step set aside), check_writable(workdir),
            CheckpointError, CheckpointCorruptError   (from aepo_jax.checkpoint)
Metrics     create_writer(workdir, metrics_cfg) -> MetricWriter (scalars, histograms, flush, close),
            JsonlWriter, TensorboardWriter, MultiWriter, read_metrics(workdir, name=METRICS_FILE),
            HISTOGRAMS_FILE, progress, Timer
"""

from aepo_jax.checkpoint import Checkpointer, CheckpointCorruptError, CheckpointError, check_writable
from aepo_jax.train._compile_report import check as compile_check
from aepo_jax.train._config import (
  ConfigError,
  apply_model_overrides,
  base_config,
  find_config,
  flatten,
  from_json,
  load_config,
  load_sibling,
  mesh_shape,
  resolve_config_flag,
  set_key,
  split_model_overrides,
  to_json,
  unknown_key_hint,
  validate,
)
from aepo_jax.train._metrics import (
  HISTOGRAMS_FILE,
  JsonlWriter,
  MetricWriter,
  MultiWriter,
  TensorboardWriter,
  Timer,
  create_writer,
  progress,
  read_metrics,
)
from aepo_jax.train._preflight import PreflightError, format_checklist
from aepo_jax.train._preflight import checklist as preflight_checklist
from aepo_jax.train._trainer import NothingToDo, TrainingError, run

__all__ = [
  "ConfigError",
  "base_config",
  "validate",
  "load_config",
  "load_sibling",
  "mesh_shape",
  "set_key",
  "to_json",
  "from_json",
  "split_model_overrides",
  "apply_model_overrides",
  "resolve_config_flag",
  "find_config",
  "flatten",
  "unknown_key_hint",
  "preflight_checklist",
  "format_checklist",
  "PreflightError",
  "compile_check",
  "run",
  "TrainingError",
  "NothingToDo",
  "Checkpointer",
  "CheckpointError",
  "CheckpointCorruptError",
  "check_writable",
  "create_writer",
  "MetricWriter",
  "JsonlWriter",
  "TensorboardWriter",
  "MultiWriter",
  "read_metrics",
  "HISTOGRAMS_FILE",
  "progress",
  "Timer",
]
