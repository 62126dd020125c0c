"""Splash attention (aepo_jax/model/_splash.py), run in Pallas's interpret mode on CPU, against the XLA path
(`_decoder._attend_recompute`, itself checked against autodiff and transformers in test_grad_parity.py): values and
gradients for causal, packed and padded rows, in the full model, under a mesh through shard_map, inside a training
step, and the rules that select it.

Padding queries are left out of the comparison by definition (docs in _splash.py): the kernel's padding query
attends to the padding keys before it, the XLA path's to all keys (no valid key) or to the valid keys before it;
nothing reads those rows, so every loss below weights them 0 and their values are only required to be finite."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aepo_jax import model, parallel
from aepo_jax.model import ModelConfig, _decoder, _functional, _splash, init_params

REL = 1e-5  # max |Δ| / max |reference| in float32; measured <= 1.1e-6


def _config(impl="splash", d=64, heads=4, kv_heads=2, **kw):
  return ModelConfig(
    family="qwen3",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=heads,
    num_kv_heads=kv_heads,
    head_dim=d,
    qk_norm=True,
    attention_impl=impl,
    **{"splash_block_q": 128, "splash_block_kv": 128, **kw},
  )


def _rows(t):
  """[4, T] attention mask and segment ids: a full causal row, a packed row (3 sequences, then right padding), a
  left-padded row and a row with padding on both sides."""
  mask = np.ones((4, t), np.int32)
  seg = np.ones((4, t), np.int32)
  seg[1, : t // 3], seg[1, t // 3 : t // 2], seg[1, t // 2 :] = 1, 2, 3
  mask[1, t - 20 :] = 0
  mask[2, : t // 4 + 3] = 0
  mask[3, :5], mask[3, t - 9 :] = 0, 0
  return jnp.asarray(mask), jnp.asarray(seg)


def _inputs(b, t, h, kh, d, seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.normal(size=shape).astype(np.float32))  # noqa: E731
  return f(b, t, h, d), f(b, t, kh, d), f(b, t, kh, d), f(b, t, h, d)


def _xla(q, k, v, mask_bts):
  b, t, h, d = q.shape
  kh = k.shape[2]
  return _decoder._attend_recompute(q.reshape(b, t, kh, h // kh, d), k, v, mask_bts).reshape(b, t, h, d)


def _compare(got_fn, t=256, h=4, kh=2, d=64, config=None):
  """got_fn(q, k, v, seg_bt) against the XLA path on `_rows(t)`: outputs on valid rows and (q, k, v) gradients of a
  loss that weights only valid rows."""
  am, seg = _rows(t)
  q, k, v, w = _inputs(4, t, h, kh, d)
  valid = np.asarray(am > 0)
  w = w * am[:, :, None, None]
  ids = _splash.segment_ids(am, seg)
  mask = _functional._causal_mask(am * (seg > 0), seg)
  want, want_grads = jax.value_and_grad(lambda *a: jnp.sum(_xla(*a, mask) * w), argnums=(0, 1, 2))(q, k, v)
  got_out = jax.jit(got_fn)(q, k, v, ids)
  got, got_grads = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(got_fn(*a, ids) * w), argnums=(0, 1, 2)))(q, k, v)
  ref_out = np.asarray(_xla(q, k, v, mask))
  assert np.isfinite(np.asarray(got_out)).all()
  err = np.abs(np.asarray(got_out)[valid] - ref_out[valid]).max() / np.abs(ref_out[valid]).max()
  assert err <= REL, ("out", err)
  assert abs(float(got - want)) <= REL * abs(float(want)) + 1e-4
  for name, x, y in zip(("dq", "dk", "dv"), got_grads, want_grads):
    x, y = np.asarray(x), np.asarray(y)
    err = np.abs(x - y).max() / np.abs(y).max()
    assert err <= REL, (name, err)


@pytest.mark.parametrize("d", [64, 128])
def test_kernel_equals_the_xla_path_on_causal_packed_and_padded_rows(d):
  """Two 128-token blocks per row: the masked-out upper block is skipped, the diagonal ones are masked inside."""
  cfg = _config(d=d)
  _compare(lambda q, k, v, ids: _splash.attention(q, k, v, ids, cfg), d=d)


def test_rows_the_blocks_do_not_divide_are_padded():
  cfg = _config(splash_block_q=256, splash_block_kv=128)
  assert _splash._blocks(cfg, 200) == (256, 128, 256)
  assert _splash._blocks(cfg, 300) == (256, 128, 512)
  assert _splash._blocks(_config(splash_block_q=512, splash_block_kv=256), 300) == (384, 256, 768)
  _compare(lambda q, k, v, ids: _splash.attention(q, k, v, ids, cfg), t=200)


def test_model_logits_and_gradients_match_the_xla_path():
  """The full model (GQA, qk-norm, RoPE from positions that skip left padding) with left- and right-padded rows."""
  xla_cfg, spl_cfg = _config("xla"), _config("splash")
  params = init_params(xla_cfg, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, xla_cfg.vocab_size, (3, 40)), jnp.int32)
  mask = np.ones((3, 40), np.int32)
  mask[1, :9] = 0
  mask[2, 31:] = 0
  mask = jnp.asarray(mask)
  w = jnp.asarray(rng.normal(size=(3, 40, xla_cfg.vocab_size)).astype(np.float32)) * mask[..., None]

  def loss(cfg):
    return jax.jit(jax.value_and_grad(lambda p: jnp.sum(model.forward(cfg, p, tokens, None, mask) * w)))

  (lx, gx), (ls, gs) = loss(xla_cfg)(params), loss(spl_cfg)(params)
  assert abs(float(lx - ls)) <= 1e-5 * abs(float(lx)) + 1e-5
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(gx)[0], jax.tree.leaves(gs)):
    err = float(jnp.abs(a - b).max() / jnp.maximum(jnp.abs(a).max(), 1e-12))
    assert err <= 1e-4, (jax.tree_util.keystr(path), err)
  jaxpr = str(jax.make_jaxpr(lambda p: model.forward(spl_cfg, p, tokens, None, mask))(params))
  assert "pallas_call" in jaxpr and "pallas_call" not in str(
    jax.make_jaxpr(lambda p: model.forward(xla_cfg, p, tokens, None, mask))(params)
  )


@pytest.mark.parametrize(
  "shape, heads_sharded",
  [((2, 1, 2), True), ((1, 2, 4), False)],  # 2 KV heads over tensor=4: heads replicated
)
def test_under_a_mesh_the_kernel_runs_in_shard_map(shape, heads_sharded):
  mesh = parallel.make_mesh(shape, jax.devices()[: int(np.prod(shape))])
  cfg = _config()

  def fn(q, k, v, ids):
    with parallel.sharding_context(mesh):
      return _splash.attention(q, k, v, ids, cfg)

  with parallel.sharding_context(mesh):
    spec = parallel.activation_spec((4, 128, 4, 64), ("activation_batch", None, "activation_heads", None))
    kv_spec = parallel.activation_spec((4, 128, 2, 64), ("activation_batch", None, "activation_kv_heads", None))
  assert (spec[2] == kv_spec[2] == "tensor") is heads_sharded
  jaxpr = str(jax.make_jaxpr(fn)(*_inputs(4, 128, 4, 2, 64)[:3], jnp.ones((4, 128), jnp.int32)))
  assert "shard_map" in jaxpr and "pallas_call" in jaxpr
  _compare(fn, t=128)


def test_a_training_step_on_a_mesh_matches_the_xla_path():
  """The SFT step with packed rows on a (data 2, tensor 2) mesh: the loss, gradient norm and updated parameters."""
  import optax

  from aepo_jax.train._step import init_train_state, make_sft_step

  mesh = parallel.make_mesh((2, 1, 2), jax.devices()[:4])
  opt = optax.sgd(1e-1)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 128, (1, 4, 48))
  seg = np.repeat(np.array([1] * 20 + [2] * 18 + [0] * 10)[None], 4, 0)[None]
  seg[0, 1] = np.array([0] * 6 + [1] * 42)  # a row that starts with padding
  batch = {
    "tokens": jnp.asarray(tokens, jnp.int32),
    "attention_mask": jnp.asarray(seg > 0, jnp.int32),
    "loss_mask": jnp.asarray(seg > 0, jnp.int32),
    "segment_ids": jnp.asarray(seg, jnp.int32),
  }
  out = {}
  for impl in ("xla", "splash"):
    cfg = _config(impl)
    step = make_sft_step(cfg, optimizer=opt, micro_batches=1, mesh=mesh)
    params, opt_state = init_train_state(cfg, init_params(cfg, jax.random.PRNGKey(0)), opt, mesh)
    out[impl] = step(params, opt_state, batch)
  (px, _, mx), (ps, _, ms) = out["xla"], out["splash"]
  for key in ("sft/nll", "train/grad_norm"):
    assert abs(float(mx[key] - ms[key])) <= 1e-5 * abs(float(mx[key])), key
  for a, b in zip(jax.tree.leaves(px), jax.tree.leaves(ps)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def _fake_mesh(platform, n=4):
  return types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform=platform)] * n))


def test_auto_resolves_to_splash_on_tpu_only():
  cfg = _config("auto")
  assert model.resolve_attention_impl(cfg, _fake_mesh("tpu")).attention_impl == "splash"
  assert model.resolve_attention_impl(cfg, _fake_mesh("tpu", 1)).attention_impl == "splash"
  assert model.resolve_attention_impl(cfg, _fake_mesh("gpu")).attention_impl == "xla"
  assert model.resolve_attention_impl(cfg.replace(dtype="float64"), _fake_mesh("tpu")).attention_impl == "xla"
  assert model.resolve_attention_impl(cfg.replace(attention_impl="xla"), _fake_mesh("tpu")).attention_impl == "xla"
  two_cpus = parallel.make_mesh((2, 1, 1), jax.devices()[:2])
  assert model.resolve_attention_impl(cfg, two_cpus).attention_impl == "xla"
  for bad in (0, 100, 192.0):
    with pytest.raises(ValueError, match="splash_block_q"):
      cfg.replace(splash_block_q=bad)
