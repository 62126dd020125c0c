"""Cold-start SFT step, batch construction and the optimizer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from aepo_jax.parallel import make_mesh
from aepo_jax.train._batch import micro_batches, pack_rows, sft_batch, sft_example, shard_batch, split_updates
from aepo_jax.train._optim import current_lr, lr_schedule, make_optimizer
from aepo_jax.train._step import init_train_state, make_sft_step
from test_step_fixtures import CFG, host_params


def _demo(rng, prompt_len, turns):
  """prompt, then assistant turns alternating with tool results (masked out)."""
  segments = [(rng.integers(3, CFG.vocab_size, prompt_len), False)]
  for i in range(turns):
    segments.append((rng.integers(3, CFG.vocab_size, 4), True))
    if i + 1 < turns:
      segments.append((rng.integers(3, CFG.vocab_size, 3), False))  # tool result
  return sft_example(segments)


def test_sft_example_masks_prompt_and_tool_results():
  tokens, mask = sft_example([([5, 6, 7], False), ([8, 9], True), ([10], False), ([11, 2], True)])
  np.testing.assert_array_equal(tokens, [5, 6, 7, 8, 9, 10, 11, 2])
  np.testing.assert_array_equal(mask, [0, 0, 0, 1, 1, 0, 1, 1])
  with pytest.raises(ValueError, match="trained=True"):
    sft_example([([1, 2], False)])


def test_sft_batch_layout_and_errors():
  examples = [(np.arange(5), np.array([0, 0, 1, 1, 1])), (np.arange(3), np.array([0, 1, 1]))]
  batch = sft_batch(examples, micro_batch_size=2, pad_id=0, seq_len=8, rows_multiple=4)
  assert batch["tokens"].shape == (2, 2, 8)  # 2 rows padded to 4 = 2 micro-batches of 2
  assert batch["loss_mask"][1].sum() == 0 and batch["attention_mask"][1].sum() == 0
  np.testing.assert_array_equal(batch["attention_mask"][0, 1], [1, 1, 1, 0, 0, 0, 0, 0])
  with pytest.raises(ValueError, match="seq_len"):
    sft_batch(examples, micro_batch_size=2, pad_id=0, seq_len=4)
  assert sft_batch(examples, micro_batch_size=2, pad_id=0, seq_len=4, truncate=True)["tokens"].shape[-1] == 4
  with pytest.raises(ValueError, match="micro_batches_per_update"):
    list(split_updates(batch, 3))
  assert [b["tokens"].shape for b in split_updates(batch, 1)] == [(1, 2, 8)] * 2
  with pytest.raises(ValueError, match=r"\[N=2, T=5, \.\.\.\]"):
    micro_batches({"tokens": np.zeros((2, 5)), "loss_mask": np.zeros((2, 4))}, micro_batch_size=1, pad_id=0)


def test_trajectories_batch_from_rollout_fields():
  """Fields of docs/rollout_contract.md `Trajectories` -> [K, mb, T] arrays, padded rows and columns empty."""
  from types import SimpleNamespace
  from aepo_jax.train._batch import trajectories_batch

  n, t = 3, 5
  traj = SimpleNamespace(
    tokens_bt=np.arange(n * t).reshape(n, t),
    attention_mask_bt=np.ones((n, t), np.int32),
    loss_mask_bt=np.tile([0, 0, 1, 1, 1], (n, 1)),
    sampler_logprob_bt=-np.ones((n, t), np.float32),
  )
  adv = np.full((n, t), 2.0)
  batch = trajectories_batch(traj, adv, micro_batch_size=2, pad_id=7, seq_len=8, rows_multiple=4)
  assert set(batch) == {"tokens", "attention_mask", "loss_mask", "advantages", "sampler_log_prob"}
  assert all(v.shape == (2, 2, 8) for v in batch.values())
  np.testing.assert_array_equal(batch["tokens"][0, 0], [0, 1, 2, 3, 4, 7, 7, 7])
  assert batch["tokens"].dtype == np.int32 and batch["advantages"].dtype == np.float32
  assert batch["loss_mask"][1, 1].sum() == 0 and np.all(batch["tokens"][1, 1] == 7)  # the padding row
  with pytest.raises(ValueError, match="seq_len"):
    trajectories_batch(traj, adv, micro_batch_size=2, pad_id=7, seq_len=4)


def test_shard_batch_rejects_rows_that_do_not_split_over_the_mesh():
  mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices()[:8])
  with pytest.raises(ValueError, match="micro_batch_size"):
    shard_batch({"tokens": np.zeros((1, 2, 8), np.int32)}, mesh)


@pytest.mark.slow
def test_sft_loss_decreases_on_a_fixed_batch():
  rng = np.random.default_rng(0)
  examples = [_demo(rng, int(rng.integers(2, 5)), 3) for _ in range(8)]
  batch_np = sft_batch(examples, micro_batch_size=4, pad_id=0, seq_len=24, rows_multiple=8)
  mesh = make_mesh((1, 1, 1), jax.devices()[:1])
  opt = make_optimizer(1e-2, weight_decay=0.0)
  step = make_sft_step(CFG, optimizer=opt, micro_batches=2, mesh=mesh, logprob_chunk=8)
  params, opt_state = init_train_state(CFG, host_params(), opt, mesh)
  batch = shard_batch(batch_np, mesh)
  nll = []
  for _ in range(25):
    params, opt_state, metrics = step(params, opt_state, batch)
    nll.append(float(metrics["sft/nll"]))
  assert metrics["train/tokens"] == sum(int(m[1:].sum()) for _, m in examples)
  assert nll[0] == pytest.approx(np.log(CFG.vocab_size), rel=0.05)  # random init: near-uniform
  assert nll[-1] < 0.5 * nll[0], nll


def test_packed_rows_give_the_unpacked_loss_and_gradient():
  """8 demos in 8 rows of 24 tokens vs packed into 4 rows of 48 (segment-aware attention and positions): the same
  NLL, trained-token count and SGD update (= the gradient) to float32 rounding; the packed batch has a third
  less padding here."""
  rng = np.random.default_rng(1)
  examples = [_demo(rng, int(rng.integers(2, 9)), int(rng.integers(1, 4))) for _ in range(8)]
  mesh = make_mesh((1, 1, 1), jax.devices()[:1])
  opt = optax.sgd(1.0)
  out = {}
  for name, kw, micro in (("rows", dict(seq_len=24), 2), ("packed", dict(seq_len=48, packed_rows=4), 1)):
    batch_np = sft_batch(examples, micro_batch_size=4, pad_id=0, **kw)
    if name == "packed":
      assert set(batch_np) == {"tokens", "attention_mask", "loss_mask", "segment_ids"}
      assert batch_np["tokens"].shape == (1, 4, 48) and batch_np["segment_ids"].max() >= 2
      assert batch_np["attention_mask"].sum() == sum(len(t) for t, _ in examples)
    step = make_sft_step(CFG, optimizer=opt, micro_batches=micro, mesh=mesh, logprob_chunk=8)
    params, opt_state = init_train_state(CFG, host_params(), opt, mesh)
    new_params, _, metrics = step(params, opt_state, shard_batch(batch_np, mesh))
    out[name] = (jax.device_get(new_params), jax.device_get(metrics))
  (p_rows, m_rows), (p_packed, m_packed) = out["rows"], out["packed"]
  assert m_rows["train/tokens"] == m_packed["train/tokens"] == sum(int(m[1:].sum()) for _, m in examples)
  np.testing.assert_allclose(m_packed["sft/nll"], m_rows["sft/nll"], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), p_packed, p_rows)


def test_packing_errors_name_the_limits():
  assert pack_rows([5, 3, 4, 2], rows=2, seq_len=7) == [[0, 3], [1, 2]]
  with pytest.raises(ValueError, match="do not fit into 1 rows of 7 tokens"):
    pack_rows([5, 3], rows=1, seq_len=7)
  examples = [(np.arange(6), np.array([0, 0, 1, 1, 1, 1]))] * 3
  with pytest.raises(ValueError, match="do not fit"):
    sft_batch(examples, micro_batch_size=1, pad_id=0, seq_len=8, packed_rows=2)
  with pytest.raises(ValueError, match="needs seq_len"):
    sft_batch(examples, micro_batch_size=1, pad_id=0, packed_rows=2)
  import os
  from aepo_jax.train import ConfigError, load_config

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  with pytest.raises(ConfigError, match="sft.packed_rows=3"):
    load_config(
      os.path.join(root, "configs", "testing", "tiny_sft.py"),
      overrides={"sft.packed_rows": 3, "sft.micro_batch_size": 2, "sft.batch_size": 8},
      num_devices=None,
    )


def test_lr_schedules():
  const = lr_schedule(1e-3, warmup_steps=4)
  np.testing.assert_allclose([const(i) for i in (0, 2, 4, 100)], [0, 5e-4, 1e-3, 1e-3], rtol=1e-6)
  cos = lr_schedule(1e-3, schedule="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
  np.testing.assert_allclose([cos(i) for i in (1, 2, 7, 12)], [5e-4, 1e-3, 5.5e-4, 1e-4], rtol=1e-5)
  lin = lr_schedule(1e-3, schedule="linear", total_steps=10)
  np.testing.assert_allclose([lin(i) for i in (0, 5, 10)], [1e-3, 5e-4, 0.0], atol=1e-9)
  with pytest.raises(ValueError, match="total_steps"):
    lr_schedule(1e-3, schedule="cosine")
  with pytest.raises(ValueError, match="schedule"):
    lr_schedule(1e-3, schedule="step")


def test_optimizer_is_clipped_adamw():
  """One update against the AdamW formula (torch/verl: decoupled decay, bias-corrected moments)."""
  opt = make_optimizer(0.1, weight_decay=0.01, grad_clip=1.0)
  p = {"w": jnp.array([1.0, -2.0])}
  g = {"w": jnp.array([3.0, 4.0])}  # norm 5, clipped to 1
  state = opt.init(p)
  updates, state = opt.update(g, state, p)
  gc = np.array([0.6, 0.8])
  m, v = 0.1 * gc, 0.001 * gc**2
  adam = (m / 0.1) / (np.sqrt(v / 0.001) + 1e-8)
  np.testing.assert_allclose(np.asarray(updates["w"]), -0.1 * (adam + 0.01 * np.array([1.0, -2.0])), rtol=1e-5)
  assert float(current_lr(state)) == pytest.approx(0.1)
  assert current_lr(optax.sgd(0.1).init(p)) is None
  with pytest.raises(ValueError, match="grad_clip"):
    make_optimizer(grad_clip=-1.0)
