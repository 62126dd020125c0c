"""The jitted RL update step on one device: accumulation, references, masking, NaN skipping, log-probs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aepo_jax.train._batch import shard_batch
from aepo_jax.train._optim import make_optimizer
from aepo_jax.train._logprob import behaviour_log_prob, logprob_mismatch_metrics, make_logprob_fn
from aepo_jax.train._step import init_train_state, make_update_step
from test_step_fixtures import (
  CFG,
  M,
  MB,
  TEMPERATURE,
  T,
  float32_spread,
  host_params,
  max_abs_diff,
  reference_entropy,
  reference_grads,
  reference_logprobs,
  rl_arrays,
  rl_batch,
  sgd,
)

ONE = jax.devices()[:1]


@functools.lru_cache(maxsize=None)
def _step(micro, loss="ppo", aggregation="global", need_entropy=False, logit_capacity=0, saved_logits_mb=1024.0):
  return make_update_step(
    CFG,
    loss_fn=loss,
    optimizer=sgd(),
    micro_batches=micro,
    temperature=TEMPERATURE,
    aggregation=aggregation,
    need_entropy=need_entropy,
    logprob_chunk=8,
    logit_capacity=logit_capacity,
    saved_logits_mb=saved_logits_mb,
  )


def _run(step, batch_np, params_np=None, optimizer=None, mesh=None):
  """One step from fresh state (the step donates params and opt_state). Returns (params, opt_state,
  metrics) as host numpy, plus the gradient implied by SGD(lr=1)."""
  from aepo_jax.parallel import make_mesh

  mesh = mesh or make_mesh((1, 1, 1), ONE)
  params_np = params_np or host_params()
  p, s = init_train_state(CFG, params_np, optimizer or sgd(), mesh)
  p, s, metrics = step(p, s, shard_batch(batch_np, mesh))
  p, s, metrics = jax.device_get((p, s, metrics))
  grads = jax.tree.map(lambda old, new: old - new, params_np, p)
  return p, s, metrics, grads


@pytest.mark.slow
def test_accumulation_over_micro_batches_equals_one_big_batch():
  """Global token-mean (spec §5.10): 4 micro-batches of 2 rows == 1 batch of 8 rows, grads and params."""
  p4, _, m4, g4 = _run(_step(M), rl_batch(M))
  p1, _, m1, g1 = _run(_step(1), rl_batch(1))
  assert max_abs_diff(g4, g1) <= 1e-6
  assert max_abs_diff(p4, p1) <= 1e-6
  assert abs(m4["train/loss"] - m1["train/loss"]) <= 1e-6
  assert m4["train/tokens"] == m1["train/tokens"] == rl_arrays()["loss_mask"][:, 1:].sum()
  assert m4["train/nonfinite_skipped"] == 0.0
  # the micro-batches really hold different token counts, so a per-micro-batch mean would differ
  counts = rl_batch(M)["loss_mask"][:, :, 1:].sum(axis=(1, 2))
  assert len(set(counts.tolist())) > 1


@pytest.mark.parametrize("saved_logits_mb", [1024.0, 0.0])
def test_step_gradient_matches_full_logits_reference(saved_logits_mb):
  """Chunked unembedding + temperature + token shift == jax.grad of the loss on full log_softmax logits, with the
  forward's logits kept for the backward (one chunk) and recomputed chunk by chunk (saved_logits_mb=0)."""
  _, _, metrics, grads = _run(_step(M, saved_logits_mb=saved_logits_mb), rl_batch(M))
  arrays = {k: jnp.asarray(v) for k, v in rl_arrays().items()}
  ref = jax.device_get(reference_grads(host_params(), arrays, "ppo"))
  scale = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(ref))
  assert scale > 1e-3  # the test is not vacuous
  assert max_abs_diff(grads, ref) <= 2e-6
  assert {"actor/pg_clipfrac", "actor/ppo_kl", "train/grad_norm", "train/lr", "actor/entropy_mean"} <= set(metrics)
  assert metrics["actor/pg_clipfrac"] > 0  # old log-probs are perturbed, so some tokens clip


