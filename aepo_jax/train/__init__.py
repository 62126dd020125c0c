"""train: configs, the SFT and RL loops, the jitted update step, checkpoints and metric writers.

Config      base_config(), validate(config, num_devices=None), load_config(path, arg, overrides),
            load_sibling(__file__, "common") (shared config files), mesh_shape(mesh_cfg, num_devices), set_key,
            to_json/from_json, ConfigError
Trainer     run(config, mode=None) -> summary dict      (cold-start SFT, then RL; resumes automatically)
Checkpoints Checkpointer(directory, keep, best_metric, best_mode, async_save): save/restore/latest_step,
            restore_newest_intact (checksums verified; a damaged step set aside), check_writable(workdir),
            CheckpointError, CheckpointCorruptError
Metrics     create_writer(workdir, metrics_cfg) -> MetricWriter (scalars, histograms, flush, close),
            JsonlWriter, TensorboardWriter, read_metrics(workdir), progress, Timer
Update step make_update_step, make_sft_step, make_logprob_fn, init_train_state, make_optimizer,
            trajectories_batch, sft_batch, split_updates, shard_batch   (see _step.py, _batch.py, _optim.py)
"""

from aepo_jax.train._config import (
  ConfigError,
  base_config,
  from_json,
  load_config,
  load_sibling,
  mesh_shape,
  set_key,
  to_json,
  validate,
)
from aepo_jax.train._checkpoint import Checkpointer, CheckpointCorruptError, CheckpointError, check_writable
from aepo_jax.train._metrics import (
  JsonlWriter,
  MetricWriter,
  MultiWriter,
  TensorboardWriter,
  Timer,
  create_writer,
  progress,
  read_metrics,
)
from aepo_jax.train._trainer import TrainingError, run
