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
  for path in (orbax_ckpt, os.path.join(orbax_ckpt, "checkpoints", "rl"), os.path.join(orbax_ckpt, "checkpoints", "rl", "3")):
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
  from aepo_jax.train import _checkpoint
  d = str(tmp_path / "checkpoints" / "rl")
  ckpt = _checkpoint.Checkpointer(d, async_save=False)
  ckpt.save(1, {"params": tiny_params}, {"model_config": _checkpoint.model_config_to_json(tiny_config)}, force=True)
  ckpt.close()
  with pytest.raises(CheckpointNotFoundError, match="--tokenizer"):
    load_policy(str(tmp_path))