def test_untied_lm_head_gradient_matches_full_logits_reference():
  """An untied head (lm_head kernel [D, V], layout 'dv' of the LM head's custom VJP): the step's gradient of every
  parameter, lm_head included, equals jax.grad of the loss on full logits."""
  from aepo_jax.parallel import make_mesh

  cfg = CFG.replace(tie_word_embeddings=False)
  params = host_params(config=cfg)
  assert "lm_head" in params
  step = make_update_step(
    cfg, loss_fn="ppo", optimizer=sgd(), micro_batches=1, temperature=TEMPERATURE, logprob_chunk=8
  )
  mesh = make_mesh((1, 1, 1), ONE)
  p, s = init_train_state(cfg, params, sgd(), mesh)
  p, _, _ = step(p, s, shard_batch(rl_batch(1), mesh))
  grads = jax.tree.map(lambda old, new: old - new, params, jax.device_get(p))
  arrays = {k: jnp.asarray(v) for k, v in rl_arrays().items()}
  ref = jax.device_get(reference_grads(params, arrays, "ppo", config=cfg))
  assert float(np.max(np.abs(ref["lm_head"]["kernel"]))) > 1e-3
  assert max_abs_diff(grads, ref) <= 2e-6


@pytest.mark.slow
def test_verl_aggregation_is_sequence_weighted_micro_batch_token_mean():
  _, _, _, grads = _run(_step(M, aggregation="verl"), rl_batch(M))
  arrays = {k: jnp.asarray(v) for k, v in rl_arrays().items()}
  parts = tuple((i * MB, (i + 1) * MB) for i in range(M))
  ref = jax.device_get(reference_grads(host_params(), arrays, "ppo", weights=parts))
  assert max_abs_diff(grads, ref) <= 2e-6
  global_ref = jax.device_get(reference_grads(host_params(), arrays, "ppo"))
  assert max_abs_diff(ref, global_ref) > 1e-4  # the two aggregations really differ on this batch


@pytest.mark.slow
def test_aepo_with_entropy_matches_reference():
  """need_entropy=True feeds the current policy's entropy (logits / T) into AEPO's advantage (spec §2.3)."""
  _, _, metrics, grads = _run(_step(1, loss="aepo", need_entropy=True), rl_batch(1))
  arrays = {k: jnp.asarray(v) for k, v in rl_arrays().items()}
  ref = jax.device_get(reference_grads(host_params(), arrays, "aepo"))
  # Standardising the entropy (÷ its std) amplifies float32 rounding: the bound is 4x the reference's own spread
  # under one-ulp parameter moves (~1e-5 here, against ~1e-7 for ppo), not one machine's observed error.
  assert max_abs_diff(grads, ref) <= 4 * float32_spread(arrays, "aepo")
  assert "actor/entropy_adv_factor_mean" in metrics


