"""model.init='checkpoint': a training run starts from another run's Orbax checkpoint (e.g. RL from an SFT run),
its parameters read straight into their shardings, its model config and tokenizer the ones that run saved."""

import jax
import numpy as np
import pytest

from aepo_jax import train
from aepo_jax.parallel import make_mesh
from aepo_jax.train import _inputs, _preflight_model


def _config(name, **kw):
  c = train.base_config()
  c.model.init, c.model.name = "checkpoint", name
  for k, v in kw.items():
    train.set_key(c, k, v)
  return c


def test_the_parameters_config_and_tokenizer_of_the_checkpoint_land_on_the_mesh(orbax_ckpt, tiny_config, tiny_params):
  mesh = make_mesh((2, 2, 2))  # fsdp and tensor both shard (the tests run on 8 CPU devices)
  cfg, params, tok = _inputs.load_model(_config(orbax_ckpt), mesh)
  assert cfg == tiny_config.replace(dtype="float32", param_dtype="float32", remat=False)
  assert tok is not None and tok.vocab_size == tiny_config.vocab_size
  flat = jax.tree_util.tree_leaves_with_path(params)
  assert all(x.sharding.mesh.shape == mesh.shape for _, x in flat)  # placed by the rules table on the mesh
  assert any(not x.sharding.is_fully_replicated for _, x in flat)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), tiny_params)


def test_a_path_that_is_not_a_training_checkpoint_is_named_with_the_fix(tmp_path, orbax_ckpt):
  problems = []

  class P:
    def add(self, msg):
      problems.append(msg)

  _preflight_model._model(_config(str(tmp_path / "missing")), P())
  assert problems and "model.name (model.init='checkpoint')" in problems[0] and "does not exist" in problems[0]
  problems.clear()
  _preflight_model._model(_config(orbax_ckpt), P())
  assert problems == []
  with pytest.raises(train.ConfigError, match="use 'pretrained', 'random' or 'checkpoint'"):
    train.validate(_config(orbax_ckpt, **{"model.init": "ckpt"}))
