"""A tiny random model with the tiny ChatML tokenizer behind a loopback server, shared by the serve tests."""

import jax
import pytest

from aepo_jax.model import ModelConfig, Tokenizer, init_params
from serve_helpers import MAX_LEN, MAX_SLOTS


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
  from aepo_jax.testing import tiny_tokenizer

  tok = Tokenizer.from_dir(tiny_tokenizer(tmp_path_factory.mktemp("tok")))
  cfg = ModelConfig(
    family="qwen3",
    vocab_size=tok.vocab_size,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qk_norm=True,
    eos_token_ids=tuple(tok.eos_ids),
  )
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
