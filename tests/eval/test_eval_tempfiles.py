"""Evaluating a gs:// HF directory copies it to a temporary directory that is gone once weights and tokenizer are
read (no /tmp/aepo_eval_* left behind); the gs:// export that wrote it leaves nothing either."""

import os
import tempfile

import jax
import numpy as np

from aepo_jax.eval import load_policy, load_tokenizer
from aepo_jax.model import copy_tokenizer_files, save_hf


def test_gs_hf_directory_leaves_no_temporary_files(
  gcs_emulator, tiny_config, tiny_params, tok_dir, tmp_path, monkeypatch
):
  tmp = tmp_path / "tmp"
  tmp.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(tmp))
  hf = f"{gcs_emulator}/hf"
  save_hf(tiny_config, tiny_params, hf, max_shard_bytes=100_000)
  copy_tokenizer_files(tok_dir, hf)
  assert os.listdir(tmp) == []
  policy = load_policy(hf)
  jax.tree.map(np.testing.assert_array_equal, policy.params, tiny_params)
  assert policy.tokenizer.vocab_size == load_tokenizer(hf).vocab_size == load_tokenizer(tok_dir).vocab_size
  assert os.listdir(tmp) == []
