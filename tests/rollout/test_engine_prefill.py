"""How the engine plans prefill (chunks and rows per call), prefills a prompt shared by several slots once, and
sizes compact decode calls; every plan checked against a teacher-forced `forward`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aepo_jax.model import forward, init_params
from aepo_jax.rollout import Engine, SamplingParams
from aepo_jax.rollout import _prefill
from aepo_jax.testing import tiny_model_config

CFG = tiny_model_config("qwen3", attention_bias=True, eos_token_ids=(1,))
TOL = 1e-4


@pytest.fixture(scope="module")
def params():
  p = init_params(CFG, jax.random.PRNGKey(0))
  return jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, p)  # far from uniform: tokens vary


def test_rows_and_chunks_per_prefill_call():
  dense = Engine(CFG, max_slots=32, max_len=256, prefill_rows=16, prefill_chunk=128)
  assert [dense._row_calls(n) for n in (1, 2, 3, 5, 6, 7, 9, 13, 16, 17, 33)] == [
    [2],  # one row runs as two: XLA:CPU copies the whole dense cache per layer in a one-row call
    [2],
    [4],
    [4, 2],
    [8],
    [8],
    [8, 2],
    [16],
    [16],
    [16, 2],
    [16, 16, 2],
  ]
  assert Engine(CFG, max_slots=32, max_len=256, prefill_rows=12)._row_calls(12) == [8, 4]  # never above prefill_rows
  assert Engine(CFG, max_slots=1, max_len=256)._row_calls(1) == [1]
  paged = Engine(CFG, max_slots=32, max_len=256, kv_layout="paged", page_size=16)
  assert paged._row_calls(1) == [1]
  assert [dense._chunk_for(n) for n in (1, 10, 16, 17, 24, 40, 90, 100, 128, 500)] == [
    16,
    16,
    16,
    32,
    32,  # 24: no split below 64 (16 + 16 computes as much)
    32,  # 40: 32, then 8 in a chunk of 16
    64,  # 90 of 128: 64, then 26 in a chunk of 32
    128,
    128,
    128,  # capped at prefill_chunk
  ]
  assert [paged._chunk_for(n) for n in (1, 20, 90)] == [16, 32, 64]  # whole pages of 16


def _greedy(engine, params, slots, prompts, seeds, steps, budgets=8):
  s = engine.add(params, engine.init_decode_state(), slots, prompts, seeds, budgets)
  s, out = engine.decode(params, s, steps)
  return s, jax.device_get(out)


def _check_against_forward(engine, params, s, out, slots, temperature):
  for slot in slots:
    toks = engine.slot_tokens(s, slot)
    v = np.asarray(out.valid[slot], bool)
    n = int(v.sum())
    assert n > 0
    start = len(toks) - n
    logp = np.asarray(jax.nn.log_softmax(forward(CFG, params, jnp.asarray(toks)[None])[0] / temperature, -1))
    gen = toks[start:]
    np.testing.assert_array_equal(out.token[slot][v], gen)
    np.testing.assert_allclose(out.logprob[slot][v], logp[np.arange(start - 1, len(toks) - 1), gen], atol=TOL)


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_mixed_lengths_duplicates_and_extends_match_the_forward(params, layout):
  """Prompts of 1 to 45 tokens (several chunk groups and row calls in one add), two prompts given to three slots
  (prefilled once, forked), then tool results of different lengths: every sampled token's log-prob equals the
  teacher-forced forward, so every KV entry the plan wrote is right."""
  eng = Engine(
    CFG,
    max_slots=8,
    max_len=96,
    eos_ids=(),
    prefill_chunk=32,
    prefill_rows=4,
    sampling=SamplingParams(0.8),
    kv_layout=layout,
    page_size=8,
  )
  rng = np.random.default_rng(0)
  a, b = rng.integers(2, CFG.vocab_size, 21).tolist(), rng.integers(2, CFG.vocab_size, 9).tolist()
  prompts = [
    a,
    [7],
    rng.integers(2, CFG.vocab_size, 45).tolist(),
    a,
    b,
    rng.integers(2, CFG.vocab_size, 3).tolist(),
    a,
    b,
  ]
  slots = list(range(8))
  s, out = _greedy(eng, params, slots, prompts, seeds=slots, steps=6, budgets=6)
  _check_against_forward(eng, params, s, out, slots, 0.8)
  tools = [rng.integers(2, CFG.vocab_size, n).tolist() for n in (1, 5, 17, 40, 2, 9, 33, 3)]
  s = eng.extend(params, s, slots, tools, max_new_tokens=4)
  s, out = eng.decode(params, s, 4)
  _check_against_forward(eng, params, s, jax.device_get(out), slots, 0.8)


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_a_prompt_given_to_several_slots_is_prefilled_once_with_each_slots_own_settings(params, layout, monkeypatch):
  """Slots 1 and 3 repeat slot 0's prompt: one prefill row for it (the others are forks), and each slot keeps
  its seed and budget: the results equal adding the prompts one call at a time."""
  kw = dict(max_slots=4, max_len=48, eos_ids=(), prefill_chunk=16, sampling=SamplingParams(0.8), kv_layout=layout)
  prompt, other = list(range(3, 23)), [5, 6, 7]
  rows = []
  real = _prefill._fill

  def counting(config, chunk, attend, p, state, slots_n, start_n, from_n):
    rows.append(np.asarray(slots_n).tolist())
    return real(config, chunk, attend, p, state, slots_n, start_n, from_n)

  eng = Engine(CFG, page_size=8, **kw)
  monkeypatch.setattr(_prefill, "_fill", counting)
  s = eng.add(
    params, eng.init_decode_state(), [0, 1, 2, 3], [prompt, prompt, other, prompt], [11, 12, 13, 11], [6, 3, 6, 6]
  )
  monkeypatch.setattr(_prefill, "_fill", real)
  assert not {1, 3} & {r for call in rows for r in call}, rows  # only slots 0 and 2 were prefilled
  if layout == "paged":
    assert eng.page_stats(s)["pages_shared"] >= 2  # the forks share the prompt's full pages
  s, out = eng.decode(params, s, 8)
  out = jax.device_get(out)

  ref = Engine(CFG, page_size=8, **kw)
  r = ref.init_decode_state()
  for slot, p, seed, budget in zip([0, 1, 2, 3], [prompt, prompt, other, prompt], [11, 12, 13, 11], [6, 3, 6, 6]):
    r = ref.add(params, r, [slot], [p], [seed], budget)
  r, ref_out = ref.decode(params, r, 8)
  ref_out = jax.device_get(ref_out)
  assert np.asarray(out.valid).sum(1).tolist() == [6, 3, 6, 6]  # each slot's own budget
  np.testing.assert_array_equal(out.token, ref_out.token)
  np.testing.assert_allclose(np.where(out.valid, out.logprob, 0), np.where(ref_out.valid, ref_out.logprob, 0), atol=TOL)
  np.testing.assert_array_equal(out.token[0], out.token[3])  # same prompt, same seed
  _check_against_forward(eng, params, s, out, [0, 1, 2, 3], 0.8)


def test_decode_row_sizes():
  """The compact call's row sizes: S/4, then 1.5x rounded up to the kernel's 4-row tile while below S and
  max_decode_rows (which is a size itself where below S); XLA's path keeps S/4 only."""
  kw = dict(max_len=40, eos_ids=())
  assert Engine(CFG, max_slots=32, **kw).decode_row_sizes() == (8, 12, 20)
  assert Engine(CFG, max_slots=32, max_decode_rows=16, **kw).decode_row_sizes() == (8, 12, 16)
  assert Engine(CFG, max_slots=32, max_decode_rows=16, **kw).decode_row_sizes(ladder=False) == (8,)
  assert Engine(CFG, max_slots=16, **kw).decode_row_sizes() == (4, 8, 12)
  assert Engine(CFG, max_slots=40, **kw).decode_row_sizes() == (10, 16, 24, 36)
  assert Engine(CFG, max_slots=16, max_decode_rows=4, **kw).decode_row_sizes() == (4,)
  assert Engine(CFG, max_slots=4, **kw).decode_row_sizes() == ()
  assert Engine(CFG, max_slots=32, compact=False, **kw).decode_row_sizes() == ()
  assert Engine(CFG, max_slots=32, max_decode_rows=6, **kw).decode_row_sizes() == (6,)  # a cap below S/4
  assert Engine(CFG, max_slots=32, max_decode_rows=18, **kw).decode_row_sizes() == (8, 12, 18)
  assert Engine(CFG, max_slots=32, max_decode_rows=13, **kw).decode_row_sizes() == (8, 13)  # not 12 and 13
  assert Engine(CFG, max_slots=32, max_decode_rows=32, **kw).decode_row_sizes() == (8, 12, 20)  # cap >= S: none
  assert Engine(CFG, max_slots=8, **kw).decode_row_sizes() == (4,)


