"""A truncated or damaged GGUF names the file and the fix (the reader's own error, "cannot reshape array of size
427712 into shape (1536,360)", said neither)."""

import os

import gguf
import numpy as np
import pytest

from aepo_jax.model._gguf import GGUFError, convert_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
  w = gguf.GGUFWriter(path, "llama")
  w.add_block_count(1)
  w.add_tensor("token_embd.weight", np.arange(64 * 16, dtype=np.float32).reshape(64, 16))
  w.add_tensor("output_norm.weight", np.ones(16, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def _prefix(src, dst, size):
  with open(src, "rb") as f, open(dst, "wb") as g:
    g.write(f.read(size))
  return str(dst)


@pytest.mark.parametrize("keep", [0.97, 0.5, 0.1, 0.0])
def test_truncated_gguf_names_the_file(tiny_gguf, tmp_path, keep):
  cut = _prefix(tiny_gguf, tmp_path / "cut.gguf", int(os.path.getsize(tiny_gguf) * keep))
  with pytest.raises(GGUFError) as e:
    convert_gguf(cut, str(tmp_path / "out"))
  msg = str(e.value)
  assert msg.startswith(f"GGUF file {cut} ") and "truncated" in msg and "Re-download it" in msg, msg
  assert not os.path.exists(tmp_path / "out" / "model.safetensors")


def test_truncated_smollm2_gguf_names_the_file(smollm2_gguf, tmp_path):
  """The shipped Q4_1 file cut at 50 MB: the case that said "cannot reshape array of size ..." alone."""
  cut = _prefix(smollm2_gguf, tmp_path / "SmolLM2.gguf", 50 << 20)
  needle = f"GGUF file {cut} \\({50 << 20} bytes\\) is truncated or corrupt: cannot reshape"
  with pytest.raises(GGUFError, match=needle):
    convert_gguf(cut, str(tmp_path / "out"))
