"""Routing replay in the RL trainer (algo.routing_replay='rollout'; R3, arXiv 2510.11370): the experts the rollout
engine chose for every token travel from the trajectories (`routes_btsk`) through the micro-batches (-1 padding, the
verl row layout), the batch sharding (rows over the batch axes, L_sparse and k replicated) and the hosts' merge into
the old-log-prob recomputation and the update; the config refuses it for a model without experts. End to end on a
tiny random Qwen3-MoE policy, the recomputed old log-probs equal the sampler's on the loss tokens (float32)."""

import os

import jax
import numpy as np
import optax
import pytest
from jax.random import PRNGKey

from aepo_jax.model import _moe as moe_block
from aepo_jax.model import forward, init_params
from aepo_jax.parallel import make_mesh
from aepo_jax.rollout import concat_groups
from aepo_jax.testing import tiny_model_config
from aepo_jax.train import (
  _batch,
  _logprob,
  _objective,
  _step,
  base_config,
  ConfigError,
  load_config,
  read_metrics,
  run,
  validate,
)
from test_rl_loop import CONFIG, _traj


def _with_routes(tr, l_sparse=2, k=2, seed=0):
  """`tr` with routes: row r's token t goes to experts (r + t + layer + j) % 8, -1 on padding and the last token."""
  n, t = tr.tokens_bt.shape
  r = np.arange(n)[:, None, None, None] + np.arange(t)[None, :, None, None]
  routes = (r + np.arange(l_sparse)[:, None] + np.arange(k)).astype(np.int32) % 8
  routes[:, -1] = -1
  tr.routes_btsk = np.where(np.asarray(tr.attention_mask_bt)[..., None, None] > 0, routes, -1).astype(np.int32)
  return tr


# ----------------------------------------------------------------------------------------------------------- batches
def test_micro_batches_carry_routes_padded_with_minus_one_in_rows_and_columns():
  tr = _with_routes(_traj([2, 1], width=6))
  adv = np.ones(tr.tokens_bt.shape, np.float32)
  b = _batch.trajectories_batch(tr, adv, micro_batch_size=2, pad_id=0, seq_len=8, rows_multiple=4)
  assert b["routes"].shape == (2, 2, 8, 2, 2) and b["routes"].dtype == np.int32
  assert b["tokens"].shape == (2, 2, 8)
  flat = b["routes"].reshape(4, 8, 2, 2)
  np.testing.assert_array_equal(flat[:3, :6], tr.routes_btsk)
  assert (flat[:3, 6:] == -1).all() and (flat[3] == -1).all()  # columns up to seq_len, the empty row


def test_the_verl_layout_reorders_routes_with_the_rows():
  tr = _with_routes(_traj([2, 2], width=5))

  class Layout:
    order = np.asarray([2, 0, 3, 1])
    denominator = np.asarray([1.0, 2.0, 3.0, 4.0], np.float32)

  adv = np.arange(4, dtype=np.float32)[:, None] * np.ones((1, 5), np.float32)
  b = _batch.trajectories_batch(tr, adv, micro_batch_size=2, pad_id=0, seq_len=5, layout=Layout)
  np.testing.assert_array_equal(b["routes"].reshape(4, 5, 2, 2), tr.routes_btsk[Layout.order])
  np.testing.assert_array_equal(b["advantages"].reshape(4, 5)[:, 0], Layout.order)


def test_micro_batches_still_refuse_arrays_of_another_length():
  with pytest.raises(ValueError, match="every array must be"):
    _batch.micro_batches(
      {"tokens": np.zeros((2, 4), np.int32), "routes": np.zeros((2, 3, 1, 1), np.int32)}, micro_batch_size=1, pad_id=0
    )


