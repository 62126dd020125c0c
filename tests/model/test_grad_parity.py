"""Gradients against transformers (CPU torch autograd, float32) on tiny random checkpoints of each family.

The training forward has its own backward rules (`_decoder._attend_recompute`: probabilities recomputed from
q, k and the saved row statistics; `_swiglu`: weight gradients from written-out transposes; on CPU the C++
training-attention kernel of `_cpu_attention`), so
the parameter gradients are checked against torch's autograd, not only the logits. torch's gradients are saved
as a safetensors "checkpoint" next to the config and read back with `load_hf`, which maps every tensor to our
layout with the same (linear) transposes and reshapes as the weights.
"""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

from aepo_jax import model, testing
from aepo_jax.model import _cpu_attention, _decoder

REL_TOL = 2e-4  # max |Δgrad| / max |grad| per parameter, float32; measured <= 2e-6


def _batch(t=16, seed=0):
  """A full row, a left-padded row (fully masked query rows) and a right-padded row; loss weights on valid
  positions only."""
  rng = np.random.RandomState(seed)
  tokens = rng.randint(3, 320, (3, t)).astype(np.int32)
  mask = np.ones((3, t), np.int32)
  mask[1, :5] = 0
  mask[2, 9:] = 0
  tokens = np.where(mask == 1, tokens, 0)
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  return tokens, mask, positions


def _torch_grads(path, tokens, mask, positions, weights, out_dir):
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  hf.train()  # dropout is 0 in the tiny configs
  logits = hf(
    torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(positions), use_cache=False
  ).logits
  (logits * torch.tensor(weights)).sum().backward()
  grads = {name: p.grad.detach().contiguous() for name, p in hf.named_parameters()}
  os.makedirs(out_dir, exist_ok=True)
  safetensors.torch.save_file(grads, os.path.join(out_dir, "model.safetensors"))
  shutil.copy(os.path.join(path, "config.json"), out_dir)
  return model.load_hf(out_dir)[1]


@pytest.mark.parametrize("impl", ["xla", "cpu_kernel"])
@pytest.mark.parametrize("family", testing.FAMILIES)
def test_parameter_gradients_match_transformers(tiny_checkpoint, family, impl, tmp_path):
  """Both attention paths: XLA's ops and the CPU training-attention kernel (`_cpu_attention`)."""
  if impl == "cpu_kernel" and not _cpu_attention.available():
    pytest.skip(f"CPU attention kernel unavailable: {_cpu_attention.reason()}")
  path = tiny_checkpoint(family)
  config, params = model.load_hf(path)
  config = config.replace(attention_impl=impl)
  tokens, mask, positions = _batch()
  weights = np.random.RandomState(1).normal(size=(*tokens.shape, config.vocab_size)).astype(np.float32)
  weights *= mask[..., None]
  want = _torch_grads(path, tokens, mask, positions, weights, str(tmp_path / "grads"))

  def loss(p):
    return jnp.sum(model.forward(config, p, tokens, positions, mask) * weights)

  got = jax.jit(jax.grad(loss))(params)
  flat_want = dict(jax.tree_util.tree_flatten_with_path(want)[0])
  for key, g in jax.tree_util.tree_flatten_with_path(got)[0]:
    w = np.asarray(flat_want[key])
    rel = np.abs(np.asarray(g) - w).max() / max(np.abs(w).max(), 1e-12)
    assert rel <= REL_TOL, (jax.tree_util.keystr(key), rel)


def _close(got, want, rel=1e-5):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype == np.float32
  assert np.abs(got - want).max() <= rel * np.abs(want).max()


def test_custom_backward_rules_equal_autodiff():
  """The custom VJPs against plain autodiff of the same forward, float32 (scores are float32 by design)."""
  rng = np.random.RandomState(0)
  b, t, k, g, d = 2, 7, 2, 3, 8
  q = jnp.float32(rng.normal(size=(b, t, k, g, d)))
  kk = jnp.float32(rng.normal(size=(b, t, k, d)))
  v = jnp.float32(rng.normal(size=(b, t, k, d)))
  valid = np.ones((b, t), bool)
  valid[1, :3] = False  # left padding: the first three query rows see no valid key
  mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None] & valid[:, None, :])
  dout = jnp.float32(rng.normal(size=(b, t, k, g, d)))
  ref_out, ref_vjp = jax.vjp(lambda *a: _decoder._attend(*a, mask), q, kk, v)
  out, vjp = jax.vjp(lambda *a: _decoder._attend_recompute(*a, mask), q, kk, v)  # the forward rule's output
  _close(out, ref_out, 1e-6)
  for x, y in zip(vjp(dout), ref_vjp(dout)):
    _close(x, y)

  x = jnp.float32(rng.normal(size=(9, 5)))
  wg, wu = jnp.float32(rng.normal(size=(5, 6))), jnp.float32(rng.normal(size=(5, 6)))
  wd = jnp.float32(rng.normal(size=(6, 5)))
  dy = jnp.float32(rng.normal(size=(9, 5)))
  plain = lambda x, wg, wu, wd: (jax.nn.silu(x @ wg) * (x @ wu)) @ wd  # noqa: E731
  want = jax.vjp(plain, x, wg, wu, wd)[1](dy)
  got = jax.vjp(_decoder._swiglu, x, wg, wu, wd)[1](dy)
  for x_, y_ in zip(got, want):
    _close(x_, y_)