def test_compact_decode_ladder_through_the_cpu_kernel(params):
  """Through the CPU decode kernel a call runs the smallest of its row sizes (S = 16: 4, 8, 12) that holds the
  active slots (its cost grows with the rows); XLA's path keeps one compact size. Same tokens and log-probs as
  decoding all slots, at 6 active slots (8 rows) and at 10 (12 rows)."""
  eng = Engine(CFG, max_slots=16, max_len=40, eos_ids=(), sampling=SamplingParams(0.8))
  full = Engine(CFG, max_slots=16, max_len=40, eos_ids=(), sampling=SamplingParams(0.8), compact=False)
  assert eng.uses_cpu_kernels(params)
  for slots, rows in (
    ([0, 2, 3, 5, 8, 9], [0, 1, 2, 3, 4, 5, 8, 9]),  # 6 active: more than S/4 = 4, at most 8
    ([0, 2, 3, 5, 6, 8, 9, 11, 13, 15], [0, 1, 2, 3, 4, 5, 6, 8, 9, 11, 13, 15]),  # 10 active: 12 rows
  ):
    prompts = [[5 + i, 6, 7 + i] for i in range(len(slots))]
    s = eng.add(params, eng.init_decode_state(), slots, prompts, slots, 5)
    assert eng._decode_rows(s, ladder=False) is None
    np.testing.assert_array_equal(eng._decode_rows(s, ladder=True), rows)
    s, out = eng.decode(params, s, 5)
    f, ref = _greedy(full, params, slots, prompts, slots, 5, budgets=5)
    out = jax.device_get(out)
    np.testing.assert_array_equal(out.token, ref.token)
    np.testing.assert_allclose(np.where(out.valid, out.logprob, 0), np.where(ref.valid, ref.logprob, 0), atol=1e-5)
  s = eng.add(params, s, list(range(16)), [[5, 6]] * 16, list(range(16)), 4)
  assert eng._decode_rows(s, ladder=True) is None  # 16 of 16 active: all slots