def test_routes_are_sharded_by_rows_and_replicated_over_layers_and_experts():
  mesh = make_mesh((4, 2, 1), jax.devices()[:8])
  tr = _with_routes(_traj([4, 4], width=6))
  b = _batch.trajectories_batch(
    tr, np.zeros(tr.tokens_bt.shape, np.float32), micro_batch_size=8, pad_id=0, seq_len=8, rows_multiple=8
  )
  sharded = _batch.shard_batch(_batch.process_rows(b, mesh), mesh)
  routes = sharded["routes"]
  assert routes.shape == (1, 8, 8, 2, 2)
  np.testing.assert_array_equal(np.asarray(routes), b["routes"])
  for shard in routes.addressable_shards:  # one row per device, every column, layer and expert
    assert shard.data.shape == (1, 1, 8, 2, 2)
    np.testing.assert_array_equal(np.asarray(shard.data), b["routes"][shard.index])


def test_merging_hosts_and_groups_keeps_routes():
  host0, host1 = _with_routes(_traj([2, 1], width=6)), _with_routes(_traj([1, 2], width=8, offset=10))
  merged = _batch.merge_hosts([host0, host1], pad_id=0)
  assert merged.routes_btsk.shape == (6, 8, 2, 2)
  np.testing.assert_array_equal(merged.routes_btsk[:3, :6], host0.routes_btsk)
  assert (merged.routes_btsk[:3, 6:] == -1).all()
  np.testing.assert_array_equal(merged.routes_btsk[3:], host1.routes_btsk)
  both = concat_groups([(host1, [1]), (host0, [0])], pad_id=0)
  np.testing.assert_array_equal(both.routes_btsk[:2], host1.routes_btsk[1:])
  np.testing.assert_array_equal(both.routes_btsk[2:, :6], host0.routes_btsk[:2])
  assert (both.routes_btsk[2:, 6:] == -1).all()
  assert _batch.merge_hosts([_traj([1], 4), _traj([1], 5)], pad_id=0).routes_btsk is None


# -------------------------------------------------------------------------------------------------- the jitted step
MOE = tiny_model_config(
  "qwen3_moe",
  vocab_size=128,
  num_layers=3,
  mlp_only_layers=(1,),
  num_experts=6,
  num_experts_per_tok=2,
  moe_intermediate_size=16,
)


@pytest.mark.slow
def test_the_logprob_fn_and_the_update_step_route_every_token_through_the_given_experts():
  """A tiny random Qwen3-MoE policy (the middle layer dense): replaying the routes the policy picks itself gives the
  old log-probs and the updated parameters of no replay; other routes change both, and the router still learns
  (its gate is the current router's probability at each replayed expert)."""
  params = jax.tree.map(lambda x: np.asarray(x) * 4.0 if x.ndim >= 2 else np.asarray(x), init_params(MOE, PRNGKey(0)))
  rng = np.random.default_rng(0)
  n, t = 8, 16
  tokens = rng.integers(3, MOE.vocab_size, (n, t)).astype(np.int32)
  attn = (np.arange(t)[None] < rng.integers(8, t + 1, (n, 1))).astype(np.int32)
  loss = attn * (np.arange(t)[None] >= 3)
  _, own = forward(MOE, params, tokens, attention_mask=attn, return_routes=True)
  own = np.where(attn[..., None, None] > 0, np.asarray(own), -1).astype(np.int32)
  other = np.where(own >= 0, (own + 1) % MOE.num_experts, -1).astype(np.int32)
  arrays = {
    "tokens": tokens,
    "attention_mask": attn,
    "loss_mask": loss,
    "advantages": rng.normal(size=(n, 1)).astype(np.float32) * loss,
  }
  mesh = make_mesh((1, 1, 1), jax.devices()[:1])
  logprob_fn = _logprob.make_logprob_fn(MOE, mesh, with_routes=True)
  step = _step.make_update_step(MOE, loss_fn="ppo", optimizer=optax.sgd(1.0), micro_batches=2, mesh=mesh)

  def batch(routes):
    b = _batch.micro_batches(
      {**arrays, **({} if routes is None else {"routes": routes})}, micro_batch_size=4, pad_id=0, seq_len=t
    )
    b = _batch.shard_batch(b, mesh)
    b["old_log_prob"], _ = logprob_fn(params, b["tokens"], b["attention_mask"], b.get("routes"))
    return b

  def updated(routes):
    p, opt = _step.init_train_state(MOE, params, optax.sgd(1.0), mesh)
    return jax.device_get(step(p, opt, batch(routes))[0])

  plain, replayed, moved = batch(None), batch(own), batch(other)
  np.testing.assert_array_equal(replayed["old_log_prob"], plain["old_log_prob"])  # bit-identical (test_routing_replay)
  assert np.max(np.abs(np.asarray(moved["old_log_prob"] - plain["old_log_prob"]))) > 1e-3
  base, same, other_p = updated(None), updated(own), updated(other)
  gate = lambda p: p["layers"]["mlp"]["gate"]["kernel"]  # noqa: E731
  for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(same)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
  assert np.max(np.abs(gate(other_p) - gate(base))) > 1e-6
  assert np.max(np.abs(gate(other_p) - params["layers"]["mlp"]["gate"]["kernel"])) > 1e-6  # the router learns


