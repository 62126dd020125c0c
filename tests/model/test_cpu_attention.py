"""The CPU training-attention kernel (aepo_jax/model/_cpu_attention.py): values and gradients against the XLA
path (`_decoder._attend_recompute`, itself checked against autodiff and transformers in test_grad_parity.py)
for causal, padded, packed and empty-row masks, inside the full model, and the rules that select it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aepo_jax import model
from aepo_jax.model import ModelConfig, _cpu_attention, _decoder, init_params
from aepo_jax.parallel import _native, make_mesh

if not {"avx2", "fma"} <= _native.cpu_flags():
  pytest.skip("the CPU kernels need AVX2 and FMA", allow_module_level=True)

REL = 1e-5  # max |Δ| / max |reference| in float32; measured <= 2e-6


def _inputs(b, t, kh, g, d, seed):
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.normal(size=shape).astype(np.float32))  # noqa: E731
  return f(b, t, kh * g, d), f(b, t, kh, d), f(b, t, kh, d), f(b, t, kh * g, d)


def _mask(b, t, kind):
  causal = np.tril(np.ones((t, t), bool))[None].repeat(b, 0)
  if kind == "causal":
    return causal
  if kind == "left_pad":  # row 0: 5 pad tokens first, so its first 5 query rows see no key
    valid = np.ones((b, t), bool)
    valid[0, :5] = False
    return causal & valid[:, None, :]
  if kind == "right_pad":
    valid = np.ones((b, t), bool)
    valid[-1, t - 7 :] = False
    return causal & valid[:, None, :] & valid[:, :, None]
  if kind == "packed":  # three segments per row: block-diagonal causal
    seg = np.minimum(np.arange(t) // max(1, t // 3), 2)
    return causal & (seg[:, None] == seg[None, :])[None]
  if kind == "random":  # any mask the kernel is given: no structure assumed
    return np.random.default_rng(7).random((b, t, t)) < 0.3
  raise ValueError(kind)


def _check(b, t, kh, g, d, kind, seed=0, mask=None):
  q, k, v, dout = _inputs(b, t, kh, g, d, seed)
  mask = jnp.asarray(_mask(b, t, kind) if mask is None else mask)
  ref = lambda q, k, v: _decoder._attend_recompute(  # noqa: E731
    q.reshape(b, t, kh, g, d), k, v, mask
  ).reshape(b, t, kh * g, d)
  ker = lambda q, k, v: _cpu_attention.attention(q, k, v, mask)  # noqa: E731
  want, want_vjp = jax.vjp(ref, q, k, v)
  got, got_vjp = jax.vjp(ker, q, k, v)
  for name, x, y in zip(("out", "dq", "dk", "dv"), (got, *got_vjp(dout)), (want, *want_vjp(dout))):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == np.float32 and x.shape == y.shape
    err = np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)  # all-zero dq when every row is masked
    assert err <= REL, (name, kind, err)


def test_kernel_builds_and_loads():
  assert _cpu_attention.available(), _cpu_attention.reason()


@pytest.mark.parametrize("kind", ["causal", "left_pad", "right_pad", "packed", "random"])
@pytest.mark.parametrize(
  "b,t,kh,g,d",
  [(2, 37, 2, 3, 16), (3, 50, 3, 3, 64), (1, 16, 1, 1, 32), (2, 70, 1, 7, 16), (1, 5, 1, 2, 16), (2, 33, 2, 2, 128)],
)
def test_values_and_gradients_match_xla(b, t, kh, g, d, kind):
  _check(b, t, kh, g, d, kind)


def test_smollm2_shape_with_left_padding():
  _check(8, 256, 3, 3, 64, "left_pad", seed=3)


def test_row_without_any_valid_key_is_uniform_like_xla():
  """A query row whose mask is all false: uniform probabilities over every key, no score gradient."""
  b, t, kh, g, d = 2, 20, 2, 2, 16
  q, k, v, _ = _inputs(b, t, kh, g, d, 1)
  mask = np.tril(np.ones((t, t), bool))[None].repeat(b, 0)
  mask[1, 4] = False
  out = _cpu_attention.attention(q, k, v, jnp.asarray(mask))
  np.testing.assert_allclose(out[1, 4], jnp.repeat(v[1].mean(axis=0), g, axis=0), rtol=1e-5, atol=1e-6)
  dq = jax.grad(lambda q: jnp.sum(_cpu_attention.attention(q, k, v, jnp.asarray(mask)) ** 2))(q)
  assert not np.any(np.asarray(dq[1, 4])) and np.all(np.any(np.asarray(dq[1, 5:]) != 0, axis=-1))
  _check(b, t, kh, g, d, "causal", seed=1, mask=mask)


@pytest.mark.parametrize("pads", [(40, 17), (70, 16), (70, 70)])
def test_long_left_padding_whole_blocks_of_empty_rows(pads):
  """Left padding longer than a 16-query block: whole blocks of empty rows (no key range at all), blocks mixing
  empty and attending rows, and a batch row with no valid key anywhere. Empty rows stay out of the GEMM key ranges;
  their output (mean of v) and their dO's share of dV (dO / S on every key) must still match the XLA path."""
  b, t, kh, g, d = 2, 70, 2, 3, 16
  valid = np.ones((b, t), bool)
  for row, p in enumerate(pads):
    valid[row, :p] = False
  mask = np.tril(np.ones((t, t), bool))[None].repeat(b, 0) & valid[:, None, :]
  _check(b, t, kh, g, d, "causal", seed=4, mask=mask)


