"""init_params draws all its normal values at once instead of letting flax draw per leaf (compile time); it must
still give the tree, dtypes, logical axes and initial distribution that the modules' own initializers declare."""

import jax
import flax.linen as nn
import numpy as np
import pytest

from aepo_jax import model
from aepo_jax.model import _functional

SMALL = dict(
  num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=512
)


# qwen2: q/k/v biases and an untied LM head; qwen3: q/k norms, tied, bfloat16 parameters; qwen3-moe: router and
# stacked experts beside a dense MLP (a dense layer among sparse ones).
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": (1,)}


@pytest.mark.parametrize(
  "name,extra",
  [
    ("qwen2.5-0.5b", {"tie_word_embeddings": False}),
    ("qwen3-4b", {"param_dtype": "bfloat16"}),
    ("qwen3-30b-a3b", MOE),
  ],
)
def test_init_params_follows_the_modules_initializers(name, extra):
  cfg = model.preset(name, **SMALL, **extra)
  ours = model.init_params(cfg, jax.random.PRNGKey(3))
  flax_own = _functional._flax_init(cfg, jax.random.PRNGKey(3), boxed=False)
  assert jax.tree.structure(ours) == jax.tree.structure(flax_own)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ours)[0], jax.tree.leaves(flax_own)):
    where = jax.tree_util.keystr(path)
    assert a.shape == b.shape and a.dtype == b.dtype, where
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if np.all(b == 1.0) or np.all(b == 0.0):  # unit norm scales, zero biases
      np.testing.assert_array_equal(a, b, err_msg=where)
    else:  # normal(0.02): same law (n >= 1024 draws per leaf here), different draws
      assert abs(a.std() - 0.02) < 0.002 and abs(b.std() - 0.02) < 0.002, where
      assert abs(a.mean()) < 0.003, where
  # boxed: the same values under flax's logical-axis boxes
  boxed = model.init_params(cfg, jax.random.PRNGKey(3), boxed=True)
  assert nn.get_partition_spec(boxed) == model.param_logical_axes(cfg)
  jax.tree.map(np.testing.assert_array_equal, nn.unbox(boxed), ours)


def test_init_params_is_deterministic_and_seeded():
  cfg = model.preset("smollm2-135m", **SMALL)
  a, b = model.init_params(cfg, jax.random.PRNGKey(0)), model.init_params(cfg, jax.random.PRNGKey(0))
  c = model.init_params(cfg, jax.random.PRNGKey(1))
  jax.tree.map(np.testing.assert_array_equal, a, b)
  assert not np.array_equal(a["embed_tokens"]["embedding"], c["embed_tokens"]["embedding"])
  # leaves are independent draws, not copies of one another
  q, k = a["layers"]["self_attn"]["q_proj"]["kernel"], a["layers"]["self_attn"]["k_proj"]["kernel"]
  assert not np.array_equal(np.ravel(q)[:64], np.ravel(k)[:64])
