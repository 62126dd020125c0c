"""The LM head's log-probs on a mesh (`HeadSharding`): the vocabulary split over a mesh axis inside `jax.shard_map`,
the head gathered once per call and its gradient reduced once, against the unsharded path on the same inputs:
values, entropies and both gradients (h and the head), tied ([V, D]) and untied ([D, V]) heads, logits saved or
recomputed, with a temperature. 8 CPU devices (tests/conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from aepo_jax import objectives as obj
from aepo_jax.parallel import make_mesh

B, T, D, V = 8, 12, 16, 96
EPS32 = float(np.finfo(np.float32).eps)


def _inputs(layout, seed=0):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  w = jnp.asarray(rng.normal(0, 0.5, (V, D) if layout == "vd" else (D, V)), jnp.float32)
  tgt = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  g_logp = jnp.asarray(rng.normal(size=(B, T)), jnp.float32)
  g_ent = jnp.asarray(rng.normal(size=(B, T)), jnp.float32)
  return h, w, tgt, g_logp, g_ent


def _loss(sharding, layout, save, temperature=0.7, chunk=5):
  def f(h, w, tgt, g_logp, g_ent):
    logp, ent = obj.token_logprobs_and_entropy(
      h,
      w,
      tgt,
      temperature,
      chunk,
      layout=layout,
      max_saved_logits=(1 << 30) if save else 0,
      sharding=sharding,
    )
    return jnp.sum(logp * g_logp) + jnp.sum(ent * g_ent), (logp, ent)

  return f


def _tol(*arrays):
  """Float32 rounding of V-term sums whose terms reach the largest magnitude in play, x8 (sharding changes only
  the order of the sums: per-chip partial sums, then a cross-chip sum)."""
  return 8 * EPS32 * np.sqrt(V) * max(float(np.abs(np.asarray(a)).max()) for a in arrays)


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize(
  "shape,axes",
  [
    ((1, 4, 2), (("data", "fsdp"), "tensor", "fsdp")),
    ((2, 2, 2), (("data", "fsdp"), "tensor", "fsdp")),
    ((1, 8, 1), (("fsdp",), None, "fsdp")),
  ],
  ids=["fsdp4_tensor2", "data2_fsdp2_tensor2", "fsdp8"],
)
def test_sharded_head_equals_the_unsharded_path(layout, save, shape, axes):
  mesh = make_mesh(shape, jax.devices()[:8])
  batch, vocab, embed = axes
  batch = tuple(a for a in batch if mesh.shape[a] > 1)
  sh = obj.HeadSharding(mesh, batch, vocab, embed)
  h, w, tgt, g_logp, g_ent = _inputs(layout)
  rows = tuple(batch) or None
  w_spec = P(vocab, embed) if layout == "vd" else P(embed, vocab)
  placed = (
    jax.device_put(h, NamedSharding(mesh, P(rows, None, None))),
    jax.device_put(w, NamedSharding(mesh, w_spec)),
    jax.device_put(tgt, NamedSharding(mesh, P(rows, None))),
    jax.device_put(g_logp, NamedSharding(mesh, P(rows, None))),
    jax.device_put(g_ent, NamedSharding(mesh, P(rows, None))),
  )
  grad = jax.value_and_grad(_loss(sh, layout, save), argnums=(0, 1), has_aux=True)
  (_, (logp, ent)), (dh, dw) = jax.jit(grad)(*placed)
  ref_grad = jax.value_and_grad(_loss(None, layout, save), argnums=(0, 1), has_aux=True)
  (_, (ref_logp, ref_ent)), (ref_dh, ref_dw) = jax.jit(ref_grad)(h, w, tgt, g_logp, g_ent)
  np.testing.assert_allclose(logp, ref_logp, rtol=0, atol=_tol(ref_logp))
  np.testing.assert_allclose(ent, ref_ent, rtol=0, atol=_tol(ref_ent))
  np.testing.assert_allclose(dh, ref_dh, rtol=0, atol=_tol(ref_dh) * np.sqrt(T))
  np.testing.assert_allclose(dw, ref_dw, rtol=0, atol=_tol(ref_dw) * np.sqrt(B * T))
  assert float(np.abs(np.asarray(ref_dw)).max()) > 1e-2  # the gradients are not vacuous
  # The head's gradient leaves in the head's stored sharding (vocabulary over tensor, D reduce-scattered over fsdp).
  assert dw.sharding.is_equivalent_to(NamedSharding(mesh, w_spec), 2), dw.sharding


def test_rows_that_do_not_divide_take_the_unsharded_path():
  mesh = make_mesh((1, 8, 1), jax.devices()[:8])
  sh = obj.HeadSharding(mesh, ("fsdp",), None, "fsdp")
  h, w, tgt, _, _ = _inputs("vd")
  logp, _ = obj.token_logprobs_and_entropy(h[:3], w, tgt[:3], 1.0, 4, sharding=sh)  # 3 rows over fsdp=8
  ref, _ = obj.token_logprobs_and_entropy(h[:3], w, tgt[:3], 1.0, 4)
  np.testing.assert_allclose(logp, ref, rtol=0, atol=_tol(ref))
