"""A tiny random model with the tiny ChatML tokenizer behind a loopback server, shared by the serve tests."""

import jax
import pytest

from aepo_jax.model import Tokenizer, init_params
from aepo_jax.testing import tiny_model_config
from serve_helpers import MAX_LEN, MAX_SLOTS


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
  from aepo_jax.testing import tiny_tokenizer

  tok = Tokenizer.from_dir(tiny_tokenizer(tmp_path_factory.mktemp("tok")))
  cfg = tiny_model_config("qwen3", vocab_size=tok.vocab_size, eos_token_ids=tuple(tok.eos_ids))
  # Larger weights than the default init: peaked distributions, so greedy paths have clear winners.
  params = jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, init_params(cfg, jax.random.PRNGKey(0)))
  return cfg, params, tok


@pytest.fixture(scope="session")
def server(tiny):
  from aepo_jax.serve import Server

  cfg, params, tok = tiny
  srv = Server(
    cfg, params, tok, model_name="tiny", max_slots=MAX_SLOTS, max_len=MAX_LEN, port=0, steps_per_call=8
  ).start()
  srv.warmup()
  yield srv
  srv.shutdown(1.0)


@pytest.fixture
def client(server):
  import openai

  return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
