"""The router's load-balancing loss in training (`ModelConfig.router_aux_loss_coef`, 0 by default): the SFT and RL
update steps of a tiny random Qwen3-MoE policy add coef x the mean over micro-batches of each one's balance loss
over its valid tokens, report it (sft/router_aux_loss, actor/router_aux_loss), and with plain SGD move the parameters
by exactly the extra gradient: (params(coef) - params(0)) / -lr = coef x grad of that mean. The loss itself against
transformers: tests/model/test_moe.py."""

import jax
import numpy as np
import optax
import pytest

from aepo_jax import model
from aepo_jax.parallel import make_mesh
from aepo_jax.testing import tiny_model_config
from aepo_jax.train._batch import micro_batches, shard_batch
from aepo_jax.train._step import init_train_state, make_sft_step, make_update_step

MOE = tiny_model_config(
  "qwen3_moe", vocab_size=96, num_layers=2, mlp_only_layers=(1,), num_experts=6, num_experts_per_tok=2,
  moe_intermediate_size=16,
)  # fmt: skip
COEF, LR = 0.5, 1.0


def _arrays(n=8, t=12, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, MOE.vocab_size, (n, t)).astype(np.int32)
  attn = (np.arange(t)[None] < rng.integers(6, t + 1, (n, 1))).astype(np.int32)
  loss = attn * (np.arange(t)[None] >= 3)
  return {
    "tokens": tokens,
    "attention_mask": attn,
    "loss_mask": loss,
    "advantages": rng.normal(size=(n, 1)).astype(np.float32) * loss,
    "old_log_prob": np.full((n, t), -4.5, np.float32) * loss,
  }


def _mean_balance_loss(params, arrays, rows):
  """The mean over micro-batches of `rows` rows of each one's balance loss (the model's own functions)."""

  def one(p, tokens, attn):
    _, stats = model.forward_hidden(MOE, p, tokens, attention_mask_bt=attn, router_stats=True)
    return model.balance_loss(stats, MOE.num_experts_per_tok)

  n = arrays["tokens"].shape[0]
  starts = range(0, n, rows)
  loss = lambda p: sum(one(p, arrays["tokens"][s : s + rows], arrays["attention_mask"][s : s + rows]) for s in starts)  # noqa: E731
  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  return float(value) / len(starts), jax.tree.map(lambda g: np.asarray(g) / len(starts), grads)


@pytest.mark.parametrize("kind", ["sft", "rl"])
def test_the_steps_add_the_balance_loss_and_its_gradient(kind):
  params0 = model.init_params(MOE, jax.random.PRNGKey(0))
  arrays = _arrays()
  if kind == "sft":
    arrays = {k: arrays[k] for k in ("tokens", "attention_mask", "loss_mask")}
  mesh = make_mesh((1, 1, 1), jax.devices()[:1])
  batch = shard_batch(micro_batches(arrays, micro_batch_size=4, pad_id=0, seq_len=12), mesh)
  opt = optax.sgd(LR)
  out = {}
  for coef in (0.0, COEF):
    cfg = MOE.replace(router_aux_loss_coef=coef)
    if kind == "sft":
      step = make_sft_step(cfg, optimizer=opt, micro_batches=2, mesh=mesh)
    else:
      step = make_update_step(cfg, loss_fn="ppo", optimizer=opt, micro_batches=2, mesh=mesh)
    p, o = init_train_state(cfg, params0, opt, mesh)
    new_p, _, metrics = step(p, o, batch)
    out[coef] = jax.device_get(new_p), jax.device_get(metrics)
  key = "sft/router_aux_loss" if kind == "sft" else "actor/router_aux_loss"
  assert key not in out[0.0][1]
  want, grads = _mean_balance_loss(params0, arrays, rows=4)
  assert want >= MOE.num_experts_per_tok * 0.999  # k at perfect balance, more otherwise
  assert abs(float(out[COEF][1][key]) - want) <= 1e-5 * want
  assert abs(float(out[COEF][1]["train/loss"]) - float(out[0.0][1]["train/loss"]) - COEF * want) <= 1e-4
  moved = jax.tree.map(lambda a, b: (a - b) / -LR, out[COEF][0], out[0.0][0])
  for (path, got), want_g in zip(jax.tree_util.tree_flatten_with_path(moved)[0], jax.tree.leaves(grads)):
    scale = max(np.abs(COEF * want_g).max(), 1e-6)
    assert np.abs(got - COEF * want_g).max() <= 1e-3 * scale, jax.tree_util.keystr(path)
  gate = grads["layers"]["mlp"]["gate"]["kernel"]
  assert np.abs(gate[0]).max() > 0 and not gate[1].any()  # the routers of the sparse layers; the dense one has none


def test_the_config_refuses_a_negative_weight_and_a_dense_model():
  from aepo_jax.train import ConfigError, base_config, validate

  config = base_config()
  config.model.name = "qwen3-30b-a3b"
  with config.model.overrides.unlocked():
    config.model.overrides.router_aux_loss_coef = 0.001
  validate(config)
  config.model.overrides.router_aux_loss_coef = -1.0
  with pytest.raises(ConfigError, match=r"router_aux_loss_coef=-1.0: use a weight >= 0"):
    validate(config)
  config.model.overrides.router_aux_loss_coef = 0.001
  config.model.name = "qwen3-0.6b"
  with pytest.raises(ConfigError, match=r"router_aux_loss_coef=0.001, but model 'qwen3-0.6b' has no experts"):
    validate(config)
