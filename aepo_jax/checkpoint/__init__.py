"""checkpoint: Orbax checkpoints of a training run (local or gs://), verified on restore, and the policy they hold.

Used by `train` (saves, resumes) and `eval` (loads a policy); imports only `model` and `parallel`.

Saving, restoring
  Checkpointer(directory, keep, best_metric, best_mode, async_save, ocdbt, compression, read_only):
      save/restore/restore_meta/restore_params/latest_step/all_steps/best_step/check/wait/close,
      restore_newest_intact (checksums verified; a damaged step set aside)
  CheckpointError, CheckpointCorruptError(step, problems)
Storage
  check_writable(workdir) (fails at start-up on a read-only, full or unreachable directory),
  check_remote(path) (a gs:// service that does not answer), is_remote(path)
Meta
  encode_iterator_state / decode_iterator_state (a data iterator's state as JSON),
  model_config_to_json / model_config_from_json (the ModelConfig saved in meta),
  model_mismatch(saved_config, config) -> the differing `model.*` fields
Loading a policy (any of: a pretrained name, an HF directory, an Orbax checkpoint)
  resolve_checkpoint(path) -> CheckpointRef; load_policy(ref, tokenizer=None) -> Policy(config, params, tokenizer),
  load_tokenizer(path_or_name), training_config(ref) -> the run's saved config dict or None,
  CheckpointNotFoundError, CheckpointDamagedError
"""

from aepo_jax.checkpoint._checkpointer import Checkpointer
from aepo_jax.checkpoint._loading import (
  CheckpointDamagedError,
  CheckpointNotFoundError,
  CheckpointRef,
  Policy,
  load_policy,
  load_tokenizer,
  resolve_checkpoint,
  training_config,
)
from aepo_jax.checkpoint._meta import (
  decode_iterator_state,
  encode_iterator_state,
  model_config_from_json,
  model_config_to_json,
  model_mismatch,
)
from aepo_jax.checkpoint._storage import (
  CheckpointCorruptError,
  CheckpointError,
  check_remote,
  check_writable,
  is_remote,
)

__all__ = [
  "Checkpointer",
  "CheckpointError",
  "CheckpointCorruptError",
  "check_writable",
  "check_remote",
  "is_remote",
  "encode_iterator_state",
  "decode_iterator_state",
  "model_config_to_json",
  "model_config_from_json",
  "model_mismatch",
  "CheckpointRef",
  "Policy",
  "resolve_checkpoint",
  "load_policy",
  "load_tokenizer",
  "training_config",
  "CheckpointNotFoundError",
  "CheckpointDamagedError",
]