def test_logits_only_at_loss_positions_give_the_same_update():
  """logit_capacity: the LM head on the gathered loss positions only (AEPO with the current entropy, the loss
  that uses the most of them) gives the dense step's gradient and metrics (the dense step is checked against the
  full-logits reference above). The capacity lets the smallest micro-batch gather (positions skipped) and sends the
  others to the dense path (over capacity), so both branches run in one step."""
  counts = rl_batch(M)["loss_mask"][:, :, 1:].sum(axis=(1, 2))
  assert counts.max() < MB * T and counts.min() < counts.max()
  _, _, dense_metrics, dense_grads = _run(_step(M, loss="aepo", need_entropy=True), rl_batch(M))
  for capacity in (int(counts.min()),):
    _, _, metrics, grads = _run(_step(M, loss="aepo", need_entropy=True, logit_capacity=capacity), rl_batch(M))
    # Both are the jitted step in float32, differing in summation order only: AEPO's rounding spread bounds them.
    arrays = {k: jnp.asarray(v) for k, v in rl_arrays().items()}
    assert max_abs_diff(grads, dense_grads) <= 4 * float32_spread(arrays, "aepo"), capacity
    for k in ("train/loss", "actor/entropy_mean", "actor/ratio_max", "actor/pg_clipfrac"):
      np.testing.assert_allclose(metrics[k], dense_metrics[k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.slow
def test_kl_loss_term_matches_reference():
  """kl_coef · low_var_kl against ref_log_prob, aggregated like the policy loss (verl use_kl_loss)."""
  arrays = rl_arrays()
  arrays["ref_log_prob"] = arrays["old_log_prob"] + 0.5 * arrays["loss_mask"]
  batch = {k: v.reshape(M, MB, T) for k, v in arrays.items()}
  step = make_update_step(
    CFG,
    loss_fn="ppo",
    optimizer=sgd(),
    micro_batches=M,
    temperature=TEMPERATURE,
    kl_name="low_var_kl",
    kl_coef=0.5,
    logprob_chunk=8,
  )
  _, _, metrics, grads = _run(step, batch)
  ref = jax.device_get(
    reference_grads(host_params(), {k: jnp.asarray(v) for k, v in arrays.items()}, "ppo", kl_coef=0.5)
  )
  assert max_abs_diff(grads, ref) <= 2e-6
  assert metrics["actor/kl_loss"] > 0
  np.testing.assert_allclose(
    metrics["train/loss"], metrics["actor/pg_loss"] + 0.5 * metrics["actor/kl_loss"], rtol=1e-6
  )
  with pytest.raises(ValueError, match="kl_name"):
    make_update_step(CFG, loss_fn="ppo", optimizer=sgd(), micro_batches=M, kl_coef=0.1)


def test_masked_tokens_do_not_affect_gradients():
  """Padding tokens, and advantages / old log-probs (even NaN) where loss_mask is 0, change nothing."""
  batch = rl_batch(M)
  other = {k: v.copy() for k, v in batch.items()}
  rng = np.random.default_rng(1)
  pad = other["attention_mask"] == 0
  other["tokens"][pad] = rng.integers(3, CFG.vocab_size, pad.sum())
  off = other["loss_mask"] == 0
  other["advantages"][off] = np.nan
  other["old_log_prob"][off] = rng.normal(size=off.sum()) * 100
  _, _, m_a, g_a = _run(_step(M), batch)
  _, _, m_b, g_b = _run(_step(M), other)
  assert m_b["train/nonfinite_skipped"] == 0.0
  assert max_abs_diff(g_a, g_b) <= 1e-7


def test_nonfinite_loss_skips_update_and_is_reported():
  batch = rl_batch(M)
  bad = {k: v.copy() for k, v in batch.items()}
  k, i, j = np.argwhere(bad["loss_mask"][:, :, 1:] > 0)[0]
  bad["advantages"][k, i, j + 1] = np.nan
  p_bad, s_bad, m_bad, _ = _run(_step(M), bad)
  assert m_bad["train/nonfinite_skipped"] == 1.0
  assert max_abs_diff(p_bad, host_params()) == 0.0
  assert int(s_bad.count) == 0  # optimizer state untouched (inject_hyperparams step counter)
  p_ok, s_ok, m_ok, _ = _run(_step(M), batch)
  assert m_ok["train/nonfinite_skipped"] == 0.0 and int(s_ok.count) == 1
  assert max_abs_diff(p_ok, host_params()) > 0


def test_nonfinite_updates_stop_training_after_train_nan_limit():
  """The trainer counts the step's skipped updates across steps (and checkpoints: meta 'nan_count'); one more than
  `train.nan_limit` is a clear stop that names the key and what to do."""
  from aepo_jax.train._phase import TrainingError, check_finite as _check_finite

  count = 0
  for step in range(2):  # limit 2: two skipped updates pass (logged), the third stops
    count = _check_finite({"train/nonfinite_skipped": np.float32(1.0)}, count, 2, step)
  assert count == 2
  assert _check_finite({"train/nonfinite_skipped": 0.0}, count, 2, 3) == 2  # finite steps do not reset or add
  with pytest.raises(TrainingError, match=r"3 updates had a non-finite loss.*train\.nan_limit=2.*lower optim\.lr"):
    _check_finite({"train/nonfinite_skipped": 1.0}, count, 2, 4)


@pytest.mark.slow
def test_step_compiles_once_and_adamw_lr_is_reported():
  from aepo_jax.parallel import make_mesh

  opt = make_optimizer(1e-3, warmup_steps=2)
  step = make_update_step(CFG, loss_fn="ppo", optimizer=opt, micro_batches=M, temperature=TEMPERATURE, logprob_chunk=8)
  mesh = make_mesh((1, 1, 1), ONE)
  p, s = init_train_state(CFG, host_params(), opt, mesh)
  lrs = []
  for _ in range(3):
    p, s, metrics = step(p, s, shard_batch(rl_batch(M), mesh))
    lrs.append(float(metrics["train/lr"]))
  assert step._cache_size() == 1
  np.testing.assert_allclose(lrs, [0.0, 5e-4, 1e-3], atol=1e-9)  # linear warm-up from 0 (torch/verl)


def test_logprob_fn_equals_full_log_softmax():
  arrays = rl_arrays()
  batch = {k: arrays[k].reshape(M, MB, T) for k in ("tokens", "attention_mask")}
  from aepo_jax.parallel import make_mesh

  mesh = make_mesh((1, 1, 1), ONE)
  params, _ = init_train_state(CFG, host_params(), sgd(), mesh)
  fn = make_logprob_fn(CFG, temperature=TEMPERATURE, chunk=5)  # chunk does not divide T
  lp, ent = fn(params, *shard_batch(batch, mesh).values())
  ref_lp = reference_logprobs(host_params(), arrays["tokens"], arrays["attention_mask"])
  ref_ent = reference_entropy(host_params(), arrays["tokens"], arrays["attention_mask"])
  valid = arrays["attention_mask"].astype(bool)
  valid[:, 0] = False
  np.testing.assert_allclose(np.asarray(lp).reshape(-1, T)[valid], np.asarray(ref_lp)[valid], atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent).reshape(-1, T)[valid], np.asarray(ref_ent)[valid], atol=1e-5)
  assert np.all(np.asarray(lp)[:, :, 0] == 0)


def test_off_policy_correction_in_the_step_weights_each_token():
  """algo.off_policy='tis' in the jitted step: with the sampler's log-probs equal to old_log_prob the update is the
  uncorrected one; with them lower by log 1.5 on every token (w = 1.5, under the cap 2) every token's gradient
  grows by 1.5."""
  from aepo_jax.train._step import make_update_step as make

  batch = rl_batch(M)
  same = dict(batch, sampler_log_prob=batch["old_log_prob"])
  lower = dict(batch, sampler_log_prob=batch["old_log_prob"] - np.float32(np.log(1.5)))
  tis = make(
    CFG,
    loss_fn="ppo",
    optimizer=sgd(),
    micro_batches=M,
    temperature=TEMPERATURE,
    logprob_chunk=8,
    off_policy="tis",
    off_policy_hp={"cap": 2.0},
  )
  _, _, base_metrics, base = _run(_step(M), batch)
  _, _, m_same, g_same = _run(tis, same)
  _, _, m_lower, g_lower = _run(tis, lower)
  scale = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(base))
  assert max_abs_diff(g_same, base) <= 1e-6 * scale and m_same["offpolicy/ess"] == 1.0
  weighted = jax.tree.map(lambda g: 1.5 * g, base)
  assert max_abs_diff(g_lower, weighted) <= 1e-5 * scale
  assert abs(m_lower["offpolicy/weight_mean"] - 1.5) < 1e-5 and m_lower["offpolicy/capped_frac"] == 0.0


def test_the_call_limit_eos_gets_the_old_log_prob_as_its_behaviour_log_prob():
  """The EOS the host appends at the tool-call limit is trained (mask 1, as the official code does) but was never
  sampled (sampler log-prob 0): it takes the recomputed old log-prob, so its importance ratio is 1 and the mismatch
  metrics do not count it; sampled tokens and untrained ones keep the sampler's."""
  old = jnp.asarray([[-0.5, -1.2, -3.0, -0.7]])
  sampler = jnp.asarray([[-0.4, -1.25, 0.0, 0.0]])  # column 2: the appended EOS; column 3: a tool-result token
  mask = jnp.asarray([[1, 1, 1, 0]])
  got = behaviour_log_prob(old, sampler, mask)
  np.testing.assert_array_equal(np.asarray(got), np.float32([[-0.4, -1.25, -3.0, 0.0]]))
  m = logprob_mismatch_metrics(old, got, mask)
  assert abs(float(m["mismatch/logprob_abs_diff_max"]) - 0.1) < 1e-6  # not 3.0 from the EOS
