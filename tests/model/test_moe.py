"""Qwen3-MoE: config and presets, routing and the two expert computations, logits and the export against
transformers' `Qwen3MoeForCausalLM`, the load-balancing loss against transformers' `load_balancing_loss_func`.
(The engine's decode step on the MoE model: tests/model/test_decode_parity.py, case 'qwen3_moe'.)

The tiny checkpoint (`testing.tiny_hf_checkpoint('qwen3_moe')`): 3 layers, the middle one dense (mlp_only_layers),
8 experts of width 32, top 2 renormalised. Tolerance (float32 logits of magnitude ~3): F32_TOL as in
test_hf_parity.py; measured ~3e-6 for both expert computations."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from aepo_jax import model, parallel, testing
from aepo_jax.model import _moe

F32_TOL = 1e-4  # max |Δlogits| against transformers, float32
GRAD_REL = 2e-4  # max |Δgrad| / max |grad| per parameter against torch autograd, float32 (test_grad_parity.py's)
IMPL_TOL = 1e-5  # max |Δ| between the ragged and the dense expert computations, float32 (measured <= 1.3e-6)


def _tokens(b=2, t=24, seed=0):
  return np.random.RandomState(seed).randint(3, 320, (b, t)).astype(np.int32)


def _hf_logits(path, tokens):
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  with torch.no_grad():
    return hf(torch.tensor(tokens)).logits.numpy()


def _tiny_moe_config(**kw):
  base = dict(
    family="qwen3_moe",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    qk_norm=True,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
  )
  return model.ModelConfig(**{**base, **kw})


def _expert_params(config, seed=0):
  d, e, f = config.hidden_size, config.num_experts, config.moe_intermediate_size
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  normal = lambda k, s: 0.1 * jax.random.normal(k, s, jnp.float32)  # noqa: E731
  return {
    "gate": {"kernel": normal(ks[0], (d, e))},
    "experts": {
      "gate_proj": {"kernel": normal(ks[1], (e, d, f))},
      "up_proj": {"kernel": normal(ks[2], (e, d, f))},
      "down_proj": {"kernel": normal(ks[3], (e, f, d))},
    },
  }


# ----------------------------------------------------------------------------------------------------
# Config and presets
# ----------------------------------------------------------------------------------------------------
def test_presets_have_the_published_sizes():
  """Qwen3-30B-A3B: 30.5B parameters, 3.3B active; Qwen3-235B-A22B: 235B, 22B (the model cards)."""
  for name, total, active in (("qwen3-30b-a3b", 30.5e9, 3.35e9), ("qwen3-235b-a22b", 235.1e9, 22.2e9)):
    c = model.preset(name)
    assert all(c.moe_layers) and not c.has_dense_mlp and c.router_aux_loss_coef == 0.0
    assert abs(c.num_params - total) / total < 0.01 and abs(c.num_active_params - active) / active < 0.01
  shapes = model.param_shapes(model.preset("qwen3-30b-a3b"))["layers"]["mlp"]
  assert set(shapes) == {"gate", "experts"}  # no dense MLP stored
  assert shapes["gate"]["kernel"].shape == (48, 2048, 128)
  assert shapes["experts"]["gate_proj"]["kernel"].shape == (48, 128, 2048, 768)
  assert shapes["experts"]["down_proj"]["kernel"].shape == (48, 128, 768, 2048)
  axes = model.param_logical_axes(model.preset("qwen3-30b-a3b"))["layers"]["mlp"]
  assert tuple(axes["experts"]["up_proj"]["kernel"]) == ("layers", "expert", "embed", "mlp")


def test_sparse_layers_follow_hf_rule():
  c = _tiny_moe_config(num_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
  assert c.moe_layers == (False, True, False, False, False, True) and c.mlp_only_layers == (3,)
  assert hash(c) == hash(_tiny_moe_config(num_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,)))
  dense = model.preset("qwen3-8b")
  assert not dense.has_experts and dense.num_params == dense.num_active_params


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(num_experts_per_tok=7), "num_experts_per_tok"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    (dict(mlp_only_layers=(2,)), "mlp_only_layers"),
    (dict(moe_impl="megablox"), "moe_impl"),
    (dict(num_experts=0), "qwen3_moe"),
    (dict(family="qwen3"), "qwen3_moe"),
  ],
)
def test_config_errors_name_the_field(kw, match):
  with pytest.raises(ValueError, match=match):
    _tiny_moe_config(**kw)


# ----------------------------------------------------------------------------------------------------
# Routing and experts
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", [True, False], ids=["norm_topk", "raw_topk"])
def test_router_matches_transformers(norm):
  from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

  config = _tiny_moe_config(norm_topk_prob=norm)
  hf_config = transformers.Qwen3MoeConfig(
    hidden_size=32, num_experts=6, num_experts_per_tok=2, norm_topk_prob=norm, moe_intermediate_size=16
  )
  router = Qwen3MoeTopKRouter(hf_config)
  torch.manual_seed(0)
  with torch.no_grad():
    router.weight.normal_(0.0, 0.3)
  x = np.random.RandomState(0).randn(40, 32).astype(np.float32)
  with torch.no_grad():
    _, ref_gates, ref_experts = router(torch.tensor(x))
  gates, experts = _moe.route(config, _moe.router_logits({"gate": {"kernel": router.weight.detach().numpy().T}}, x))
  np.testing.assert_array_equal(np.asarray(experts), ref_experts.numpy())
  np.testing.assert_allclose(np.asarray(gates), ref_gates.numpy(), rtol=1e-6, atol=1e-7)
  assert np.allclose(np.asarray(gates).sum(-1), 1.0) == norm


def test_ragged_gather_and_dense_experts_agree_with_gradients():
  """The expert computations: same outputs and same gradients (parameters and inputs), float32."""
  config = _tiny_moe_config(num_experts=8, num_experts_per_tok=3)
  p = _expert_params(config)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 13, config.hidden_size), jnp.float32)

  @jax.jit
  def run_both(p, x):
    out = []
    for impl in ("ragged", "dense", "gather"):
      loss = lambda p, x, impl=impl: jnp.sum(jnp.sin(_moe.moe(config, p, x, impl)))  # noqa: E731
      out.append((_moe.moe(config, p, x, impl), jax.grad(loss, argnums=(0, 1))(p, x)))
    return out

  (y_r, g_r), (y_d, g_d), (y_g, g_g) = run_both(p, x)
  assert y_r.shape == x.shape
  assert np.abs(np.asarray(y_r - y_d)).max() <= IMPL_TOL and np.abs(np.asarray(y_g - y_d)).max() <= IMPL_TOL
  for g in (g_r, g_g):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=IMPL_TOL), g, g_d)
  # every expert's weights got a gradient from the tokens routed to it (and only the router's top 3 of 8 per token)
  _, experts = _moe.route(config, _moe.router_logits(p, x.reshape(-1, config.hidden_size)))
  used = np.unique(np.asarray(experts))
  grads = np.abs(np.asarray(g_r[0]["experts"]["down_proj"]["kernel"])).sum(axis=(1, 2))
  assert (grads[used] > 0).all() and (grads[np.setdiff1d(np.arange(8), used)] == 0).all()


@pytest.mark.parametrize("impl", ["dense", "ragged"])
def test_sharded_forward_equals_unsharded(tiny_checkpoint, impl):
  """On a (fsdp 2, tensor 4) mesh of fake CPU devices: the experts replicated over the devices ('expert' has no
  mesh axis), their hidden units split over 'tensor', embed over 'fsdp'."""
  import flax.linen as nn
  from jax.sharding import NamedSharding, PartitionSpec as P

  config, params = model.load_hf(tiny_checkpoint("qwen3_moe"))
  config = config.replace(moe_impl=impl)
  tokens = _tokens(4, 16, seed=5)
  want = np.asarray(model.forward(config, params, tokens))
  mesh = parallel.make_mesh({"fsdp": 2, "tensor": 4}, jax.devices()[:8])
  sharded = parallel.shard_params(params, model.param_logical_axes(config), mesh)
  with mesh, nn.logical_axis_rules(parallel.DEFAULT_RULES):
    fwd = jax.jit(lambda p, x: model.forward(config, p, x))
    got = fwd(sharded, jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp")))))
  assert np.abs(np.asarray(got) - want).max() <= IMPL_TOL


def test_expert_impl_auto_on_cpu_is_gather_for_few_tokens_else_dense():
  """bench/moe_decode.py at Qwen3-30B-A3B's layer (E 128, k 8): 'gather' beats 'dense' up to 8 tokens (64 pairs),
  'dense' wins from 16 (128 pairs)."""
  config = _tiny_moe_config(num_experts=16, num_experts_per_tok=2)
  want = {"cpu": "dense", "tpu": "gmm"}.get(jax.default_backend(), "ragged")
  assert _moe.resolve_impl(config) == want
  if jax.default_backend() == "cpu":
    assert [_moe.resolve_impl(config, n) for n in (1, 4, 5, 64)] == ["gather", "gather", "dense", "dense"]
  assert _moe.resolve_impl(config.replace(moe_impl="ragged"), 1) == "ragged"


# ----------------------------------------------------------------------------------------------------
# HF import / export
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["dense", "ragged"])
def test_logits_match_transformers(tiny_checkpoint, impl):
  path = tiny_checkpoint("qwen3_moe")
  config, params = model.load_hf(path)
  assert config.family == "qwen3_moe" and config.moe_layers == (True, False, True) and config.norm_topk_prob
  mlp = params["layers"]["mlp"]
  assert not np.asarray(mlp["gate_proj"]["kernel"][0]).any()  # a sparse layer: no dense MLP in the checkpoint
  assert not np.asarray(mlp["experts"]["up_proj"]["kernel"][1]).any()  # the dense layer: no experts
  tokens = _tokens()
  ours = np.asarray(model.forward(config.replace(moe_impl=impl), params, tokens))
  assert np.abs(ours - _hf_logits(path, tokens)).max() <= F32_TOL


@pytest.mark.parametrize(
  "overrides",
  [
    dict(norm_topk_prob=False, mlp_only_layers=[]),
    dict(decoder_sparse_step=2, mlp_only_layers=[]),
    dict(num_experts_per_tok=1, mlp_only_layers=[]),
    dict(num_experts=12, num_experts_per_tok=8, mlp_only_layers=[]),
  ],
  ids=["every_layer_sparse_raw_topk", "sparse_step_2", "top1", "top8"],
)
def test_other_layouts_match_transformers(tmp_path, overrides):
  path = testing.tiny_hf_checkpoint("qwen3_moe", tmp_path / "ckpt", seed=3, **overrides)
  config, params = model.load_hf(path)
  assert config.moe_layers == tuple(not overrides.get("decoder_sparse_step") or i == 1 for i in range(3))
  tokens = _tokens(seed=1)
  ours = np.asarray(model.forward(config, params, tokens))
  assert np.abs(ours - _hf_logits(path, tokens)).max() <= F32_TOL


def test_export_round_trips_through_transformers(tiny_checkpoint, tmp_path):
  """save_hf (sharded) -> transformers loads it and gives our logits; load_hf reads back the same parameters, on a
  mesh too (the experts replicated, their hidden units over 'tensor')."""
  config, params = model.load_hf(tiny_checkpoint("qwen3_moe"))
  out = str(tmp_path / "export")
  model.save_hf(config, params, out, max_shard_bytes=64 * 1024)
  assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
  tokens = _tokens(seed=2)
  ours = np.asarray(model.forward(config, params, tokens))
  assert np.abs(ours - _hf_logits(out, tokens)).max() <= F32_TOL
  config2, params2 = model.load_hf(out)
  assert config2 == config
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)
  mesh = parallel.make_mesh({"fsdp": 2, "tensor": 2}, jax.devices()[:4])
  _, sharded = model.load_hf(out, mesh=mesh)
  experts = sharded["layers"]["mlp"]["experts"]["gate_proj"]["kernel"]  # [L, E, D, F]
  assert tuple(experts.sharding.spec) == (None, None, "fsdp", "tensor")
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, sharded)


def _per_expert(grads: dict) -> dict:
  """transformers' in-memory fused expert tensors (gate_up_proj [E, 2F, D], down_proj [E, D, F]) under the
  checkpoint's per-expert names."""
  out = {}
  for name, g in grads.items():
    if ".mlp.experts." not in name:
      out[name] = g
      continue
    prefix, kind = name.rsplit(".", 1)
    for e in range(g.shape[0]):
      if kind == "gate_up_proj":
        f = g.shape[1] // 2
        out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = g[e, :f], g[e, f:]
      else:
        out[f"{prefix}.{e}.down_proj.weight"] = g[e]
  return {n: g.contiguous() for n, g in out.items()}