def test_max_decode_rows_runs_the_first_active_slots_of_the_order_and_the_rest_wait(params):
  """Through the CPU kernel, max_decode_rows=4 of 16 slots with 10 active: a call runs the first 4 active slots of
  `order` (a slot missing from it comes last); the others keep their length and get no valid output. Run to the
  end in changing orders, every slot's tokens and log-probs equal those of decoding all slots together."""
  kw = dict(max_slots=16, max_len=40, eos_ids=(), sampling=SamplingParams(0.8))
  eng = Engine(CFG, max_decode_rows=4, **kw)
  assert eng.uses_cpu_kernels(params)
  slots = list(range(10))
  prompts = [[5 + i, 6, 7 + i] for i in slots]
  s = eng.add(params, eng.init_decode_state(), slots, prompts, slots, 6)
  np.testing.assert_array_equal(eng._decode_rows(s, ladder=True, order=[9, 7, 5]), [0, 5, 7, 9])
  s, out = eng.decode(params, s, 2, order=[9, 8, 7, 6])
  out = jax.device_get(out)
  assert np.asarray(out.valid).sum(1).tolist() == [0] * 6 + [2] * 4 + [0] * 6
  assert eng.host_info(s)["length"][:10].tolist() == [3] * 6 + [5] * 4
  got = {i: list(out.token[i][out.valid[i]]) for i in slots}
  lps = {i: list(out.logprob[i][out.valid[i]]) for i in slots}
  orders = [list(range(10)), [3, 1], None, list(range(9, -1, -1))]
  for k in range(20):
    s, out = eng.decode(params, s, 2, order=orders[k % len(orders)])
    out = jax.device_get(out)
    assert np.asarray(out.valid).any(1).sum() <= 4
    for i in slots:
      got[i] += list(out.token[i][out.valid[i]])
      lps[i] += list(out.logprob[i][out.valid[i]])
  ref_eng = Engine(CFG, compact=False, **kw)
  _, ref = _greedy(ref_eng, params, slots, prompts, slots, 6, budgets=6)
  for i in slots:
    v = np.asarray(ref.valid[i], bool)
    assert got[i] == ref.token[i][v].tolist(), i
    np.testing.assert_allclose(lps[i], ref.logprob[i][v], atol=1e-5)
  with pytest.raises(ValueError, match="max_decode_rows"):
    Engine(CFG, max_decode_rows=-1, **kw)