def test_more_keys_than_queries():
  """T != S (the kernel reads the key range from the mask; the decoder passes T == S today)."""
  b, t, s, kh, g, d = 2, 20, 37, 2, 3, 16
  rng = np.random.default_rng(5)
  f = lambda *shape: jnp.asarray(rng.normal(size=shape).astype(np.float32))  # noqa: E731
  q, k, v, dout = f(b, t, kh * g, d), f(b, s, kh, d), f(b, s, kh, d), f(b, t, kh * g, d)
  mask = jnp.asarray(np.tril(np.ones((t, s), bool), s - t)[None].repeat(b, 0))
  ref = lambda q, k, v: _decoder._attend_recompute(q.reshape(b, t, kh, g, d), k, v, mask).reshape(q.shape)  # noqa: E731
  want, want_vjp = jax.vjp(ref, q, k, v)
  got, got_vjp = jax.vjp(lambda q, k, v: _cpu_attention.attention(q, k, v, mask), q, k, v)
  for x, y in zip((got, *got_vjp(dout)), (want, *want_vjp(dout))):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)


def test_bad_inputs_are_named():
  q, k, v, _ = _inputs(1, 8, 2, 2, 16, 0)
  mask = jnp.ones((1, 8, 8), bool)
  with pytest.raises(ValueError, match="mask"):
    _cpu_attention.attention(q, k, v, mask[:, :, :4])
  with pytest.raises(TypeError, match="float32 only"):
    _cpu_attention.attention(q.astype(jnp.bfloat16), k, v, mask)
  with pytest.raises(ValueError, match="head_dim"):
    _cpu_attention.attention(q[..., :8], k[..., :8], v[..., :8], mask)


def _tiny(impl, family="qwen2"):
  return ModelConfig(
    family=family,
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    attention_bias=family == "qwen2",
    qk_norm=family == "qwen3",
    attention_impl=impl,
  )


def test_model_logits_and_gradients_match_the_xla_path(family="qwen3"):
  """One family here (qk-norm, GQA); every family's parameter gradients with the kernel are checked against
  transformers' autograd in test_grad_parity.py."""
  xla_cfg, ker_cfg = _tiny("xla", family), _tiny("cpu_kernel", family)
  params = init_params(xla_cfg, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, xla_cfg.vocab_size, (3, 24)), jnp.int32)
  mask = np.ones((3, 24), np.int32)
  mask[1, :6] = 0
  mask[2, 17:] = 0
  mask = jnp.asarray(mask)
  w = jnp.asarray(rng.normal(size=(3, 24, xla_cfg.vocab_size)).astype(np.float32)) * mask[..., None]

  def loss(cfg):
    return jax.jit(jax.value_and_grad(lambda p: jnp.sum(model.forward(cfg, p, tokens, None, mask) * w)))

  (lx, gx), (lk, gk) = loss(xla_cfg)(params), loss(ker_cfg)(params)
  assert abs(float(lx - lk)) <= 1e-5 * abs(float(lx)) + 1e-5
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(gx)[0], jax.tree.leaves(gk)):
    err = float(jnp.abs(a - b).max() / jnp.maximum(jnp.abs(a).max(), 1e-12))
    assert err <= 1e-4, (jax.tree_util.keystr(path), err)
  hlo = jax.jit(lambda p: model.forward(ker_cfg, p, tokens, None, mask)).lower(params).as_text()
  assert "aepo_train_attention_fwd" in hlo


def test_unrolled_layer_loop_gives_the_same_gradients():
  """ModelConfig.scan_unroll changes the compiled loop, not the values."""
  cfg = _tiny("cpu_kernel")
  params = init_params(cfg, jax.random.PRNGKey(1))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 16)), jnp.int32)
  grad = lambda c: jax.jit(jax.grad(lambda p: jnp.sum(model.forward(c, p, tokens) ** 2) * 1e-3))(params)  # noqa: E731
  for a, b in zip(jax.tree.leaves(grad(cfg)), jax.tree.leaves(grad(cfg.replace(scan_unroll=cfg.num_layers)))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  with pytest.raises(ValueError, match="scan_unroll"):
    cfg.replace(scan_unroll=0)


def test_resolve_picks_the_kernel_only_where_it_applies():
  cfg = _tiny("auto")
  one = make_mesh((1, 1, 1), jax.devices()[:1])
  assert model.resolve_attention_impl(cfg, one).attention_impl == "cpu_kernel"
  assert model.resolve_attention_impl(cfg.replace(attention_impl="xla"), one).attention_impl == "xla"
  assert model.resolve_attention_impl(cfg.replace(dtype="bfloat16"), one).attention_impl == "xla"
  assert model.resolve_attention_impl(cfg.replace(head_dim=24), one).attention_impl == "xla"
  if len(jax.devices()) >= 2:
    two = make_mesh((2, 1, 1), jax.devices()[:2])
    assert model.resolve_attention_impl(cfg, two).attention_impl == "xla"
    assert "single CPU device" in _cpu_attention.unavailable_reason(cfg, two)
  with pytest.raises(ValueError, match="attention_impl='flash'"):
    cfg.replace(attention_impl="flash")


def test_training_step_runs_through_the_kernel_on_one_device():
  from aepo_jax.train._step import init_train_state, make_sft_step
  import optax

  cfg = _tiny("auto")
  opt = optax.sgd(1e-2)
  step = make_sft_step(cfg, optimizer=opt, micro_batches=1)
  params, opt_state = init_train_state(cfg, init_params(cfg, jax.random.PRNGKey(0)), opt)
  rng = np.random.default_rng(0)
  batch = {
    "tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 2, 16)), jnp.int32),
    "attention_mask": jnp.ones((1, 2, 16), jnp.int32),
    "loss_mask": jnp.ones((1, 2, 16), jnp.int32),
  }
  assert "aepo_train_attention_bwd" in step.lower(params, opt_state, batch).as_text()
  _, _, metrics = step(params, opt_state, batch)
  assert np.isfinite(float(metrics["sft/nll"]))
