"""Loading the policy to evaluate: Orbax training checkpoints (params only, config and tokenizer from meta),
HF directories and the tokenizer override."""

import os
import shutil

import jax
import numpy as np
import pytest

from aepo_jax.eval import CheckpointNotFoundError, load_policy, resolve_checkpoint
from aepo_jax.model import save_hf

from eval_helpers import save_checkpoint


def _same(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_orbax_params_config_and_tokenizer_from_meta(orbax_ckpt, tiny_config, tiny_params, tokenizer):
  for path in (
    orbax_ckpt,
    os.path.join(orbax_ckpt, "checkpoints", "rl"),
    os.path.join(orbax_ckpt, "checkpoints", "rl", "3"),
  ):
    pol = load_policy(path)
    assert pol.config == tiny_config and pol.source.endswith("step 3")
    _same(pol.params, tiny_params)
    assert pol.tokenizer.vocab_size == tokenizer.vocab_size and pol.tokenizer.eos_id == tokenizer.eos_id


def test_latest_committed_step_is_used(tmp_path, tiny_config, tiny_params, tok_dir):
  d = str(tmp_path / "checkpoints" / "rl")
  save_checkpoint(d, tiny_config, tiny_params, tok_dir, step=1)
  newer = jax.tree.map(lambda x: x + 1, tiny_params)
  save_checkpoint(d, tiny_config, newer, tok_dir, step=2)
  os.makedirs(os.path.join(d, "3.orbax-checkpoint-tmp-123"))  # an interrupted save is ignored
  _same(load_policy(str(tmp_path)).params, newer)
  _same(load_policy(os.path.join(d, "1")).params, tiny_params)


def test_hf_directory_and_tokenizer_override(tmp_path, tiny_config, tiny_params, tok_dir):
  hf = str(tmp_path / "hf")
  save_hf(tiny_config, tiny_params, hf)
  with pytest.raises(CheckpointNotFoundError, match="tokenizer.json.*--tokenizer"):
    load_policy(hf)  # no tokenizer in the directory and none given
  pol = load_policy(hf, tokenizer=tok_dir)
  assert resolve_checkpoint(hf).kind == "hf" and pol.config.vocab_size == tiny_config.vocab_size
  _same(pol.params, tiny_params)
  for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(tok_dir, f), hf)
  _same(load_policy(hf).params, tiny_params)


def test_orbax_without_a_tokenizer_names_the_flag(tmp_path, tiny_config, tiny_params):
  from aepo_jax import checkpoint as _checkpoint

  d = str(tmp_path / "checkpoints" / "rl")
  ckpt = _checkpoint.Checkpointer(d, async_save=False)
  ckpt.save(1, {"params": tiny_params}, {"model_config": _checkpoint.model_config_to_json(tiny_config)}, force=True)
  ckpt.close()
  with pytest.raises(CheckpointNotFoundError, match="--tokenizer"):
    load_policy(str(tmp_path))


def _largest_state_file(step_dir):
  files = [os.path.join(d, n) for d, _, names in os.walk(os.path.join(step_dir, "state")) for n in names]
  return max(files, key=os.path.getsize)


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no_manifest"])
def test_damaged_checkpoint_is_one_clear_error_naming_the_others(
  tmp_path, tiny_config, tiny_params, tok_dir, capfd, manifest
):
  """A truncated data file used to print pages of 'Event loop is closed' before a TensorStore trace."""
  from aepo_jax.eval import CheckpointDamagedError

  d = str(tmp_path / "checkpoints" / "rl")
  save_checkpoint(d, tiny_config, tiny_params, tok_dir, step=1)
  save_checkpoint(d, tiny_config, tiny_params, tok_dir, step=2)
  if not manifest:
    os.remove(os.path.join(d, "2", "integrity.json"))
  victim = _largest_state_file(os.path.join(d, "2"))
  with open(victim, "r+b") as f:
    f.truncate(os.path.getsize(victim) // 2)
  with pytest.raises(CheckpointNotFoundError) as e:  # the CLI reports these as `error: ...`, exit 2
    load_policy(str(tmp_path))
  msg = str(e.value)
  assert isinstance(e.value, CheckpointDamagedError) and "\n" not in msg
  assert msg.startswith(f"checkpoint {d}/2 is damaged: ")
  assert (os.path.relpath(victim, os.path.join(d, "2")) + " has " if manifest else "state/ cannot be read (") in msg
  assert msg.endswith(f"evaluate another step (--checkpoint={d}/<step>, committed: 1) or restore the named files.")
  _same(load_policy(os.path.join(d, "1")).params, tiny_params)
  assert "Event loop is closed" not in capfd.readouterr().err


def test_unreachable_gcs_checkpoint_fails_in_seconds(monkeypatch):
  import socket
  import time

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    closed = f"http://127.0.0.1:{s.getsockname()[1]}"
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", closed)
  monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", closed)
  t0 = time.monotonic()
  with pytest.raises(CheckpointNotFoundError, match=f"--checkpoint gs://b/run: the storage service at {closed}"):
    resolve_checkpoint("gs://b/run")
  assert time.monotonic() - t0 < 10