def test_routing_disagreement_counts_the_pairs_routed_elsewhere():
  """algo.routing_replay='measure': the trainer's own top-k against the rollout's recorded experts, per (token, sparse
  layer) with routes recorded: none differ for the routes the same model picks (the sets, in any order), every pair
  differs for other experts, and unrecorded tokens (-1) and padding are not compared."""
  params = jax.tree.map(lambda x: np.asarray(x) * 4.0 if x.ndim >= 2 else np.asarray(x), init_params(MOE, PRNGKey(0)))
  rng = np.random.default_rng(1)
  n, t = 4, 12
  tokens = rng.integers(3, MOE.vocab_size, (n, t)).astype(np.int32)
  attn = (np.arange(t)[None] < np.asarray([[12], [9], [12], [6]])).astype(np.int32)
  _, own = forward(MOE, params, tokens, attention_mask=attn, return_routes=True)
  own = np.where(attn[..., None, None] > 0, np.asarray(own), -1).astype(np.int32)
  own[:, -1] = -1  # each row's last position: not recorded
  mesh = make_mesh((1, 1, 1), jax.devices()[:1])
  fn = _logprob.make_routing_disagreement_fn(MOE, mesh)

  def share(routes):
    b = _batch.shard_batch(
      _batch.micro_batches(
        {"tokens": tokens, "attention_mask": attn, "routes": routes}, micro_batch_size=2, pad_id=0, seq_len=t
      ),
      mesh,
    )
    return _logprob.routing_disagreement(fn, params, b, b.pop("routes"))["train/routing_disagreement"]

  assert share(own) == 0.0
  assert share(own[..., ::-1].copy()) == 0.0  # the same experts in another order
  other = np.where(own >= 0, (own + 1) % MOE.num_experts, -1).astype(np.int32)  # k=2 of 6: never the same set
  assert share(other) == 1.0
  half = own.copy()
  half[:2] = other[:2]
  recorded = (own[..., 0, 0] >= 0).sum(1)
  want = recorded[:2].sum() / recorded.sum()
  assert abs(share(half) - want) < 1e-6, (share(half), want)


# ----------------------------------------------------------------------------------------------------------- config
def _moe(config):
  config.model.name = "qwen3-30b-a3b"
  return config


def test_routing_replay_is_checked():
  config = base_config()
  assert config.algo.routing_replay == "none"
  config.algo.routing_replay = "yes"
  with pytest.raises(ConfigError, match="algo.routing_replay='yes'"):
    validate(config)
  config.model.name = "qwen3-0.6b"  # a dense preset
  config.algo.routing_replay = "rollout"
  with pytest.raises(ConfigError, match="algo.routing_replay='rollout' .* has none; set algo.routing_replay='none'"):
    validate(config)
  config = _moe(base_config())
  config.algo.routing_replay = "rollout"
  validate(config)
  assert _objective.update_batch_keys(config)[-1] == "routes"
  config.algo.routing_replay = "none"
  assert "routes" not in _objective.update_batch_keys(config)


