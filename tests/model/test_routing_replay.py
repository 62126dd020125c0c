"""Routing replay for mixture-of-experts RL (R3, arXiv 2510.11370): the experts each token went to in the rollout
engine, reused by the update's forward. On a tiny random Qwen3-MoE model (float32; 3 layers, the middle one dense,
6 experts, top 2 renormalised):
  * `routes=None` is the forward as it was (and equal to a replay of no route, -1);
  * replaying the model's own routes gives the same logits bit for bit; other routes change them, and the router's
    gate weights still get a gradient (the gates are the current router's probabilities at the replayed experts);
  * the engine's recorded routes (prefill, decode, extend; dense and paged cache) are those a teacher-forced forward
    of the same tokens picks, and its log-probs equal that forward's with the routes replayed (TOL);
  * with the trainer's numerics perturbed (noise on the router, or a bfloat16 forward), routes disagree with the
    rollout's without replay and agree with it, by construction, with replay; the log-probs move closer.
(That `routes=None` leaves every program unchanged: the lowered decode, prefill and forward programs of a dense and of
this MoE model were compared with those before routing replay existed; identical text, identical outputs.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aepo_jax import model
from aepo_jax.model import _moe
from aepo_jax.rollout import Engine, SamplingParams
from aepo_jax.testing import tiny_model_config

CFG = tiny_model_config(
  "qwen3_moe",
  num_layers=3,
  mlp_only_layers=(1,),
  num_experts=6,
  num_experts_per_tok=2,
  moe_intermediate_size=16,
  eos_token_ids=(1,),
)
SPARSE = (0, 2)  # CFG's sparse layers
TOL = 1e-4  # max |Δlog-prob| engine vs teacher-forced forward, float32 (tests/rollout/test_engine.py's; measured ~1e-6)
MARGIN = 1e-5  # a route may differ only where the k-th and (k+1)-th router probabilities are closer than this


@pytest.fixture(scope="module")
def params():
  p = model.init_params(CFG, jax.random.PRNGKey(0))
  return jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, p)  # far from uniform: tokens and routes vary


def _tokens(b=2, t=16, seed=0):
  return np.random.RandomState(seed).randint(2, CFG.vocab_size, (b, t)).astype(np.int32)


def _other_routes(routes, shift=1):
  """Each token's experts moved to the next ones (still k distinct experts)."""
  return (routes + shift) % CFG.num_experts


def _router_margin(params, tokens):
  """[T, L_sparse]: the gap between the k-th and (k+1)-th router probability of each token in each sparse layer
  (teacher-forced); a route may flip under float rounding only where it is tiny."""
  out, route = [], _moe.route

  def capture(config, logits_ne, replay_nk=None):
    top = jax.lax.top_k(jax.nn.softmax(logits_ne, axis=-1), config.num_experts_per_tok + 1)[0]
    jax.debug.callback(lambda m: out.append(np.asarray(m)), top[:, -2] - top[:, -1], ordered=True)
    return route(config, logits_ne, replay_nk)

  _moe.route = capture
  try:
    jax.block_until_ready(jax.jit(lambda p, t: model.forward(CFG, p, t))(params, tokens[None]))
    jax.effects_barrier()
  finally:
    _moe.route = route
  assert len(out) == len(SPARSE)
  return np.stack(out, axis=-1)


# ----------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["dense", "ragged"])
def test_replaying_own_routes_is_bit_identical(params, impl):
  config = CFG.replace(moe_impl=impl)
  tokens = _tokens()
  fwd = jax.jit(lambda p, t, r: model.forward(config, p, t, routes=r))
  plain = np.asarray(jax.jit(lambda p, t: model.forward(config, p, t))(params, tokens))
  logits, routes = jax.jit(lambda p, t: model.forward(config, p, t, return_routes=True))(params, tokens)
  assert routes.shape == (2, 16, len(SPARSE), 2) and routes.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(logits), plain)  # return_routes changes nothing
  np.testing.assert_array_equal(np.asarray(fwd(params, tokens, routes)), plain)
  np.testing.assert_array_equal(np.asarray(fwd(params, tokens, jnp.full_like(routes, -1))), plain)  # -1: routed freely
  # the forward's routes are the router's own top 2 of the sparse layers
  h = np.asarray(routes).reshape(-1, len(SPARSE), 2)
  assert ((h >= 0) & (h < CFG.num_experts)).all() and (h[..., 0] != h[..., 1]).all()


