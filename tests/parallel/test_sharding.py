"""Sharded forward == unsharded forward on 8 fake CPU devices; sharded load_hf places params as the rules say."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from aepo_jax import model, parallel, testing

# Tiny dims divisible by every mesh axis used here (heads 4, mlp 128, vocab 320, embed 64); 2 KV heads do not
# divide tensor=4, so the rules' divisibility fallback replicates them.
CONFIG = model.ModelConfig(
  family="qwen2",
  vocab_size=320,
  hidden_size=64,
  intermediate_size=128,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
  attention_bias=True,
)
TOL = 1e-5  # only the reduction order changes


def _inputs():
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, 320, (8, 16)).astype(np.int32)
  mask = np.ones((8, 16), np.int32)
  mask[1, :5] = 0  # a left-padded row
  mask[2, 11:] = 0  # a right-padded row
  return tokens, mask


@pytest.fixture(scope="module")
def reference():
  params = model.init_params(CONFIG, jax.random.PRNGKey(1))
  tokens, mask = _inputs()
  return params, np.asarray(model.forward(CONFIG, params, tokens, attention_mask=mask))


@pytest.mark.parametrize("shape", [dict(fsdp=2, tensor=4), dict(data=2, fsdp=4)], ids=["fsdp2xtp4", "dp2xfsdp4"])
def test_sharded_forward_equals_unsharded(reference, shape):
  params, expected = reference
  mesh = parallel.make_mesh(shape)
  sharded = parallel.shard_params(params, model.param_logical_axes(CONFIG), mesh)
  q_spec = sharded["layers"]["self_attn"]["q_proj"]["kernel"].sharding.spec
  assert q_spec == parallel.logical_to_mesh(P("layers", "embed", "heads", "head_dim"))
  tokens, mask = _inputs()
  batch = NamedSharding(mesh, P(("data", "fsdp")))
  with mesh, nn.logical_axis_rules(parallel.DEFAULT_RULES):
    fwd = jax.jit(
      lambda p, x, m: model.forward(CONFIG, p, x, attention_mask=m),
      out_shardings=NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")),
    )
    logits = fwd(sharded, jax.device_put(tokens, batch), jax.device_put(mask, batch))
  assert len(logits.sharding.device_set) == 8
  valid = mask.astype(bool)
  assert np.abs(np.asarray(logits) - expected)[valid].max() <= TOL


def test_sharded_load_hf_places_params(tmp_path):
  path = testing.tiny_hf_checkpoint("qwen3", tmp_path / "ckpt", tie_word_embeddings=True)
  mesh = parallel.make_mesh(dict(fsdp=2, tensor=4))
  config, params = model.load_hf(path, mesh=mesh)
  _, plain = model.load_hf(path)
  expected = model.param_shardings(config, mesh)
  jax.tree.map(
    lambda x, s: x.sharding.is_equivalent_to(s, x.ndim) or pytest.fail(f"{x.sharding} != {s}"), params, expected
  )
  assert params["embed_tokens"]["embedding"].sharding.spec == P("tensor", "fsdp")
  assert params["layers"]["mlp"]["down_proj"]["kernel"].sharding.spec == P(None, "tensor", "fsdp")
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, plain)
  # Each device holds only its shard.
  up = params["layers"]["mlp"]["up_proj"]["kernel"]
  assert {s.data.shape for s in up.addressable_shards} == {(2, 32, 32)}


def test_initialize_distributed_is_noop_on_one_host(monkeypatch):
  for key in (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "TPU_WORKER_HOSTNAMES",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
  ):
    monkeypatch.delenv(key, raising=False)
  assert parallel.initialize_distributed() == (0, 1)
  assert not jax.distributed.is_initialized()
