"""What the pod's programs contain, read from their lowered and compiled HLO on 8 fake CPU devices:

* the decoder's activation constraints take effect when a step is traced (rows over data x fsdp, heads and the
  MLP's hidden units over tensor), and are absent outside a sharding context;
* no buffer of the compiled update program holds all global rows of a micro-batch on one device;
* the engine's decode program, on a host's tensor-parallel rollout mesh, all-gathers no layer weight inside its
  loop (on an fsdp mesh, the old placement, it does: the check can fail);
* a model loads straight onto the mesh, in shards (random init, HF safetensors), with no parameter whole on one
  device;
* a host-local copy of global parameters (`parallel.to_host_local`) equals them, in the rollout dtype.
"""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aepo_jax import model as model_lib
from aepo_jax.parallel import local_mesh, make_mesh, to_host_local
from aepo_jax.train import _optim, _step
from aepo_jax.train._batch import batch_sharding

# Sizes chosen to be recognisable in HLO shapes: 24 global rows per micro-batch (3 per device over data x fsdp = 8,
# or 6 over 4), 40 tokens; no model dimension is 24, 40 or 960 (= 24 x 40).
CFG = model_lib.preset(
  "qwen3-0.6b",
  num_layers=2,
  hidden_size=64,
  intermediate_size=176,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
  vocab_size=320,
)
ROWS, T = 24, 40


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _lowered_update(mesh):
  opt = _optim.make_optimizer(1e-3)
  step = _step.make_update_step(CFG, loss_fn="ppo", optimizer=opt, micro_batches=1, mesh=mesh)
  params = _abstract(model_lib.param_shapes(CFG), model_lib.param_shardings(CFG, mesh))
  opt_state = _abstract(
    jax.eval_shape(opt.init, model_lib.param_shapes(CFG)), _step.opt_state_shardings(CFG, opt, mesh)
  )
  b_sh = batch_sharding(mesh)
  batch = {
    k: jax.ShapeDtypeStruct(
      (1, ROWS, T), jnp.int32 if k in ("tokens", "attention_mask", "loss_mask") else jnp.float32, sharding=b_sh
    )
    for k in ("tokens", "attention_mask", "loss_mask", "old_log_prob", "advantages")
  }
  return step.lower(params, opt_state, batch)


def _constraints(text):
  """(mesh axes per dimension, shape) of every sharding constraint in lowered StableHLO/Shardy text."""
  out = []
  for line in text.splitlines():
    if "sharding_constraint" not in line:
      continue
    axes = re.search(r"<@\w+, \[(.*?)\]>", line)
    shape = re.findall(r"tensor<([\dx]+)x[a-z]+\d*>", line)
    if axes and shape:
      out.append((axes.group(1).replace('"', "").replace(" ", ""), shape[-1]))
  return out


@pytest.fixture(scope="module")
def mesh_2x2x2():
  return make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


def test_activation_constraints_take_effect_in_the_lowered_update_step(mesh_2x2x2, monkeypatch):
  found = _constraints(_lowered_update(mesh_2x2x2).as_text())
  heads = [a for a, s in found if s in ("24x40x4x16", "24x40x2x16")]  # q and k/v heads over tensor
  hidden = [a for a, s in found if s == "960x176"]  # the MLP's hidden units over tensor, rows over data x fsdp
  residual = [a for a, s in found if s == "24x40x64"]
  assert heads and all(a == "{data,fsdp},{},{tensor},{}" for a in heads), found
  assert hidden and all(a == "{data,fsdp},{tensor}" for a in hidden), found
  assert residual and all(a == "{data,fsdp},{},{}" for a in residual), found
  # Outside a sharding context the decoder adds none (what the step looked like before it set one).
  monkeypatch.setattr(_step, "sharding_context", lambda *a, **k: contextlib.nullcontext())
  bare = _constraints(_lowered_update(mesh_2x2x2).as_text())
  assert not [s for _, s in bare if s in ("24x40x4x16", "960x176", "24x40x64")], bare


def test_no_buffer_of_the_update_step_holds_all_global_rows(mesh_2x2x2):
  hlo = _lowered_update(mesh_2x2x2).compile().as_text()
  assert re.findall(r"\[6,40[,\]]", hlo), "expected per-device row blocks of 6 (24 rows / data x fsdp = 4)"
  whole = sorted(set(re.findall(r"\w+\[(?:24,40|960)[,\]][^\s]*", hlo)))
  assert not whole, f"buffers with all {ROWS} global rows on one device: {whole[:10]}"


