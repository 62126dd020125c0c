"""The agent loop on the REAL engine with a tiny random Llama: multi-turn pause/extend/fork, masks, log-probs.

Tool calls are forced by a tiny vocabulary: token 2 decodes to a whole `<python>1+1</python>` call and is the
engine's stop sequence, so a random model calls the tool about once per 16 tokens.
"""

import threading
import time

import jax
import numpy as np
import pytest

from aepo_jax.model import forward, init_params
from aepo_jax.rollout import Engine
from aepo_jax.rollout._agent import AgentConfig, AgentLoop
from aepo_jax.rollout.policies import rollout_policy
from aepo_jax.testing import tiny_model_config
from aepo_jax.tools import ToolSet

VOCAB = ["<pad>", "<eos>", "<python>1+1</python>", " <result>\n", "\n</result>", "2"] + list("abcdefghij")
PAD, EOS, CALL, R_OPEN, R_CLOSE, TWO = range(6)
CONFIG = tiny_model_config(vocab_size=len(VOCAB), eos_token_ids=(EOS,), pad_token_id=PAD)


class VocabTokenizer:
  def encode(self, text, add_special_tokens=False):
    out, i = [], 0
    order = sorted(range(len(VOCAB)), key=lambda j: -len(VOCAB[j]))
    while i < len(text):
      j = next((j for j in order if j > EOS and text.startswith(VOCAB[j], i)), None)
      if j is None:
        raise ValueError(f"cannot encode {text[i:]!r}")
      out.append(j)
      i += len(VOCAB[j])
    return out

  def decode(self, ids):
    return "".join(VOCAB[int(i)] for i in ids)


@pytest.fixture(scope="module")
def params():
  p = init_params(CONFIG, jax.random.PRNGKey(0))
  # Flatten the output distribution (uniform-ish: EOS and CALL each ~1/16 per token).
  p["lm_head"]["kernel"] = p["lm_head"]["kernel"] * 0.1
  return p


_ENGINES = {}


def _engine(max_slots, **engine_kw):
  return Engine(
    CONFIG,
    max_slots=max_slots,
    max_len=96,
    eos_ids=[EOS],
    stop_sequences=[[CALL]],
    entropy_window=20,
    topk_entropy=4,
    **engine_kw,
  )


def _agent(engine, tool=lambda code: "2", chunk=8, **agent_kw):
  tools = ToolSet({"python": tool}, call_limit=10, retry_count=1, max_workers=8)
  cfg = AgentConfig(max_response_len=48, max_tool_calls=3, chunk_steps=chunk, tool_tags=("python",), **agent_kw)
  return AgentLoop(engine, VocabTokenizer(), tools, cfg)


def _loop(max_slots=8, tool=lambda code: "2", chunk=8, **engine_kw):
  key = (max_slots, *sorted(engine_kw.items()))
  if key not in _ENGINES:  # one engine per size: its jitted functions compile once per module
    _ENGINES[key] = _engine(max_slots, **engine_kw)
  return _agent(_ENGINES[key], tool, chunk)


PROMPTS = [[6, 7, 8], [9, 10], [11, 12, 13, 14]]


