"""Routing replay through the agent loop (R3, arXiv 2510.11370): with `Engine(record_routes=True)` every trajectory
comes back with the experts each of its tokens went to (`Trajectories.routes_btsk`), through tool pauses, forks on
the device (the child's slot holds its parent's prefix routes) and, with a small paged pool, preemptions and
re-prefills. A teacher-forced forward that replays those routes gives the sampler's log-probs on every loss token
(float32, TOL); the same forward routing itself may not (the router's top-k flips where its probabilities tie).

A tiny random Qwen3-MoE model (3 layers, the middle one dense, 6 experts, top 2) on test_agent_engine.py's forced
tool vocabulary (token 2 is a whole `<python>` call)."""

import jax
import numpy as np
import pytest

from aepo_jax.model import forward, init_params
from aepo_jax.rollout import Engine, concat_groups
from aepo_jax.rollout._agent import AgentConfig, AgentLoop
from aepo_jax.rollout.policies import rollout_policy
from aepo_jax.testing import tiny_model_config
from aepo_jax.tools import ToolSet
from test_agent_engine import CALL, EOS, PAD, PROMPTS, VOCAB, VocabTokenizer

CONFIG = tiny_model_config(
  "qwen3_moe",
  vocab_size=len(VOCAB),
  eos_token_ids=(EOS,),
  pad_token_id=PAD,
  num_layers=3,
  mlp_only_layers=(1,),
  num_experts=6,
  num_experts_per_tok=2,
  moe_intermediate_size=16,
)
L_SPARSE, K = 2, 2
TOL = 1e-4  # |Δlog-prob| engine vs teacher-forced forward, float32 (tests/model/test_routing_replay.py's)


@pytest.fixture(scope="module")
def params():
  p = init_params(CONFIG, jax.random.PRNGKey(0))
  p = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, p)  # far from uniform: routes vary between tokens
  p["lm_head"]["kernel"] = p["lm_head"]["kernel"] * 0.02  # a flat output: EOS and the call ~1/16 per token
  return p


def _loop(tool_results="when_ready", **engine_kw):
  engine = Engine(
    CONFIG,
    max_slots=8,
    max_len=96,
    eos_ids=[EOS],
    stop_sequences=[[CALL]],
    entropy_window=20,
    topk_entropy=4,
    record_routes=True,
    **engine_kw,
  )
  tools = ToolSet({"python": lambda code: "2"}, call_limit=10, retry_count=1, max_workers=8)
  cfg = AgentConfig(
    max_response_len=48, max_tool_calls=3, chunk_steps=8, tool_tags=("python",), tool_results=tool_results
  )
  return AgentLoop(engine, VocabTokenizer(), tools, cfg)


def _replay_diffs(params, tr):
  """max |sampler log-prob - teacher-forced log-prob| over loss tokens, with the rollout's routes and without."""
  width = 60  # one shape for every rollout: the reference forwards compile once
  pad = lambda x, fill=0: np.pad(  # noqa: E731
    x, ((0, 0), (0, width - x.shape[1])) + ((0, 0),) * (x.ndim - 2), constant_values=fill
  )
  tokens, mask, routes = pad(tr.tokens_bt), pad(tr.attention_mask_bt), pad(tr.routes_btsk, -1)
  fwd = jax.jit(lambda p, t, m, r: forward(CONFIG, p, t, attention_mask=m, routes=r))
  out = []
  for r in (routes, None):
    logp = np.asarray(jax.nn.log_softmax(fwd(params, tokens, mask, r), axis=-1))
    lp_bt = np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1)[..., 0]  # log p(token t | < t) at t - 1
    loss = pad(tr.loss_mask_bt)[:, 1:] > 0
    for b in np.nonzero(np.asarray(tr.stop_reason_b) == "call_limit")[0]:  # its appended EOS was not sampled
      loss[b, np.nonzero(loss[b])[0].max()] = False
    out.append(float(np.max(np.abs(lp_bt - pad(tr.sampler_logprob_bt)[:, 1:])[loss])))
  return out