def _decode_all_gathers(mesh):
  """Shapes of the all-gathers inside the while loops of the compiled decode program on `mesh`."""
  from aepo_jax.rollout import Engine

  engine = Engine(CFG, max_slots=8, max_len=64, eos_ids=(0,), mesh=mesh, cpu_kernels=False)
  weights = _abstract(model_lib.param_shapes(CFG), model_lib.param_shardings(CFG, mesh))
  hlo = engine.lower_decode(weights, 4).compile().as_text()
  bodies = {m.group(1) for m in re.finditer(r"while\(.*?body=(%?[\w.\-]+)", hlo)}
  assert bodies, "no while loop in the decode program"
  shapes, current = [], None
  for line in hlo.splitlines():
    head = re.match(r"^\s*(?:ENTRY\s+)?(%?[\w.\-]+)\s.*\{\s*$", line)
    if head:
      current = head.group(1)
    elif current is not None and current.lstrip("%") in {b.lstrip("%") for b in bodies} and " all-gather(" in line:
      shapes.append(re.search(r"=\s*(\w+\[[\d,]*\])", line).group(1))
  return shapes


def _weight_shapes():
  shapes = set()
  for x in jax.tree.leaves(model_lib.param_shapes(CFG)):
    for s in (x.shape, x.shape[1:]):  # stacked [L, ...] and one layer's slice
      shapes.add("[" + ",".join(map(str, s)) + "]")
  return shapes


def test_decode_loop_gathers_no_layer_weight_on_a_tensor_parallel_rollout_mesh():
  weights = _weight_shapes()
  tensor = local_mesh({"data": 1, "fsdp": 1, "tensor": 2}, jax.devices()[:2])
  gathered = [s for s in _decode_all_gathers(tensor) if s[s.index("[") :] in weights]
  assert not gathered, f"weights all-gathered inside the decode loop: {gathered}"
  # The engine on an fsdp mesh (weights split like the training state) gathers them every step: the check sees it.
  fsdp = local_mesh({"data": 1, "fsdp": 2, "tensor": 1}, jax.devices()[:2])
  assert [s for s in _decode_all_gathers(fsdp) if s[s.index("[") :] in weights]


@pytest.mark.parametrize("source", ["random", "hf"])
def test_model_loads_sharded_onto_the_mesh(tmp_path, source):
  from aepo_jax.train import base_config
  from aepo_jax.train._inputs import load_model

  mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  config = base_config()
  if source == "random":
    config.model.init, config.model.name = "random", "qwen3-0.6b"
    config.model.overrides.update(
      dict(
        num_layers=2, hidden_size=64, intermediate_size=176, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=320
      )
    )
    config.model.tokenizer = ""
  else:
    from aepo_jax.testing import tiny_hf_checkpoint, tiny_tokenizer

    config.model.name = tiny_hf_checkpoint("qwen3", tmp_path / "hf")
    config.model.tokenizer = tiny_tokenizer(tmp_path / "tok")
  cfg, params, _ = load_model(config, mesh)
  expected = model_lib.param_shardings(cfg, mesh)
  for (path, x), sh in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(expected)):
    assert len(x.sharding.device_set) == 8, (path, x.sharding)  # on the whole mesh, never one device
    assert x.sharding.is_equivalent_to(sh, x.ndim), (path, x.sharding, sh)
  big = [x for x in jax.tree.leaves(params) if x.size >= 4096]  # the matrices (norm scales stay replicated)
  assert big and all(
    np.prod(x.sharding.shard_shape(x.shape)) < np.prod(x.shape) for x in big
  )  # each device holds a part


def test_host_local_copy_equals_the_global_parameters():
  mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  params = jax.jit(lambda k: model_lib.init_params(CFG, k), out_shardings=model_lib.param_shardings(CFG, mesh))(
    jax.random.PRNGKey(0)
  )
  rollout_mesh = local_mesh({"data": 1, "fsdp": 1, "tensor": 2}, jax.devices()[:2])
  shardings = model_lib.param_shardings(CFG.replace(param_dtype="bfloat16"), rollout_mesh)
  local = to_host_local(params, shardings, "bfloat16")
  for x, y, s in zip(jax.tree.leaves(params), jax.tree.leaves(local), jax.tree.leaves(shardings)):
    assert y.dtype == jnp.bfloat16 and y.sharding.is_equivalent_to(s, y.ndim)
    np.testing.assert_array_equal(np.asarray(x.astype(jnp.bfloat16)), np.asarray(y))
  same = to_host_local(params, model_lib.param_shardings(CFG, mesh))  # already there: the same arrays, no copy
  assert all(a is b for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(same)))
