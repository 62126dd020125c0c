"""The update step on 8 fake devices (data×fsdp×tensor sharding, FSDP with remat) equals one device."""

import jax
import numpy as np
import pytest

from aepo_jax.parallel import make_mesh
from aepo_jax.train._batch import shard_batch
from aepo_jax.train._logprob import make_logprob_fn
from aepo_jax.train._step import init_train_state, make_update_step
from test_step_fixtures import CFG, TEMPERATURE, host_params, max_abs_diff, rl_batch, sgd


M, N = 2, 16  # 2 micro-batches of 8 rows: rows split over up to 8 devices


def _one_step(config, mesh):
  step = make_update_step(
    config, loss_fn="ppo", optimizer=sgd(), micro_batches=M, mesh=mesh, temperature=TEMPERATURE, logprob_chunk=8
  )
  p, s = init_train_state(config, host_params(), sgd(), mesh)
  batch = shard_batch(rl_batch(M, n=N), mesh)
  lp, _ = make_logprob_fn(config, mesh, temperature=TEMPERATURE, chunk=8)(p, batch["tokens"], batch["attention_mask"])
  p, s, metrics = step(p, s, batch)
  return p, jax.device_get(p), jax.device_get(metrics), np.asarray(lp)


@pytest.fixture(scope="module")
def single_device():
  return _one_step(CFG, make_mesh((1, 1, 1), jax.devices()[:1]))


@pytest.mark.slow
@pytest.mark.parametrize("shape,remat", [({"data": 2, "fsdp": 2, "tensor": 2}, False), ({"fsdp": 8}, True)])
def test_sharded_step_matches_single_device(single_device, shape, remat):
  assert len(jax.devices()) >= 8, "tests/conftest.py should provide 8 fake CPU devices"
  _, ref_params, ref_metrics, ref_lp = single_device
  sharded, params, metrics, lp = _one_step(CFG.replace(remat=remat), make_mesh(shape, jax.devices()[:8]))
  # parameters really are split: the stacked q_proj kernel [L, embed, heads, head_dim] is sharded
  spec = sharded["layers"]["self_attn"]["q_proj"]["kernel"].sharding.spec
  assert "fsdp" in jax.tree.leaves(tuple(spec)), spec
  assert max_abs_diff(params, ref_params) <= 1e-5
  assert abs(metrics["train/loss"] - ref_metrics["train/loss"]) <= 1e-5
  assert abs(metrics["train/grad_norm"] - ref_metrics["train/grad_norm"]) <= 1e-5
  np.testing.assert_allclose(lp, ref_lp, atol=1e-5)
