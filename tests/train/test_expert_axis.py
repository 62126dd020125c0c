"""mesh.expert_axis: the trainer's switch for expert parallelism (model/_expert_parallel.py `experts_parallel`). Its
rules table (`_config.mesh_rules`) places the stacked experts whole over the named batch axes in every program the
trainer builds from the config (parameters, optimizer state, the RL update and the SFT step); bad values and a dense
model are refused by name. End to end (a tiny Qwen3-MoE RL run with experts over fsdp):
tests/train/test_routing_replay_train.py."""

import jax
import optax
import pytest
from jax.sharding import PartitionSpec

from aepo_jax import model, parallel
from aepo_jax.parallel import make_mesh
from aepo_jax.testing import tiny_model_config
from aepo_jax.train import ConfigError, _config, _objective, _sft, base_config, validate

MOE = tiny_model_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def _cfg(axis, name="qwen3-30b-a3b"):
  config = base_config()
  config.model.name = name
  config.mesh.expert_axis = axis
  return config


def test_the_default_keeps_every_expert_on_every_device():
  assert base_config().mesh.expert_axis == ""
  assert _config.mesh_rules(base_config()) == parallel.DEFAULT_RULES


@pytest.mark.parametrize(
  "axis, spec, embed", [("fsdp", "fsdp", None), ("data", "data", "fsdp"), ("data,fsdp", ("data", "fsdp"), None)]
)
def test_expert_axis_splits_the_stacked_experts_over_it(axis, spec, embed):
  rules = _config.mesh_rules(_cfg(axis))
  assert rules == parallel.expert_parallel_rules(spec)
  mesh = make_mesh((2, 2, 2), jax.devices()[:8])
  sh = model.param_shardings(MOE, mesh, rules)["layers"]["mlp"]
  # [L, E, D, F]: experts over `axis`, F still over tensor, D over fsdp unless the experts took it
  assert sh["experts"]["gate_proj"]["kernel"].spec == PartitionSpec(None, spec, embed, "tensor")
  assert sh["experts"]["down_proj"]["kernel"].spec == PartitionSpec(None, spec, "tensor", embed)
  dense = model.param_shardings(MOE, mesh)["layers"]["mlp"]["experts"]["gate_proj"]["kernel"]
  assert dense.spec == PartitionSpec(None, None, "fsdp", "tensor")


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def test_the_trainers_programs_place_the_experts_by_the_configs_rules():
  """The RL update and the SFT step built from a config with mesh.expert_axis='fsdp' return parameters and Adam
  moments with the experts split over fsdp (lowered, not compiled: the shardings are the programs' own)."""
  config = _cfg("fsdp")
  mesh = make_mesh((1, 4, 2), jax.devices()[:8])
  opt = optax.adam(1e-3)
  params = _abstract(model.param_shapes(MOE))
  opt_state = _abstract(jax.eval_shape(opt.init, model.param_shapes(MOE)))
  rl = _objective.make_rl_update_step(config, MOE, opt, mesh)
  micro = config.train.ppo_mini_batch_size * config.rollout.n // config.train.micro_batch_size
  rl_batch = {
    k: jax.ShapeDtypeStruct((micro, 8, 16), "float32" if k in ("advantages", "old_log_prob") else "int32")
    for k in _objective.update_batch_keys(config)
  }
  sft, sft_micro = _sft.make_step(config, MOE, opt, mesh)
  sft_batch = {k: jax.ShapeDtypeStruct((sft_micro, 8, 16), "int32") for k in ("tokens", "attention_mask", "loss_mask")}
  for step, batch in ((rl, rl_batch), (sft, sft_batch)):
    new_params, new_opt = step.trace(params, opt_state, batch).lower().out_info[:2]
    experts = new_params["layers"]["mlp"]["experts"]
    assert experts["gate_proj"]["kernel"].sharding.spec == PartitionSpec(None, "fsdp", None, "tensor")
    assert experts["down_proj"]["kernel"].sharding.spec == PartitionSpec(None, "fsdp", "tensor", None)
    mu = new_opt[0].mu["layers"]["mlp"]["experts"]["up_proj"]["kernel"]
    assert mu.sharding.spec == PartitionSpec(None, "fsdp", None, "tensor")


def test_bad_values_and_dense_models_are_refused_by_name():
  with pytest.raises(ConfigError, match=r"mesh.expert_axis='tensor': use one of"):
    validate(_cfg("tensor"))
  with pytest.raises(ConfigError, match=r"mesh.expert_axis='fsdp', but model 'qwen3-0.6b' has no experts"):
    validate(_cfg("fsdp", name="qwen3-0.6b"))
  validate(_cfg("fsdp"))