@pytest.mark.parametrize("impl", ["dense", "ragged"])
def test_parameter_gradients_match_transformers(tiny_checkpoint, tmp_path, impl):
  """The training forward's gradients against torch autograd (the router's included), both expert computations;
  the dense layer's unused expert slots (and the sparse layers' dense slots) get exactly zero."""
  import shutil

  import safetensors.torch

  path = tiny_checkpoint("qwen3_moe")
  config, params = model.load_hf(path)
  config = config.replace(moe_impl=impl)
  tokens = _tokens(3, 12, seed=4)
  weights = np.random.RandomState(1).normal(size=(*tokens.shape, config.vocab_size)).astype(np.float32)
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  (hf(torch.tensor(tokens), use_cache=False).logits * torch.tensor(weights)).sum().backward()
  out_dir = tmp_path / "grads"
  out_dir.mkdir()
  grads = _per_expert({name: p.grad.detach() for name, p in hf.named_parameters()})
  safetensors.torch.save_file(grads, str(out_dir / "model.safetensors"))
  shutil.copy(os.path.join(path, "config.json"), out_dir)
  want = dict(jax.tree_util.tree_flatten_with_path(model.load_hf(str(out_dir))[1])[0])
  got = jax.jit(jax.grad(lambda p: jnp.sum(model.forward(config, p, tokens) * weights)))(params)
  for key, g in jax.tree_util.tree_flatten_with_path(got)[0]:
    w = np.asarray(want[key])
    err = np.abs(np.asarray(g) - w).max()
    assert err <= GRAD_REL * max(np.abs(w).max(), 1e-12), (jax.tree_util.keystr(key), err)