def test_a_moe_model_made_dense_by_its_overrides_is_refused():
  config = _moe(base_config())
  config.algo.routing_replay = "rollout"
  with config.model.overrides.unlocked():
    config.model.overrides.num_experts = 0
    config.model.overrides.family = "qwen3"
  with pytest.raises(ConfigError, match="has none"):
    validate(config)


# ----------------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  from aepo_jax.testing import tiny_tokenizer

  return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.slow
@pytest.mark.parametrize("mode, expert_axis", [("rollout", ""), ("measure", "fsdp")])
def test_rl_with_routing_replay_recomputes_the_samplers_log_probs(tmp_path, tok_dir, mode, expert_axis, monkeypatch):
  """Two RL steps of a tiny random Qwen3-MoE policy (2 sparse layers, 4 experts, top 2) with AEPO's rollouts, routing
  replay and a KL loss (the reference routes itself): the update replays the rollout's experts for all but each row's
  last token, and the old log-probs the trainer recomputes through them equal the engine's on every loss token to
  float32 rounding (without replay they do too here: float32 on one backend flips no route; the random model's
  rewards are all equal, so the gradient is 0: the jitted-step test above covers replay's gradient).
  The 'measure' run trains with expert parallelism (mesh.expert_axis='fsdp': 4 experts over mesh fsdp 4, the
  (token, expert) pairs exchanged by all-to-all in the 'ragged' path), against the engine's unsharded experts."""
  overrides = {
    "workdir": str(tmp_path / "run"),
    "model.tokenizer": tok_dir,
    "model.name": "qwen3-30b-a3b",
    "model.overrides.num_experts": 4,
    "model.overrides.num_experts_per_tok": 2,
    "model.overrides.moe_intermediate_size": 16,
    "mode": "rl",
    "sft.enabled": False,
    "eval.before_rl": False,
    "eval.after_rl": False,
    "algo.routing_replay": mode,
    "algo.kl.name": "k3",  # the reference's log-probs: the same program without routes (its own routing)
    "algo.kl.coef": 0.1,
    "train.steps": 2,
  }
  if expert_axis:
    overrides.update(
      {"mesh.data": 2, "mesh.fsdp": 4, "mesh.expert_axis": expert_axis, "model.overrides.moe_impl": "ragged"}
    )
  config = load_config(CONFIG, overrides=overrides, num_devices=None)
  exchanged = []  # the mesh axes of every sparse block traced through the expert-parallel path
  parallel_block = moe_block.experts_parallel
  monkeypatch.setattr(
    moe_block, "experts_parallel", lambda *a, **kw: exchanged.append(kw["axes"]) or parallel_block(*a, **kw)
  )
  run(config)
  assert set(exchanged) == ({(expert_axis,)} if expert_axis else set()), exchanged
  rl = [r for r in read_metrics(config.workdir) if "reward/mean" in r]
  assert [r["step"] for r in rl] == [1, 2]
  for r in rl:
    assert r["train/routing_replay_token_fraction"] > 0.9, r["train/routing_replay_token_fraction"]
    assert r["mismatch/logprob_abs_diff_max"] < 1e-4, r["mismatch/logprob_abs_diff_max"]
    if mode == "measure":  # float32 on one backend: the trainer's own top-k is the rollout's
      assert r["train/routing_disagreement"] == 0.0, r["train/routing_disagreement"]
    assert np.isfinite(r["train/grad_norm"]) and r["train/nonfinite_skipped"] == 0.0
  assert os.path.isdir(os.path.join(config.workdir, "checkpoints", "rl", "2"))