def test_other_routes_change_logits_and_train_the_router(params):
  tokens = _tokens()
  _, own = model.forward(CFG, params, tokens, return_routes=True)
  other = _other_routes(own)
  plain = model.forward(CFG, params, tokens)
  replayed, used = model.forward(CFG, params, tokens, routes=other, return_routes=True)
  np.testing.assert_array_equal(np.asarray(used), np.asarray(other))  # the replayed experts are the ones used
  assert np.abs(np.asarray(replayed - plain)).max() > 1e-3
  # only the first token of row 0 replayed: only it and what attends to it change
  partial = jnp.full_like(own, -1).at[0, 0].set(other[0, 0])
  diff = np.abs(np.asarray(model.forward(CFG, params, tokens, routes=partial) - plain)).max(-1)
  assert diff[0].min() > 0 and (diff[1] == 0).all()

  weights = np.random.RandomState(1).normal(size=(*tokens.shape, CFG.vocab_size)).astype(np.float32)
  grad = jax.jit(jax.grad(lambda p: jnp.sum(model.forward(CFG, p, tokens, routes=other) * weights)))(params)
  gate = np.abs(np.asarray(grad["layers"]["mlp"]["gate"]["kernel"])).max(axis=(1, 2))  # [L]
  assert (gate[list(SPARSE)] > 1e-4).all() and gate[1] == 0  # the dense layer's router is unused


def test_route_replay_gates_are_current_probabilities():
  """The replayed experts get the router's probabilities at them, renormalised (norm_topk_prob) or not."""
  logits = jax.random.normal(jax.random.PRNGKey(0), (5, CFG.num_experts)) * 2
  probs = np.asarray(jax.nn.softmax(logits, -1))
  replay = np.array([[0, 1], [5, 2], [-1, -1], [3, 4], [1, 0]], np.int32)
  for norm in (True, False):
    gates, experts = _moe.route(CFG.replace(norm_topk_prob=norm), logits, replay)
    own_gates, own = _moe.route(CFG.replace(norm_topk_prob=norm), logits)
    want_e = np.where(replay < 0, np.asarray(own), replay)
    np.testing.assert_array_equal(np.asarray(experts), want_e)
    want = np.take_along_axis(probs, want_e, -1)
    want = want / want.sum(-1, keepdims=True) if norm else want
    np.testing.assert_allclose(np.asarray(gates), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(gates)[2], np.asarray(own_gates)[2])
    g = jax.grad(lambda z: jnp.sum(_moe.route(CFG.replace(norm_topk_prob=norm), z, replay)[0] ** 2))(logits)
    assert np.abs(np.asarray(g)).min(-1).max() > 0  # the router logits get a gradient


def test_routes_need_experts_and_the_right_shape(params):
  dense = tiny_model_config("qwen3")
  with pytest.raises(ValueError, match="has none"):
    model.forward(dense, model.init_params(dense, jax.random.PRNGKey(0)), _tokens(), return_routes=True)
  with pytest.raises(ValueError, match="sparse layers, num_experts_per_tok"):
    model.forward(CFG, params, _tokens(), routes=np.zeros((2, 16, 3, 2), np.int32))  # one row per layer
  with pytest.raises(ValueError, match="record_routes"):
    Engine(dense, max_slots=2, max_len=16, record_routes=True)


# ----------------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------------
def _rollout(params, kv_layout, temperature=0.0):
  """Two prompts (one longer than a prefill chunk), a decode, a tool result into slot 0 (extend), a decode.
  Returns [(tokens, routes, engine log-probs aligned with tokens, generated mask)] per slot."""
  engine = Engine(
    CFG,
    max_slots=8,  # 2 of 8 slots active: decode runs compacted rows (take_rows / put_rows carry the routes)
    max_len=64,
    eos_ids=(),
    prefill_chunk=16,
    sampling=SamplingParams(temperature),
    record_routes=True,
    kv_layout=kv_layout,
    page_size=8,
  )
  s = engine.init_decode_state()
  s = engine.add(params, s, [0, 2], [[5, 6, 7, 8, 9], list(range(10, 40))], [1, 2], 6)
  s, out1 = engine.decode(params, s, 8)
  s = engine.extend(params, s, [0], [list(range(40, 60))], max_new_tokens=5)
  s, out2 = engine.decode(params, s, 6)
  rows = []
  for slot in (0, 2):
    toks, routes = engine.slot_tokens(s, slot), engine.slot_routes(s, slot)
    gen = np.asarray(jax.device_get(s.generated[slot, : len(toks)]))
    logp = np.zeros(len(toks), np.float32)
    logp[gen] = np.concatenate([np.asarray(o.logprob[slot])[np.asarray(o.valid[slot])] for o in (out1, out2)])
    rows.append((toks, routes, logp, gen))
  return rows


