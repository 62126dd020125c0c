"""Engine numerics against a teacher-forced `forward`, forks, rewinds, stop conditions and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aepo_jax.model import forward, init_params
from aepo_jax.rollout import Engine, SamplingParams, STOP_BUDGET, STOP_CACHE_FULL, STOP_EOS, STOP_SEQUENCE
from aepo_jax.testing import tiny_model_config

CFG = tiny_model_config("qwen3", attention_bias=True, eos_token_ids=(1,))
TOL = 1e-4


@pytest.fixture(scope="module")
def params():
  p = init_params(CFG, jax.random.PRNGKey(0))
  # Larger weights than the default init, so distributions are far from uniform and tokens vary.
  return jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, p)


@pytest.fixture(scope="module")
def engine():
  return Engine(CFG, max_slots=4, max_len=48, eos_ids=(), prefill_chunk=16, sampling=SamplingParams(0.8))


def reference(params, tokens, temperature):
  """Per-position log-softmax at the temperature, exact entropy and top-10 entropy pieces, teacher-forced."""
  z = forward(CFG, params, jnp.asarray(tokens)[None])[0] / temperature
  logp = jax.nn.log_softmax(z, -1)
  ent = -(jnp.exp(logp) * logp).sum(-1)
  return np.asarray(logp), np.asarray(ent)


def ref_topk_entropy(logp_v, tok, k=10):
  top = np.sort(logp_v)[::-1][:k]
  h = -(np.exp(top) * top).sum()
  if logp_v[tok] < top[-1]:
    h += -np.exp(logp_v[tok]) * logp_v[tok]
  return h


def check_outputs(params, toks, start, out_row, n, temperature=0.8):
  """tokens toks[start:start+n] were sampled: compare engine outputs with the teacher-forced forward."""
  logp, ent = reference(params, toks, temperature)
  pos = np.arange(start - 1, start - 1 + n)
  gen = np.asarray(toks[start : start + n])
  np.testing.assert_array_equal(out_row["token"][:n], gen)
  np.testing.assert_allclose(out_row["logprob"][:n], logp[pos, gen], atol=TOL)
  np.testing.assert_allclose(out_row["entropy"][:n], ent[pos], atol=TOL)
  topk = [ref_topk_entropy(logp[p], g) for p, g in zip(pos, gen)]
  np.testing.assert_allclose(out_row["topk_entropy"][:n], topk, atol=TOL)


def row(out, slot):
  out = jax.device_get(out)
  v = out.valid[slot]
  return {k: getattr(out, k)[slot][v] for k in ("token", "logprob", "entropy", "topk_entropy")}


@pytest.mark.slow
def test_decode_extend_copy_match_teacher_forced_forward(params, engine):
  s = engine.init_decode_state()
  s = engine.add(params, s, [0, 2], [[5, 6, 7, 8, 9], list(range(10, 40))], [1, 2], 6)
  s, out = engine.decode(params, s, 8)
  info = engine.host_info(s)
  assert info["stop_reason"].tolist() == [STOP_BUDGET, 0, STOP_BUDGET, 0]
  assert info["n_generated"].tolist() == [6, 0, 6, 0]
  for slot, plen in ((0, 5), (2, 30)):
    toks = engine.slot_tokens(s, slot)
    check_outputs(params, toks, plen, row(out, slot), 6)
    # segment accumulators: sums over the first entropy_window (20) generated tokens
    np.testing.assert_allclose(info["seg_entropy_sum"][slot], row(out, slot)["entropy"].sum(), atol=TOL)
    np.testing.assert_allclose(info["seg_topk_entropy_sum"][slot], row(out, slot)["topk_entropy"].sum(), atol=TOL)

  # extend slot 0 with a "tool result" (longer than one prefill chunk), then keep decoding
  tool = list(range(40, 60))
  s = engine.extend(params, s, [0], [tool], max_new_tokens=5)
  assert engine.host_info(s)["seg_count"][0] == 0
  s, out = engine.decode(params, s, 8)
  toks = engine.slot_tokens(s, 0)
  assert toks[11:31].tolist() == tool and len(toks) == 36
  check_outputs(params, toks, 31, row(out, 0), 5)

  # fork slot 0 into slot 1 (fresh key) and slot 3 (parent's key)
  s = engine.extend(params, s, [0], [[61, 62]], max_new_tokens=7)
  s = engine.copy_slots(s, [0, 0], [1, 3], seeds=[123, None])
  s, out = engine.decode(params, s, 8)
  parent, fresh, same = (engine.slot_tokens(s, k) for k in (0, 1, 3))
  np.testing.assert_array_equal(parent, same)
  assert not np.array_equal(parent, fresh)
  for slot in (0, 1):
    check_outputs(params, engine.slot_tokens(s, slot), 38, row(out, slot), 7)


def test_truncate_rewinds_and_recomputes_counters(params, engine):
  s = engine.init_decode_state()
  s = engine.add(params, s, [1], [[3, 4, 5]], [7], 8)
  s, out = engine.decode(params, s, 8)
  full = engine.slot_tokens(s, 1)
  r = row(out, 1)
  s = engine.truncate(s, [1], [7])
  info = engine.host_info(s)
  assert info["length"][1] == 7 and not info["active"][1] and info["stop_reason"][1] == 0
  assert info["n_generated"][1] == 4 and info["budget"][1] == 4 and info["seg_count"][1] == 4
  np.testing.assert_allclose(info["seg_entropy_sum"][1], r["entropy"][:4].sum(), atol=TOL)
  s = engine.extend(params, s, [1], [[]])  # resume
  s, out = engine.decode(params, s, 8)
  toks = engine.slot_tokens(s, 1)
  assert toks[:7].tolist() == full[:7].tolist() and len(toks) == 11
  check_outputs(params, toks, 7, row(out, 1), 4)


def test_greedy_is_argmax_and_seeds_repeat(params):
  eng = Engine(CFG, max_slots=2, max_len=32, eos_ids=(), sampling=SamplingParams(0.0))
  s = eng.init_decode_state()
  s = eng.add(params, s, [0, 1], [[5, 6, 7]] * 2, [0, 99], 8)
  s, out = eng.decode(params, s, 8)
  toks = eng.slot_tokens(s, 0)
  np.testing.assert_array_equal(toks, eng.slot_tokens(s, 1))  # greedy ignores keys
  logits = forward(CFG, params, jnp.asarray(toks)[None])[0]
  np.testing.assert_array_equal(np.argmax(np.asarray(logits), -1)[2:-1], toks[3:])


@pytest.mark.slow
def test_stop_conditions(params):
  # Find what greedy generates, then make its 3rd token an EOS and its tokens 4..5 a stop sequence.
  eng = Engine(CFG, max_slots=1, max_len=32, eos_ids=(), sampling=SamplingParams(0.0))
  s = eng.add(params, eng.init_decode_state(), [0], [[5, 6, 7]], [0], 8)
  s, _ = eng.decode(params, s, 8)
  gen = eng.slot_tokens(s, 0)[3:].tolist()
  eos_eng = Engine(CFG, max_slots=1, max_len=32, eos_ids=(gen[2],), sampling=SamplingParams(0.0))
  s = eos_eng.add(params, eos_eng.init_decode_state(), [0], [[5, 6, 7]], [0], 8)
  s, out = eos_eng.decode(params, s, 8)
  first = gen.index(gen[2]) + 1
  assert eos_eng.host_info(s)["stop_reason"][0] == STOP_EOS and int(out.valid[0].sum()) == first
  seq = gen[3:5]
  stop_eng = Engine(
    CFG, max_slots=1, max_len=32, eos_ids=(), stop_sequences=[seq, [96, 95, 94]], sampling=SamplingParams(0.0)
  )
  s = stop_eng.add(params, stop_eng.init_decode_state(), [0], [[5, 6, 7]], [0], 8)
  s, out = stop_eng.decode(params, s, 8)
  hit = min(i + 2 for i in range(len(gen) - 1) if gen[i : i + 2] == seq)
  assert stop_eng.host_info(s)["stop_reason"][0] == STOP_SEQUENCE and int(out.valid[0].sum()) == hit
  # cache full: max_len 8 with a 3-token prompt stops after 5 tokens, recorded, no wrap-around
  small = Engine(CFG, max_slots=1, max_len=8, eos_ids=(), sampling=SamplingParams(0.0))
  s = small.add(params, small.init_decode_state(), [0], [[5, 6, 7]], [0], 100)
  s, out = small.decode(params, s, 8)
  assert small.host_info(s)["stop_reason"][0] == STOP_CACHE_FULL and int(out.valid[0].sum()) == 5
  np.testing.assert_array_equal(small.slot_tokens(s, 0), [5, 6, 7] + gen[:5])
  # a prompt of exactly max_len tokens is recorded as cache full, nothing decoded
  s = small.add(params, s, [0], [list(range(2, 10))], [0], 5)
  s, out = small.decode(params, s, 8)
  assert small.host_info(s)["stop_reason"][0] == STOP_CACHE_FULL and not out.valid.any()


def test_bad_input_is_rejected_before_compute(params, engine):
  s = engine.init_decode_state()
  with pytest.raises(ValueError, match="max_len=48"):
    engine.add(params, s, [0], [list(range(49))], [0], 4)
  with pytest.raises(ValueError, match="out of range"):
    engine.add(params, s, [4], [[1, 2]], [0], 4)
  with pytest.raises(ValueError, match="duplicates"):
    engine.add(params, s, [1, 1], [[1, 2], [3]], [0, 1], 4)
  with pytest.raises(ValueError, match="token ids outside"):
    engine.add(params, s, [0], [[1, 97]], [0], 4)
  with pytest.raises(ValueError, match="empty"):
    engine.add(params, s, [0], [[]], [0], 4)
  with pytest.raises(ValueError, match="stop sequence"):
    Engine(CFG, max_slots=1, max_len=8, stop_sequences=[[]])
  s = engine.add(params, s, [0], [list(range(2, 40))], [0], 4)
  with pytest.raises(ValueError, match="still decoding"):
    engine.extend(params, s, [0], [[3]])
  s, _ = engine.decode(params, s, 8)
  with pytest.raises(ValueError, match="more than max_len"):
    engine.extend(params, s, [0], [list(range(2, 12))])
  with pytest.raises(ValueError, match="empty"):
    engine.extend(params, s, [1], [[3]])
  with pytest.raises(ValueError, match="overlap"):
    engine.copy_slots(s, [0], [0])
  with pytest.raises(ValueError, match="lengths"):
    engine.truncate(s, [0], [100])
  # the state is still usable after the rejected calls
  assert engine.host_info(s)["length"][0] == 42


def test_sharded_cache_matches_single_device(params):
  from aepo_jax.parallel import make_mesh

  mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  out = []
  for m in (None, mesh):
    eng = Engine(CFG, max_slots=4, max_len=32, eos_ids=(), sampling=SamplingParams(0.8), mesh=m)
    s = eng.add(params, eng.init_decode_state(), [0, 1, 2, 3], [[5, 6, 7]] * 4, [0, 1, 2, 3], 8)
    s, o = eng.decode(params, s, 8)
    if m is not None:
      assert len(s.cache["k"].sharding.device_set) == 8
      assert not eng.uses_cpu_kernels(params)  # a mesh decodes with XLA's dots (the accelerator path) ...
    out.append(jax.device_get(o))  # ... one CPU device with the small-M kernel where it builds: both must agree
  np.testing.assert_array_equal(out[0].token, out[1].token)
  np.testing.assert_allclose(out[0].logprob, out[1].logprob, atol=TOL)


def test_generate_queues_more_prompts_than_slots(params):
  from aepo_jax.rollout import generate

  prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
  queued = generate(
    CFG, params, prompts, max_new_tokens=6, temperature=0.8, seed=3, max_slots=2, eos_ids=(), steps_per_call=8
  )
  at_once = generate(CFG, params, prompts, max_new_tokens=6, temperature=0.8, seed=3, eos_ids=(), steps_per_call=8)
  for a, b in zip(queued, at_once):
    assert a["stop_reason"] == b["stop_reason"] == "length" and len(a["tokens"]) == 6
    np.testing.assert_array_equal(a["tokens"], b["tokens"])  # per-prompt seeds: slot placement does not matter
    np.testing.assert_allclose(a["entropies"], b["entropies"], atol=TOL)


def test_compact_decode_runs_only_the_active_slots(params):
  """With few active slots, a decode call gathers them (and inactive padding up to max(4, ceil(S/4)) rows),
  decodes and writes them back: the same tokens, log-probs and entropies as decoding all slots (and as the
  teacher-forced forward), while paused slots, KV rows included, stay untouched (bit for bit)."""
  engines = {
    c: Engine(CFG, max_slots=8, max_len=40, eos_ids=(), sampling=SamplingParams(0.8), compact=c) for c in (True, False)
  }
  results = {}
  for compact, eng in engines.items():
    s = eng.init_decode_state()
    s = eng.add(params, s, [7], [[3, 4, 5, 6]], [7], 0)  # paused (no budget): must not change
    s = eng.add(params, s, [2, 5], [[5, 6, 7], [9, 10, 11, 12, 13]], [1, 2], 12)
    before = jax.device_get((s.cache["k"][:, 7], s.tokens[7], s.length[7]))
    rows = eng._decode_rows(s)
    if compact:  # 2 active of 8 slots: a 4-row call, padded with the first inactive slots
      np.testing.assert_array_equal(rows, [0, 1, 2, 5])
    else:
      assert rows is None
    s, out = eng.decode(params, s, 6)
    after = jax.device_get((s.cache["k"][:, 7], s.tokens[7], s.length[7]))
    if compact:  # (decoding all slots rewrites a paused slot's last KV entry with decode-path rounding)
      for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert not np.asarray(out.valid)[[0, 1, 3, 4, 6, 7]].any()
    results[compact] = (row(out, 2), row(out, 5), eng.slot_tokens(s, 2), eng.slot_tokens(s, 5))
  for a, b in zip(results[True][:2], results[False][:2]):
    np.testing.assert_array_equal(a["token"], b["token"])
    for k in ("logprob", "entropy", "topk_entropy"):
      np.testing.assert_allclose(a[k], b[k], atol=1e-5)
  check_outputs(params, results[True][2], 3, results[True][0], 6)
  check_outputs(params, results[True][3], 5, results[True][1], 6)
  # Five active of eight: more than the 4-row call holds, all slots run.
  eng = engines[True]
  s = eng.add(params, eng.init_decode_state(), list(range(5)), [[5, 6, 7]] * 5, list(range(5)), 4)
  assert eng._decode_rows(s) is None