def check_trajectories(params, tr, n=4):
  """Budget, masks, tool results, teacher-forced log-probs / entropies and fork prefixes of a rollout."""
  assert np.bincount(tr.group_id_b).tolist() == [n] * len(PROMPTS)
  assert (np.diff(tr.group_id_b) >= 0).all()
  pad = 60 - tr.tokens_bt.shape[1]  # one shape for every seed: the reference forward compiles once
  tokens = np.pad(tr.tokens_bt, ((0, 0), (0, pad)))
  logits = forward(CONFIG, params, tokens, attention_mask=np.pad(tr.attention_mask_bt, ((0, 0), (0, pad))))
  logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  ent = -(np.exp(logp) * logp).sum(-1)
  for b in range(len(tr)):
    p0, n_b = tr.prompt_len_b[b], tr.response_len_b[b]
    toks, mask = tr.tokens_bt[b, p0 : p0 + n_b], tr.loss_mask_bt[b, p0 : p0 + n_b]
    # Tool-result tokens (mask 0) are exactly the formatted results, each right after a call.
    zero = np.nonzero(mask == 0)[0]
    assert len(zero) % 3 == 0
    for start in zero[::3]:
      assert toks[start - 1] == CALL and toks[start : start + 3].tolist() == [R_OPEN, TWO, R_CLOSE]
    assert (tr.loss_mask_bt[b, p0 + n_b :] == 0).all() and (tr.loss_mask_bt[b, :p0] == 0).all()
    # Sampled tokens: engine log-probs / entropies equal a teacher-forced forward (forks included).
    sampled = np.nonzero(mask == 1)[0]
    if tr.stop_reason_b[b] == "call_limit":
      sampled = sampled[:-1]  # the appended EOS was not sampled
    pos = p0 + sampled
    np.testing.assert_allclose(tr.sampler_logprob_bt[b, pos], logp[b, pos - 1, tr.tokens_bt[b, pos]], atol=1e-4)
    np.testing.assert_allclose(tr.sampler_entropy_bt[b, pos], ent[b, pos - 1], atol=1e-4)
    # A branch shares its parent's tokens up to the fork, which is right after a tool result.
    if tr.parent_b[b] >= 0:
      f, par = tr.fork_pos_b[b], tr.parent_b[b]
      assert par < b and tr.group_id_b[par] == tr.group_id_b[b]
      np.testing.assert_array_equal(tr.tokens_bt[b, :f], tr.tokens_bt[par, :f])
      assert tr.tokens_bt[b, f - 1] == R_CLOSE
  return int((tr.parent_b >= 0).sum())


@pytest.mark.parametrize("layout", ["dense", pytest.param("paged", marks=pytest.mark.slow)])
def test_refills_fork_a_slot_holding_their_prompt(params, layout, monkeypatch):
  """ARPO that never branches (tau = w = 0): each prompt's 3 refills (fresh samples after its first one) start from
  a copy of a slot holding the prompt, rewound to it, instead of a prefill; their tokens, log-probs and entropies
  equal a teacher-forced forward (the copied KV is the prompt's), and with every slot kept none is prefilled twice."""
  loop = _loop(max_slots=16) if layout == "dense" else _paged_loop(num_pages=16 * 12 + 1, max_slots=16)
  added, add = [], loop.engine.add
  monkeypatch.setattr(loop.engine, "add", lambda p, s, slots, *a, **k: added.extend(slots) or add(p, s, slots, *a, **k))
  policy = rollout_policy("arpo", n=4, initial_rollouts=1, branch_threshold=0.0, entropy_weight=0.0)
  tr = loop.rollout(params, PROMPTS, policy, seed=5)
  assert check_trajectories(params, tr) == 0 and (tr.parent_b < 0).all()
  assert len(added) == len(PROMPTS)  # one prefill per prompt
  assert tr.stats["rollout/prefill_tokens_saved_by_fork"] == 3 * sum(len(p) for p in PROMPTS)
  assert len({tuple(t) for t in tr.tokens_bt.tolist()}) > len(PROMPTS)  # the refills sampled with their own keys


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["corrected", "faithful"])
def test_multi_turn_arpo_on_real_engine(params, mode):
  loop = _loop()
  branches = 0
  for seed in range(3):
    tr = loop.rollout(params, PROMPTS, rollout_policy("arpo", n=4, initial_rollouts=2, mode=mode), seed=seed)
    branches += check_trajectories(params, tr)
  assert branches > 0


def _paged_loop(num_pages, max_slots=8, **agent_kw):
  return _agent(_engine(max_slots, kv_layout="paged", page_size=8, num_pages=num_pages), **agent_kw)


@pytest.mark.slow
def test_paged_engine_gives_the_dense_engines_rollouts(params):
  """Same seeds, same trajectories (tokens, trees, log-probs) with the paged KV cache as with the dense one."""
  dense, paged = _loop(), _paged_loop(num_pages=8 * 12 + 1)
  for seed in range(2):
    policy = lambda: rollout_policy("arpo", n=4, initial_rollouts=2, mode="faithful")  # noqa: E731
    a, b = dense.rollout(params, PROMPTS, policy(), seed=seed), paged.rollout(params, PROMPTS, policy(), seed=seed)
    np.testing.assert_array_equal(a.tokens_bt, b.tokens_bt)
    np.testing.assert_array_equal(a.parent_b, b.parent_b)
    np.testing.assert_allclose(a.sampler_logprob_bt, b.sampler_logprob_bt, atol=1e-5)
    assert b.stats["rollout/preemptions"] == 0