def _slot_kv(state, key: str, slot: int, n: int) -> np.ndarray:
  """The first n KV entries of a slot, [layers, ...] (the paged pool read through the slot's page table)."""
  if not state.paged:
    return np.asarray(state.cache[key][:, slot, :n])
  table, ps = np.asarray(state.page_table[slot]), state.page_size
  pos = np.arange(n)
  return np.stack([np.asarray(layer)[:, table[pos // ps], pos % ps] for layer in state.cache[key]])


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_row_edits_of_any_slot_count_compile_once_per_power_of_two_and_match_one_slot_at_a_time(params, layout):
  """add, fork, cut, extend and release of 3 slots run padded to 4 rows (padding rows name slot S: dropped writes;
  paged: left out of every page count and allocation), so 3 and 4 slots share one program, and the state after
  them equals doing each slot alone (paged: the same pages held and shared, each slot's KV read through its table)."""
  from aepo_jax.rollout import _compiled

  kw = dict(max_slots=8, max_len=48, eos_ids=(), prefill_chunk=16, sampling=SamplingParams(0.8))
  if layout == "paged":
    kw.update(kv_layout="paged", page_size=8)
  prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13]]
  tools = [[20, 21], [22], [23, 24, 25]]

  def edits(eng, groups):
    s = eng.init_decode_state()
    for g in groups:  # slots 0..2: prompts; 3..5: forks of them; then cut, extend, decode, release 3..5
      s = eng.add(params, s, g, [prompts[i] for i in g], [7 + i for i in g], 6)
    s, _ = eng.decode(params, s, 3)
    for g in groups:
      s = eng.copy_slots(s, g, [3 + i for i in g], seeds=[30 + i for i in g])
      s = eng.truncate(s, [3 + i for i in g], [len(prompts[i]) + 1 for i in g])
      s = eng.extend(params, s, [3 + i for i in g], [tools[i] for i in g], max_new_tokens=4)
    s, _ = eng.decode(params, s, 4)
    live = jax.device_get(s)
    for g in groups:
      s = eng.release(s, [3 + i for i in g])
    return live, jax.device_get(s)

  eng = Engine(CFG, **kw)
  programs = ("_start", "_copy", "_truncate", "_release", "_page_needs")
  before = {f: getattr(_compiled, f)._cache_size() for f in programs}
  together = edits(eng, [[0, 1, 2]])
  grown = {f: getattr(_compiled, f)._cache_size() - n for f, n in before.items()}
  eng.release(
    eng.add(params, eng.init_decode_state(), [0, 1, 2, 3], [[5], [6], [7], [8]], [1, 2, 3, 4], 2), [0, 1, 2, 3]
  )
  assert {f: getattr(_compiled, f)._cache_size() - n for f, n in before.items()} == grown  # 4 slots: same programs
  alone = edits(Engine(CFG, **kw), [[0], [1], [2]])
  fields = ("tokens", "length", "active", "budget", "n_generated", "stop_reason", "seg_start", "seg_count", "rng")
  for a, b in zip(together, alone):
    for name in fields:
      np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
  assert np.asarray(together[0].length)[3:6].min() > 0 and not np.asarray(together[1].length)[3:].any()
  length = np.asarray(together[0].length)
  for k in together[0].cache:  # KV entries below each slot's length (the rest is never read)
    for slot in range(8):
      n = int(length[slot]) - (layout == "paged")  # paged: the pages cover [0, length - 1)
      a, b = _slot_kv(together[0], k, slot, n), _slot_kv(alone[0], k, slot, n)
      np.testing.assert_allclose(a, b, atol=TOL, err_msg=f"{k} slot {slot}")
  if layout == "paged":  # every count is the number of table entries holding the page; the same pages shared
    for a, b in zip(together, alone):
      for state in (a, b):
        table, refs = np.asarray(state.page_table), np.asarray(state.page_refs)
        held = np.bincount(table[table > 0], minlength=refs.size)
        np.testing.assert_array_equal(refs[1:], held[1:])
      assert np.array_equal(np.sort(np.asarray(a.page_refs)), np.sort(np.asarray(b.page_refs)))