def _teacher_forced_logprobs(config, params, tokens, routes=None):
  """log π(token t | < t) aligned with the tokens (column 0: 0), and the routes the forward used."""
  logits, used = model.forward(
    config, params, tokens[None], routes=None if routes is None else routes[None], return_routes=True
  )
  logp = jax.nn.log_softmax(logits[0].astype(jnp.float32), -1)
  return np.concatenate([[0.0], np.asarray(jnp.take_along_axis(logp[:-1], tokens[1:, None], -1)[:, 0])]), np.asarray(
    used[0]
  )


@pytest.mark.parametrize("kv_layout", ["dense", "paged"])
def test_engine_routes_are_the_teacher_forced_ones(params, kv_layout):
  """Greedy: every cached token's recorded experts (prompt, generated, tool result) equal the teacher-forced
  forward's, order included, except where the router's k-th and (k+1)-th probabilities are within MARGIN (none on
  this seed); replaying them, the forward's log-probs of the sampled tokens equal the engine's within TOL."""
  for tokens, routes, logp, gen in _rollout(params, kv_layout):
    n = len(tokens) - 1  # the last token was not run (its row is -1)
    assert gen.sum() in (11, 6) and (routes[n] == -1).all() and (routes[:n] >= 0).all()
    tf_logp, tf_routes = _teacher_forced_logprobs(CFG, params, tokens)
    same = (routes[:n] == tf_routes[:n]).all(-1)  # [n, L_sparse]
    assert (same | (_router_margin(params, tokens)[:n] < MARGIN)).all()
    assert same.all()
    replay_logp, used = _teacher_forced_logprobs(CFG, params, tokens, routes)
    np.testing.assert_array_equal(used[:n], routes[:n])
    assert np.abs(replay_logp[gen] - logp[gen]).max() <= TOL
    assert np.abs(tf_logp[gen] - logp[gen]).max() <= TOL


@pytest.mark.parametrize("perturbation", ["router_noise", "bfloat16"])
def test_replay_removes_routing_disagreement_under_trainer_numerics(params, perturbation, capsys):
  """The trainer's forward with other numerics than the rollout's: noise (3e-2 of the weights' spread) on the
  routers, or the whole forward in bfloat16. Without replay some (token, sparse layer) routes disagree with the
  rollout's; with replay none do, and the next-token log-probs of every position are closer to the rollout's (the
  float32 forward with the rollout's routes, which are the engine's log-probs: the test above). Measured on this
  seed (140 routes): router_noise 4 disagree (2.9%), mean |Δlogp| 2.2e-2 -> 1.4e-2, max 0.17 -> 0.056; bfloat16 1
  (0.7%), mean 1.39e-2 -> 1.29e-2."""
  config, trainer_params = CFG, params
  if perturbation == "router_noise":
    gate = params["layers"]["mlp"]["gate"]["kernel"]
    noise = 3e-2 * jnp.std(gate) * jax.random.normal(jax.random.PRNGKey(7), gate.shape)
    trainer_params = jax.tree.map(lambda x: x, params)
    trainer_params["layers"]["mlp"]["gate"]["kernel"] = gate + noise
  else:
    config = CFG.replace(dtype="bfloat16")
  disagree = total = 0
  err_free, err_replay = [], []
  for tokens, routes, _, _ in _rollout(params, "dense", temperature=1.0):
    n = len(tokens) - 1
    rollout_logp, _ = _teacher_forced_logprobs(CFG, params, tokens, routes)
    free_logp, free_routes = _teacher_forced_logprobs(config, trainer_params, tokens)
    replay_logp, used = _teacher_forced_logprobs(config, trainer_params, tokens, routes)
    disagree += int((np.sort(free_routes[:n], -1) != np.sort(routes[:n], -1)).any(-1).sum())
    total += n * len(SPARSE)
    np.testing.assert_array_equal(used[:n], routes[:n])
    err_free.append(np.abs(free_logp - rollout_logp)[1:])
    err_replay.append(np.abs(replay_logp - rollout_logp)[1:])
  err_free, err_replay = np.concatenate(err_free), np.concatenate(err_replay)
  with capsys.disabled():
    print(
      f"\n{perturbation}: routes disagreeing without replay {disagree}/{total} = {disagree / total:.3f} "
      f"(0 with replay); mean |Δlogp| {err_free.mean():.2e} -> {err_replay.mean():.2e}, "
      f"max {err_free.max():.2e} -> {err_replay.max():.2e}"
    )
  assert disagree > 0
  assert err_replay.mean() < err_free.mean() and err_replay.max() < err_free.max()