@pytest.mark.slow
def test_a_small_page_pool_stalls_and_preempts_but_every_trajectory_completes(params):
  """12 pages of 8 tokens for 8 slots whose trajectories reach 51 tokens (7 pages): slots run out of pages mid-
  segment, wait, get preempted and re-prefilled; the rollout still has its budget and exact log-probs. Tool results
  enter after the next decode chunk ('next_chunk'), so whether a slot waits for pages while no tool is due does not
  hang on how fast the tool thread answers (with 'when_ready' and 20 pages a loaded CI worker once saw stalls but no
  preemption; here seeds 0 and 1 give 5 and 3 preemptions)."""
  loop = _paged_loop(num_pages=13, tool_results="next_chunk")
  stalls = preempted = 0
  for seed in range(2):
    tr = loop.rollout(params, PROMPTS, rollout_policy("arpo", n=4, initial_rollouts=2, mode="faithful"), seed=seed)
    check_trajectories(params, tr)
    preempted += tr.stats["rollout/preemptions"]
    stalls += loop.last_run.stall_events
  assert stalls > 0 and preempted > 0


def test_a_pool_smaller_than_one_trajectory_is_a_clear_error(params):
  loop = _paged_loop(num_pages=4)  # 3 pages of 8 tokens: not even 3 + 48 tokens
  with pytest.raises(ValueError, match="cannot hold one trajectory"):
    loop.rollout(params, PROMPTS[:1], rollout_policy("none", n=1), seed=0)


@pytest.mark.slow  # compiles the engine (~60 s on 2 cores)
def test_slow_tool_overlaps_decoding(params):
  """While one slot waits on a slow tool, the other slots keep decoding (measured in decoded tokens)."""
  first = threading.Event()

  def tool(code):
    if not first.is_set():
      first.set()
      time.sleep(1.0)
    return "2"

  loop = _loop(tool=tool)
  tr = loop.rollout(params, PROMPTS + [[6, 6], [7, 7]], rollout_policy("none", n=2), seed=3)
  overlap = loop.last_run.tool_overlap
  assert len(tr) == 10 and overlap
  assert max(overlap) > 0, overlap
  assert tr.stats["rollout/decode_tokens"] > 0


@pytest.mark.slow
def test_more_trajectories_than_slots_are_queued(params):
  loop = _loop(max_slots=2)
  tr = loop.rollout(
    params, PROMPTS, rollout_policy("aepo", n=3, initial_rollouts=2, enable_dynamic_rollouts=True), seed=5
  )
  assert np.bincount(tr.group_id_b).tolist() == [3, 3, 3]
  assert np.isfinite(tr.stats["rollout/probe_h_root"])


def test_prompt_longer_than_cache_is_rejected(params):
  loop = _loop()
  with pytest.raises(ValueError, match="max_len"):
    loop.rollout(params, [[6] * 60], rollout_policy("none", n=1))


def test_entropy_window_must_match_the_engine(params):
  with pytest.raises(ValueError, match="entropy_window"):
    _loop().rollout(params, PROMPTS, rollout_policy("arpo", n=2, initial_rollouts=1, entropy_window=10))


def test_preempted_trajectories_do_not_take_back_the_pages_a_stalled_slot_waits_for():
  """Two trajectories of 43 tokens (11 pages of 4 each) and 12 usable pages: both stall, one is preempted, and
  re-admitting it must not take the freed pages straight back from the other (a livelock found in review)."""
  cfg = tiny_model_config(eos_token_ids=(96,), pad_token_id=0)
  p = init_params(cfg, jax.random.PRNGKey(0))
  engine = Engine(
    cfg, max_slots=2, max_len=64, eos_ids=[96], prefill_chunk=16, kv_layout="paged", page_size=4, num_pages=13
  )

  class Tok:
    def decode(self, ids):
      return " ".join(map(str, ids))

    def encode(self, text, add_special_tokens=False):
      return []

  tools = ToolSet({"python": lambda code: "2"}, call_limit=10, retry_count=1, max_workers=2)
  agent = AgentConfig(
    max_response_len=40, max_tool_calls=0, chunk_steps=4, tool_tags=("python",), check_stop_strings=False
  )
  loop = AgentLoop(engine, Tok(), tools, agent)
  tr = loop.rollout(p, [[6, 7, 8], [9, 10, 11]], rollout_policy("none", n=1), seed=0)
  assert len(tr) == 2 and tr.stats["rollout/preemptions"] <= 4, tr.stats
  assert loop.last_run.stall_events > 0