# ----------------------------------------------------------------------------------------------------
# Load-balancing loss
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("masked", [False, True], ids=["all_tokens", "padding_masked"])
def test_load_balancing_loss_matches_transformers(masked):
  from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

  b, t, e, k, layers = 3, 7, 8, 2, 2
  logits = np.random.RandomState(0).randn(layers, b * t, e).astype(np.float32) * 2
  mask = np.ones((b, t), np.int64)
  mask[1, :3] = 0
  mask[2, 5:] = 0
  hf_mask = torch.tensor(mask) if masked else None
  ref = load_balancing_loss_func(tuple(torch.tensor(x) for x in logits), e, k, hf_mask).item()
  ours = float(model.load_balancing_loss(logits, k, mask.reshape(-1) if masked else None))
  assert abs(ours - ref) <= 1e-5 * abs(ref)
  # balanced routing gives the minimum, k (every expert gets k / E of the assignments and 1 / E of the probability)
  assert abs(float(model.load_balancing_loss(np.zeros((1, 16, e), np.float32), k)) - k) < 1e-6


def test_the_forwards_balance_loss_and_its_router_gradient_match_transformers(tiny_checkpoint):
  """forward_hidden(router_stats=True) -> balance_loss against the `aux_loss` transformers' Qwen3MoeForCausalLM
  returns with output_router_logits (its load_balancing_loss_func over the sparse layers, padding masked), and the
  loss's gradient on each sparse layer's router against torch autograd; the dense middle layer gets none."""
  path = tiny_checkpoint("qwen3_moe")
  config, params = model.load_hf(path)
  tokens = _tokens(3, 12, seed=6)
  mask = np.ones(tokens.shape, np.int32)
  mask[1, 8:] = 0  # right padding: positions agree with transformers' default
  mask[2, 5:] = 0
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  out = hf(torch.tensor(tokens), attention_mask=torch.tensor(mask), output_router_logits=True, use_cache=False)
  out.aux_loss.backward()

  def ours(p):
    _, stats = model.forward_hidden(config, p, tokens, attention_mask_bt=mask, router_stats=True)
    return model.balance_loss(stats, config.num_experts_per_tok)

  value, grads = jax.jit(jax.value_and_grad(ours))(params)
  assert abs(float(value) - out.aux_loss.item()) <= 1e-5 * out.aux_loss.item(), (float(value), out.aux_loss.item())
  gate = np.asarray(grads["layers"]["mlp"]["gate"]["kernel"])  # [L, D, E]; HF's router weight is [E, D]
  for layer, sparse in enumerate(config.moe_layers):
    if not sparse:
      assert not gate[layer].any()
      continue
    want = hf.model.layers[layer].mlp.gate.weight.grad.numpy().T
    assert np.abs(gate[layer] - want).max() <= GRAD_REL * np.abs(want).max()