def _check_routes(tr):
  n, t = tr.tokens_bt.shape
  assert tr.routes_btsk.shape == (n, t, L_SPARSE, K) and tr.routes_btsk.dtype == np.int32
  held = tr.routes_btsk[..., 0, 0] >= 0
  assert not (held & (tr.attention_mask_bt == 0)).any()  # -1 on padding
  assert ((tr.routes_btsk >= 0) == held[..., None, None]).all()  # a position has all its routes or none
  assert (tr.routes_btsk < CONFIG.num_experts).all()
  for b in range(n):
    total = int(tr.prompt_len_b[b] + tr.response_len_b[b])
    assert not held[b, total - 1]  # the last token never ran
    # Every loss token's context ran on the device, so its routes are there; a row misses only tokens appended on
    # the host after its slot was released (a tool result cut at L, the EOS that ends a call over the limit).
    last_loss = np.nonzero(tr.loss_mask_bt[b])[0].max()
    ran = last_loss - (tr.stop_reason_b[b] == "call_limit")
    assert held[b, :ran].all(), (b, tr.stop_reason_b[b])
  # different tokens go to different experts: the routes are the model's, not a constant
  assert len({tuple(x) for x in tr.routes_btsk[held][:, 0].tolist()}) > 1


@pytest.mark.slow
def test_a_tree_rollout_carries_each_tokens_experts_and_replaying_them_gives_the_samplers_log_probs(params):
  """AEPO forks on the device (children copy their parent's slot) and tool pauses: every trajectory's routes, and
  the teacher-forced forward replaying them equals the engine on every loss token."""
  loop = _loop()
  policy = rollout_policy("aepo", n=4, initial_rollouts=2, enable_dynamic_rollouts=False)
  tr = loop.rollout(params, PROMPTS, policy, seed=1)
  assert tr.stats["rollout/forks_on_device"] > 0 and (tr.parent_b >= 0).any()
  assert tr.num_tool_calls_b.sum() > 0
  _check_routes(tr)
  # a child holds its parent's routes on the shared prefix (copied with the KV, never recomputed)
  for b in np.nonzero(tr.parent_b >= 0)[0]:
    p, f = tr.parent_b[b], tr.fork_pos_b[b]
    np.testing.assert_array_equal(tr.routes_btsk[b, : f - 1], tr.routes_btsk[p, : f - 1])
  replayed, own = _replay_diffs(params, tr)
  assert replayed < TOL, (replayed, own)
  assert replayed <= own
  # groups of several rollouts (DAPO's dynamic sampling) keep their routes, -1 on the new padding
  both = concat_groups([(tr, [1]), (tr, [0])], pad_id=PAD)
  rows = np.nonzero(tr.group_id_b == 1)[0]
  np.testing.assert_array_equal(both.routes_btsk[: len(rows), : tr.tokens_bt.shape[1]], tr.routes_btsk[rows])


@pytest.mark.slow
def test_preempted_and_re_prefilled_trajectories_keep_replayable_routes(params):
  """A paged pool too small for every slot: trajectories are preempted and re-prefilled from the host; the routes
  they come back with are those of the KV their last tokens attended to, and still replay the sampler's log-probs.
  Tool results enter after the next decode chunk, so the preemptions do not hang on the tool thread's speed (seeds 0
  and 1: 5 and 2 preemptions with 12 pages)."""
  loop = _loop(tool_results="next_chunk", kv_layout="paged", page_size=8, num_pages=13)
  preempted = 0
  for seed in range(2):
    tr = loop.rollout(params, PROMPTS, rollout_policy("arpo", n=4, initial_rollouts=2, mode="faithful"), seed=seed)
    preempted += tr.stats["rollout/preemptions"]
    _check_routes(tr)
    replayed, own = _replay_diffs(params, tr)
    assert replayed < TOL, (seed, replayed, own)
  assert preempted > 0


def test_an_engine_without_routes_gives_none():
  tr_cfg = AgentConfig(max_response_len=8, max_tool_calls=0, chunk_steps=4, tool_tags=("python",))
  engine = Engine(CONFIG, max_slots=2, max_len=32, eos_ids=[EOS], stop_sequences=[[CALL]])
  tools = ToolSet({"python": lambda code: "2"}, call_limit=10, retry_count=1, max_workers=2)
  p = init_params(CONFIG, jax.random.PRNGKey(1))
  tr = AgentLoop(engine, VocabTokenizer(), tools, tr_cfg).rollout(p, PROMPTS[:1], rollout_policy("none", n=2), seed=0)
  assert tr.routes_btsk is None
