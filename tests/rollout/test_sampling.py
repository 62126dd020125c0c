"""The sampler's repetition penalty, min-p and per-slot settings: rules on hand-made logits, per-row settings
equal to the same static settings, and the engine's per-slot mode equal to engines with one setting each."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aepo_jax.model import init_params
from aepo_jax.rollout import Engine, SamplingParams
from aepo_jax.rollout._sampling import SlotSampling, apply_repetition_penalty, sample_step, top_entries
from aepo_jax.testing import tiny_model_config

CFG = tiny_model_config("qwen3", attention_bias=True, eos_token_ids=(1,))


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_context_tokens():
  logits = jnp.asarray([[2.0, -2.0, 3.0, -1.0, 0.5], [2.0, -2.0, 3.0, -1.0, 0.5]])
  tokens = jnp.asarray([[0, 1, 1, 4], [3, 0, 0, 0]])  # row 1 holds one token: the rest lies beyond its length
  out = np.asarray(apply_repetition_penalty(logits, tokens, jnp.asarray([3, 1]), jnp.asarray([2.0, 4.0])))
  np.testing.assert_allclose(out[0], [1.0, -4.0, 3.0, -1.0, 0.5])  # token 4 is at index 3 >= length 3
  np.testing.assert_allclose(out[1], [2.0, -2.0, 3.0, -4.0, 0.5])


def test_sample_step_reports_logprobs_after_penalty_and_temperature():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(3, 50)) * 3, jnp.float32)
  tokens = jnp.asarray(rng.integers(0, 50, size=(3, 8)), jnp.int32)
  length = jnp.asarray([8, 5, 1])
  params = SamplingParams(0.7, repetition_penalty=1.3)
  keys = jnp.zeros((3, 2), jnp.uint32).at[:, 1].set(jnp.arange(3, dtype=jnp.uint32))
  out = sample_step(logits, keys, params, tokens_sl=tokens, length_s=length, top_logprobs=4)
  z = apply_repetition_penalty(logits, tokens, length, 1.3) / 0.7
  logp = np.asarray(jax.nn.log_softmax(z, -1))
  tok = np.asarray(out.token)
  # Float32 log-softmax / entropy over V = 50 logits up to max|z|: 4 sqrt(V) ulps of max|z| (~4e-5 here; measured
  # 2.2e-6 on the entropy), not a fixed 1e-5.
  tol = 4 * float(np.finfo(np.float32).eps) * np.sqrt(z.shape[-1]) * float(jnp.abs(z).max())
  np.testing.assert_allclose(out.logprob, logp[np.arange(3), tok], rtol=0, atol=tol)
  np.testing.assert_allclose(out.entropy, -(np.exp(logp) * logp).sum(-1), rtol=0, atol=tol)
  np.testing.assert_array_equal(out.top_ids, np.argsort(-logp, -1)[:, :4])
  np.testing.assert_allclose(out.top_logprobs, np.sort(logp, -1)[:, ::-1][:, :4], rtol=0, atol=tol)


def test_penalty_needs_the_rows_tokens():
  with pytest.raises(ValueError, match="tokens_sl"):
    sample_step(jnp.zeros((1, 5)), jnp.zeros((1, 2), jnp.uint32), SamplingParams(repetition_penalty=1.1))


def test_min_p_keeps_exactly_the_tokens_above_min_p_times_the_mode():
  p = np.asarray([0.5, 0.3, 0.12, 0.05, 0.03])  # min_p 0.2 keeps p >= 0.1: the first three
  logits = jnp.asarray(np.log(np.tile(p, (4000, 1))), jnp.float32)
  keys = jax.vmap(lambda i: jax.random.key_data(jax.random.PRNGKey(i)))(jnp.arange(4000))
  ctx = dict(tokens_sl=jnp.zeros((4000, 1), jnp.int32), length_s=jnp.zeros((4000,), jnp.int32))
  for params in (SamplingParams(1.0, min_p=0.2), SlotSampling.of([SamplingParams(1.0, min_p=0.2)] * 4000)):
    counts = np.bincount(np.asarray(sample_step(logits, keys, params, **ctx).token), minlength=5)
    assert counts[3:].sum() == 0 and counts[2] > 0
    np.testing.assert_allclose(counts[:3] / 4000, p[:3] / p[:3].sum(), atol=0.03)


def test_top_entries_equal_lax_top_k():
  x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 1000)), jnp.float32)
  val, idx = top_entries(x, 7, blocks=64)
  ref_val, ref_idx = jax.lax.top_k(x, 7)
  np.testing.assert_array_equal(idx, ref_idx)
  np.testing.assert_array_equal(val, ref_val)


SETTINGS = [
  SamplingParams(0.0),
  SamplingParams(0.0, repetition_penalty=1.5),
  SamplingParams(0.8),
  SamplingParams(1.2, top_k=5),
  SamplingParams(0.9, top_p=0.7),
  SamplingParams(1.0, min_p=0.1),
  SamplingParams(0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=0.8),
]


def test_per_row_settings_sample_as_the_same_static_settings():
  """One call with a different setting per row = one call per setting (same keys): same tokens, log-probs."""
  rng = np.random.default_rng(2)
  s, v = len(SETTINGS), 300
  logits = jnp.asarray(rng.normal(size=(s, v)) * 2, jnp.float32)
  tokens = jnp.asarray(rng.integers(0, v, size=(s, 12)), jnp.int32)
  length = jnp.full((s,), 12)
  for seed in range(3):
    keys = jax.vmap(lambda i: jax.random.key_data(jax.random.PRNGKey(i)))(jnp.arange(s) + 100 * seed)
    rows = sample_step(logits, keys, SlotSampling.of(SETTINGS), tokens_sl=tokens, length_s=length)
    for i, p in enumerate(SETTINGS):
      one = sample_step(logits[i : i + 1], keys[i : i + 1], p, tokens_sl=tokens[i : i + 1], length_s=length[i : i + 1])
      assert int(rows.token[i]) == int(one.token[0]), p
      np.testing.assert_allclose(rows.logprob[i], one.logprob[0], atol=1e-6)
      np.testing.assert_allclose(rows.entropy[i], one.entropy[0], atol=1e-5)
      np.testing.assert_array_equal(rows.rng[i], one.rng[0])


@pytest.fixture(scope="module")
def params():
  p = init_params(CFG, jax.random.PRNGKey(0))
  return jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, p)


def run(engine, params, prompts, sampling=None, steps=10, fork=None):
  state = engine.init_decode_state()
  n = len(prompts)
  state = engine.add(params, state, list(range(n)), prompts, [7 + i for i in range(n)], steps, sampling=sampling)
  if fork is not None:
    src, dst = fork
    state = engine.copy_slots(state, [src], [dst])
  state, out = engine.decode(params, state, steps, top_logprobs=3)
  return jax.device_get(out)


def test_engine_per_slot_mode_equals_one_engine_per_setting(params):
  prompts = [[3, 5, 7, 9, 11, 13][: 2 + i % 5] for i in range(len(SETTINGS))]
  mixed = Engine(CFG, max_slots=8, max_len=32, eos_ids=(), per_slot_sampling=True, compact=False)
  out = run(mixed, params, prompts, SETTINGS)
  for i, p in enumerate(SETTINGS):
    single = Engine(CFG, max_slots=8, max_len=32, eos_ids=(), sampling=p, compact=False)
    ref = run(single, params, prompts)
    np.testing.assert_array_equal(out.token[i], ref.token[i], err_msg=str(p))
    np.testing.assert_allclose(out.logprob[i], ref.logprob[i], atol=1e-5)
    np.testing.assert_array_equal(out.top_ids[i], ref.top_ids[i])
  assert out.top_logprobs.shape == (8, 10, 3)
  np.testing.assert_allclose(out.top_logprobs[:, :, 0] >= out.top_logprobs[:, :, 1], True)
  greedy = out.token[0]
  assert (out.top_ids[0, :, 0] == greedy).all()  # greedy picks the most likely token


def test_engine_per_slot_settings_follow_forks(params):
  """copy_slots gives the fork its parent's settings (and key): it repeats the parent's penalised tokens."""
  p = SamplingParams(0.0, repetition_penalty=2.0)
  eng = Engine(CFG, max_slots=4, max_len=32, eos_ids=(), per_slot_sampling=True)
  out = run(eng, params, [[3, 5, 7]], [p], fork=(0, 2))
  np.testing.assert_array_equal(out.token[2], out.token[0])
  plain = run(eng, params, [[3, 5, 7]], [SamplingParams(0.0)])
  assert (plain.token[0] != out.token[0]).any()  # the penalty changes this greedy continuation


def test_engine_static_mode_rejects_other_settings(params):
  eng = Engine(CFG, max_slots=2, max_len=16, eos_ids=(), sampling=SamplingParams(0.8))
  with pytest.raises(ValueError, match="per_slot_sampling"):
    eng.add(params, eng.init_decode_state(), [0], [[1, 2]], [0], 4, sampling=SamplingParams(0.0))
  with pytest.raises(ValueError, match="repetition_penalty"):
    SamplingParams(repetition_penalty=0.0)
  with pytest.raises(ValueError, match="min_p"):
    SamplingParams(min_p=1.5)


def test_ignore_eos_keeps_a_slot_decoding_past_eos(params):
  plain = run(Engine(CFG, max_slots=2, max_len=32, eos_ids=(), sampling=SamplingParams(0.0)), params, [[3, 5, 7]])
  gen = plain.token[0]
  eos = int(gen[3])
  first = int(np.flatnonzero(gen == eos)[0])
  mixed = Engine(CFG, max_slots=2, max_len=32, eos_ids=(eos,), per_slot_sampling=True)
  out = run(mixed, params, [[3, 5, 7]] * 2, [SamplingParams(0.0), SamplingParams(0.0, ignore_eos=True)])
  assert out.valid[0].sum() == first + 1  # stopped on the EOS
  np.testing.assert_array_equal(out.token[1], gen)  # decoded through it
  static = Engine(CFG, max_slots=2, max_len=32, eos_ids=(eos,), sampling=SamplingParams(0.0, ignore_eos=True))
  np.testing.assert_array_equal(run(static, params, [[3, 5, 7]]).token[0], gen)


def test_per_slot_settings_follow_slots_into_compact_decoding(params):
  """Two active slots of eight: the compact call gathers their rows, settings included."""
  settings = [SamplingParams(0.0, repetition_penalty=1.5), SamplingParams(0.9, top_k=5)]
  outs = [
    run(
      Engine(CFG, max_slots=8, max_len=32, eos_ids=(), per_slot_sampling=True, compact=c),
      params,
      [[3, 5, 7], [4, 6]],
      settings,
    )
    for c in (True, False)
  ]
  np.testing.assert_array_equal(outs[0].token[:2], outs[1].token[:2])
  np.testing.assert_allclose(outs[0].logprob[:2], outs[1].logprob[:2], atol=1e-5)
