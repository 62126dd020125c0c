"""Where the trainer meets the other parts: model loading, data, tools, rollout, reward, evaluation.

Each function here is the single integration point with one part of the system, so `_trainer.py` reads as
the algorithm and this file as the plumbing. Parts are imported lazily: an SFT-only run never imports
the rollout engine or the tools.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import jax
import numpy as np

log = logging.getLogger("aepo_jax.train")


# ---------------------------------------------------------------------------------------------------------
# Model and tokenizer.
# ---------------------------------------------------------------------------------------------------------
def load_model(config, mesh=None):
  """(ModelConfig, params, tokenizer or None) as `config.model` says, the parameters straight on `mesh`.

  init='random': the preset `model.name` with `model.overrides` (tokenizer only if `model.tokenizer`), drawn by one
  jitted program into its shardings. init='pretrained': a named checkpoint (`aepo_jax.model.load_pretrained`), a
  local HF directory, or a gs:// HF directory (streamed file by file to a local temporary directory that is removed
  after loading). HF and named checkpoints are read tensor by tensor into each host's own shards
  (`model.load_hf(mesh=)`): no parameter is ever whole on one device, and no host copy outlives the load.
  """
  from aepo_jax import model as model_lib

  mc = config.model
  kw = dict(dtype=mc.dtype, param_dtype=mc.param_dtype, remat=mc.remat, **dict(mc.overrides))
  tokenizer = None
  if mc.init == "random":
    cfg = model_lib.preset(mc.name, **kw)
    key = jax.random.PRNGKey(config.train.seed)
    if mesh is None:
      params = model_lib.init_params(cfg, key)
    else:
      params = jax.jit(lambda k: model_lib.init_params(cfg, k), out_shardings=model_lib.param_shardings(cfg, mesh))(key)
  elif str(mc.name).startswith("gs://") or os.path.isdir(mc.name):
    with _local_files(mc.name) as path:
      cfg, params = model_lib.load_hf(path, dtype=mc.param_dtype, mesh=mesh)
      tokenizer = None if mc.tokenizer else _tokenizer(path)
    cfg = cfg.replace(**kw)
  else:
    cfg, params = model_lib.load_pretrained(mc.name, dtype=mc.param_dtype, mesh=mesh)
    cfg = cfg.replace(**kw)
    tokenizer = None if mc.tokenizer else _tokenizer(model_lib.pretrained_dir(mc.name))
  if mc.tokenizer:
    with _local_files(mc.tokenizer) as path:
      tokenizer = _tokenizer(path)
  return cfg, params, tokenizer


def _tokenizer(path: str):
  from aepo_jax import model as model_lib

  return model_lib.Tokenizer.from_dir(path)


@contextlib.contextmanager
def _local_files(path: str):
  """`path` itself, or for gs:// a local temporary copy of the directory's files (streamed in 64 MiB pieces, never
  whole in memory), removed on exit."""
  if not str(path).startswith("gs://"):
    yield path
    return
  from etils import epath

  local = tempfile.mkdtemp(prefix="aepo_jax_model_")
  try:
    for f in epath.Path(path).iterdir():
      if f.is_file():
        with f.open("rb") as src, open(os.path.join(local, f.name), "wb") as dst:
          shutil.copyfileobj(src, dst, 64 << 20)
    yield local
  finally:
    shutil.rmtree(local, ignore_errors=True)


def pad_id(model_cfg, tokenizer) -> int:
  if model_cfg.pad_token_id is not None:
    return int(model_cfg.pad_token_id)
  if model_cfg.eos_token_ids:
    return int(model_cfg.eos_token_ids[0])
  return int(getattr(tokenizer, "pad_token_id", None) or 0)


# ---------------------------------------------------------------------------------------------------------
# Data.
# ---------------------------------------------------------------------------------------------------------
def index_loader(num_examples: int, batch_size: int, *, seed: int):
  """Endless seeded shuffle of example indices, in batches; a Grain iterator with get_state/set_state."""
  import grain

  ds = grain.MapDataset.range(num_examples).shuffle(seed=seed).repeat().batch(batch_size)
  return iter(ds)


def synthetic_sft_examples(vocab_size: int, *, num: int = 64, length: int = 32, seed: int = 0):
  """A learnable toy task for tests and benchmarks: the response repeats the prompt (first half masked)."""
  rng = np.random.default_rng(seed)
  half = length // 2
  out = []
  for _ in range(num):
    prompt = rng.integers(3, vocab_size, half, dtype=np.int32)
    out.append((np.concatenate([prompt, prompt]), np.r_[np.zeros(half, np.int32), np.ones(half, np.int32)]))
  return out


def sft_examples(config, tokenizer, model_cfg):
  """(tokens, loss_mask) demonstrations: tool results and the prompt have loss_mask 0. sft.source: 'synthetic',
  'suite', or a .jsonl / .parquet file of chat traces (`trace_examples`)."""
  s = config.sft
  if s.source == "synthetic":
    return synthetic_sft_examples(
      model_cfg.vocab_size, num=max(s.batch_size * 4, 16), length=min(s.max_len, 32), seed=s.seed
    )
  from aepo_jax import data as data_lib

  if tokenizer is None:
    raise ValueError(f"sft.source={s.source!r} needs a tokenizer; set model.tokenizer or use a pretrained model.")
  eos = int(model_cfg.eos_token_ids[0])
  if data_lib.is_data_file(s.source):
    return trace_examples(s.source, tokenizer, eos, max_len=s.max_len)
  if s.source != "suite":
    raise ValueError(
      f"sft.source={s.source!r}: use 'suite' (the task suite's demonstrations), 'synthetic', or a "
      ".jsonl / .parquet file of chat traces (docs/data.md)."
    )
  from aepo_jax.train import _batch

  out = []
  for demo in _suite(config).demos:
    # The prompt is the conversation before the assistant's turn, exactly as a rollout sees it; the turn
    # itself follows as trained segments (demo.messages ends with it, for chat-format exports).
    prompt = [m for m in demo.messages if m["role"] != "assistant"]
    segments = [(tokenizer.apply_chat_template(prompt, add_generation_prompt=True), False)]
    segments += [(tokenizer.encode_continuation(text), kind == "model") for kind, text in demo.segments]
    segments.append(([eos], True))  # the model must learn to stop
    out.append(_batch.sft_example(segments))
  return out


def trace_examples(path: str, tokenizer, eos: int, *, max_len: int) -> list:
  """(tokens, loss_mask) per assistant turn of every trace in `path` (`data.read_traces`): the conversation before
  the turn rendered by the chat template with the generation prompt (no loss; earlier assistant turns as the
  template writes them), then the turn's own text (loss) with its tool results (no loss), then EOS (loss). Each
  example is cut at max_len (LLaMA-Factory's cutoff_len); one with no loss token left is dropped and counted."""
  from aepo_jax import data as data_lib
  from aepo_jax.train import _batch

  out, dropped = [], 0
  for trace in data_lib.read_traces(path):
    msgs = trace.messages
    for k, turn in enumerate(msgs):
      if turn["role"] != "assistant":
        continue
      segments = [(tokenizer.apply_chat_template(msgs[:k], add_generation_prompt=True), False)]
      segments += [
        (tokenizer.encode_continuation(text), trained) for text, trained in data_lib.trace_segments(turn["content"])
      ]
      segments.append(([eos], True))
      tokens, mask = _batch.sft_example(segments)
      tokens, mask = tokens[:max_len], mask[:max_len].astype(np.int8)
      if mask.any():
        out.append((tokens, mask))
      else:
        dropped += 1
  if dropped:
    log.warning(
      "sft: %d assistant turns of %s have no token inside sft.max_len=%d (their context is longer) and were dropped",
      dropped,
      path,
      max_len,
    )
  if not out:
    raise ValueError(f"sft.source={path!r}: no trainable turn within sft.max_len={max_len}; raise sft.max_len.")
  log.info("sft: %d examples from %s", len(out), path)
  return out


_SUITES: dict = {}  # settings -> generated suite (its corpus in its own temp directory), within `run_scope`
_SUITE_PREFIX = "aepo_jax_suite_"


def _sweep_stale_suites(tmp_root: str) -> None:
  """Removes the suite directories of processes that no longer exist (killed before their atexit ran): each is named
  aepo_jax_suite_<pid>_<random>."""
  for path in Path(tmp_root).glob(_SUITE_PREFIX + "*_*"):
    pid = path.name[len(_SUITE_PREFIX) :].split("_", 1)[0]
    if not pid.isdigit() or int(pid) == os.getpid():
      continue
    try:
      os.kill(int(pid), 0)
    except ProcessLookupError:
      shutil.rmtree(path, ignore_errors=True)
    except OSError:
      pass  # alive under another user: not ours to remove


@contextlib.contextmanager
def run_scope():
  """The generated suites (and their temp corpus directories) made inside belong to this scope: `train.run` holds
  one for the whole run, so nothing outlives it in the process (a killed process's directory is swept by the next
  run, `_sweep_stale_suites`)."""
  before = set(_SUITES)
  try:
    yield
  finally:
    for key in set(_SUITES) - before:
      shutil.rmtree(_SUITES.pop(key).corpus_path.parent, ignore_errors=True)


def _suite(config):
  """The generated task suite (cached per settings within a run, `run_scope`: SFT, RL, evaluation and search share
  one)."""
  key = (tuple(sorted(dict(config.data.suite).items())), config.data.template)
  if key not in _SUITES:
    from aepo_jax import data as data_lib

    _sweep_stale_suites(tempfile.gettempdir())
    corpus_dir = tempfile.mkdtemp(prefix=f"{_SUITE_PREFIX}{os.getpid()}_")
    atexit.register(shutil.rmtree, corpus_dir, ignore_errors=True)  # outside a run_scope: dies with the process
    _SUITES[key] = data_lib.generate_suite(
      **dict(config.data.suite), corpus_dir=corpus_dir, template=config.data.template
    )
  return _SUITES[key]


def _examples(config, source: str, split: str):
  """Examples of a data source (syntax in base_config: suite | ARPO RL file | benchmark | .jsonl/.parquet)."""
  from aepo_jax import data as data_lib

  if source == "suite":
    suite = _suite(config)
    return list(suite.train if split == "train" else suite.heldout)
  if source in data_lib.ARPO_RL_FILES:
    return data_lib.load_arpo_parquet(source)
  if source in data_lib.BENCHMARKS:
    return data_lib.load_benchmark(source)
  if data_lib.is_data_file(source):
    f = config.data.fields
    return data_lib.load_records(
      source, question_key=f.question, answer_key=f.answer, system_key=f.system, family=config.data.family
    )
  raise ValueError(
    f"data source {source!r} is unknown: use 'suite', an ARPO RL file "
    f"({', '.join(data_lib.ARPO_RL_FILES)}), a benchmark ({', '.join(sorted(data_lib.BENCHMARKS))}) "
    "or a .jsonl / .parquet path (docs/data.md)."
  )


def host_share(total: int, process_index: Optional[int] = None, process_count: Optional[int] = None) -> int:
  """This host's share of `total` items split over the processes as evenly as possible (the first total % P
  hosts take one more): prompts per RL step, evaluation examples."""
  p = jax.process_index() if process_index is None else process_index
  n = jax.process_count() if process_count is None else process_count
  return total // n + (1 if p < total % n else 0)


def prompt_loader(config, tokenizer):
  """(iterator of prompt batches with get_state/set_state, number of training prompts); this host's shard, with
  `host_share(data.prompts_per_step)` prompts per batch."""
  from aepo_jax import data as data_lib

  examples = _examples(config, config.data.train, "train")
  loader = data_lib.make_loader(
    examples,
    batch_size=host_share(config.data.prompts_per_step),
    seed=config.data.seed,
    shuffle=config.data.shuffle,
    shard_index=jax.process_index(),
    shard_count=jax.process_count(),
    drop_remainder=True,
  )
  return loader, len(examples)


# ---------------------------------------------------------------------------------------------------------
# Tools, rollout, reward, advantages, loss hyperparameters.
# ---------------------------------------------------------------------------------------------------------
def make_toolset(config, mode: str = "train"):
  from aepo_jax import tools as tools_lib

  tc = config.tools
  tools = {}
  if "python" in tc.names:
    tools["python"] = tools_lib.PythonTool(
      timeout_s=tc.python_timeout,
      allow_unsandboxed=tc.allow_unsandboxed,
      limits=tools_lib.PythonLimits(memory_mb=tc.python_memory_mb, max_output_chars=tc.python_max_output),
    )
  if "search" in tc.names:
    corpus = tc.search_corpus or None
    if tc.search_backend == "local" and corpus is None:
      corpus = str(_suite(config).corpus_path)  # the suite's generated corpus
    opts = {"url": tc.search_url or None}
    if tc.search_backend == "replay":  # a query -> result cache: search_corpus, else ARPO's search_cache.json
      from aepo_jax.data import arpo_data_root

      opts["path"] = corpus or str(arpo_data_root() / "search_cache.json")
    else:
      opts["corpus"] = corpus
    backend = tools_lib.make_search_backend(tc.search_backend, **opts)
    if tc.search_mode == "browse":  # the evaluation's SDS browser: pages summarised by an LLM (spec §2.5)
      b = tc.browse
      pages = b.pages or (corpus if tc.search_backend != "replay" else None)
      tools["search"] = tools_lib.BrowseTool(
        backend,
        tools_lib.ChatClient(b.summarizer_url, b.summarizer_model),
        pages=tools_lib.PageStore(pages) if pages else None,
        topk=tc.search_topk,
        max_pages=b.max_pages,
        page_chars=b.page_chars,
        live=b.live,
      )
    else:
      tools["search"] = tools_lib.SearchTool(backend, topk=tc.search_topk)
  if not tools:
    return None
  return tools_lib.ToolSet(
    tools,
    mode=mode,
    call_limit=tc.call_limit,
    retry_count=tc.retry_count,
    timeout_s=tc.python_timeout + 30.0,
    max_workers=tc.max_workers,
  )


def policy_config(config):
  """rollout.* -> the rollout part's PolicyConfig (spec §1.7, §2.1)."""
  from aepo_jax.rollout import PolicyConfig

  r = config.rollout
  return PolicyConfig(
    n=r.n,
    initial_rollouts=r.initial_rollouts,
    beam_size=r.beam_size,
    entropy_weight=r.entropy_weight,
    branch_threshold=r.branch_probability,
    entropy_window=r.entropy_window,
    estimator=r.entropy_estimator,
    mode=r.mode,
    penalty_slope=r.consecutive_penalty,
    penalty_counts_refills=r.penalize_refills,
    enable_dynamic_rollouts=r.enable_dynamic_rollouts,
    premonitor_beta=r.premonitor_beta,
    probe_tokens=r.probe_tokens,
  )


def prompt_ids(config, tokenizer, example) -> list:
  from aepo_jax.data import build_messages

  ids = tokenizer.apply_chat_template(build_messages(example, config.data.template), add_generation_prompt=True)
  if len(ids) > config.rollout.max_prompt_len:
    raise ValueError(
      f"a prompt has {len(ids)} tokens > rollout.max_prompt_len={config.rollout.max_prompt_len}; "
      "raise it or shorten the template."
    )
  return ids


class Rollout:
  """This host's rollouts: an engine and agent loop on the host's own devices (`rollout.mesh` over
  `jax.local_devices()`), with its own tools, independent of every other host (docs/training.md, "On a pod").

    weights = rollout.weights(params)            # the policy copied onto this host's devices, in rollout.dtype;
                                                 # a collective: every host calls it once per RL step / evaluation
    traj = rollout(weights, prompts, key)        # host-local: no cross-host collective inside the tool loop
  """

  def __init__(
    self,
    config,
    model_cfg,
    tokenizer,
    tools,
    *,
    policy_name: Optional[str] = None,
    temperature: Optional[float] = None,
    n: Optional[int] = None,
    result_mode: str = "train",
    prompts_per_call: Optional[int] = None,
    max_response_len: Optional[int] = None,
  ):
    from aepo_jax import model as model_lib
    from aepo_jax import rollout as rollout_lib
    from aepo_jax.parallel import local_mesh

    r = config.rollout
    pc = policy_config(config)
    if n is not None:
      import dataclasses

      pc = dataclasses.replace(pc, n=n, initial_rollouts=min(pc.initial_rollouts, n))
    self.config, self.tokenizer = config, tokenizer
    self.policy = rollout_lib.rollout_policy(policy_name or r.policy, pc)
    per_host = self.prompts_per_call = prompts_per_call or host_share(config.data.prompts_per_step)
    slots = r.max_slots or per_host * pc.n
    if prompts_per_call is not None:
      slots = max(slots, per_host * pc.n)
    response_len = max_response_len or r.max_response_len
    tags = tuple(t for t in ("search", "python") if t in tuple(config.tools.names))
    self.dtype = r.dtype or config.model.dtype
    self.mesh = local_mesh({k: int(v) for k, v in r.mesh.items()})
    engine_cfg = model_cfg.replace(param_dtype=self.dtype)
    self.shardings = model_lib.param_shardings(engine_cfg, self.mesh)
    self.engine = rollout_lib.make_engine(
      engine_cfg,
      max_slots=slots,
      max_len=r.max_prompt_len + response_len,
      tokenizer=tokenizer,
      stop_strings=[f"</{t}>" for t in tags],
      sampling=rollout_lib.SamplingParams(
        temperature=r.temperature if temperature is None else temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        min_p=r.min_p,
        repetition_penalty=r.repetition_penalty,
      ),
      entropy_window=r.entropy_window,
      topk_entropy=r.topk_entropy,
      mesh=self.mesh,
      prefill_chunk=r.prefill_chunk,
      prefill_rows=r.prefill_rows,
      kv_layout=r.kv_layout,
      page_size=r.page_size,
      num_pages=rollout_lib.num_pages_for(r.kv_tokens, r.page_size),
    )
    self.loop = rollout_lib.AgentLoop(
      self.engine,
      tokenizer,
      tools,
      rollout_lib.AgentConfig(
        max_response_len=response_len,
        max_tool_calls=config.tools.call_limit,
        chunk_steps=r.decode_chunk,
        tool_tags=tags,
        result_mode=result_mode,
      ),
      pad_id=pad_id(model_cfg, tokenizer),
    )

  def weights(self, params):
    """The policy on this host's rollout devices (the same arrays when they already are; see to_host_local)."""
    from aepo_jax.parallel import to_host_local

    return to_host_local(params, self.shardings, self.dtype)

  def __call__(self, weights, prompts, key):
    if jax.process_count() > 1:  # hosts sample independently of each other
      key = jax.random.fold_in(key, jax.process_index())
    seed = int(jax.random.randint(key, (), 0, 2**31 - 1))
    return self.loop.rollout(
      weights, [prompt_ids(self.config, self.tokenizer, ex) for ex in prompts], self.policy, seed=seed
    )


def make_rollout(config, model_cfg, tokenizer, tools, **kw) -> Rollout:
  """This host's `Rollout` (prompts_per_call / max_response_len default to this host's share of
  data.prompts_per_step and rollout.max_response_len)."""
  return Rollout(config, model_cfg, tokenizer, tools, **kw)


def make_reward(config):
  """fn(traj, prompts) -> rewards [N]: the configured reward on each decoded response (spec §1.6).

  Each response is scored in a `rewards.shared_pool()` worker within `reward.timeout_s`: a response that takes longer, or crashes its worker, scores 0 and the step goes on.
  """
  from aepo_jax import rewards as rewards_lib

  score = getattr(rewards_lib, config.reward.name)
  timeout_s = config.reward.timeout_s

  def reward(traj, prompts):
    answers = [prompts[g].answers for g in np.asarray(traj.group_id_b)]
    results = rewards_lib.shared_pool().map_results(score, list(zip(traj.response_text, answers)), timeout_s=timeout_s)
    failed = [res for res in results if res.status != "ok"]
    if failed:
      log.warning(
        "reward: %d of %d responses scored 0 (%s: %s)", len(failed), len(results), failed[0].status, failed[0].error
      )
    r = np.asarray([res.value if res.status == "ok" else 0.0 for res in results], np.float32)
    if config.algo.overlong_buffer:  # DAPO overlong shaping (spec §3.2)
      from aepo_jax import objectives

      r = r + np.asarray(
        objectives.overlong_reward_penalty(
          np.asarray(traj.response_len_b),
          max_response_length=config.rollout.max_response_len,
          buffer_length=config.algo.overlong_buffer,
          penalty_factor=config.algo.overlong_factor,
        )
      )
    return r

  return reward


def advantage_fn(config):
  """fn(rewards_b, group_ids_b, mask_bt, token_rewards_bt=None, *, tree=None) -> advantages_bt.

  token_rewards_bt (the KL-in-reward penalty, verl `apply_kl_penalty`): estimators with token-level returns
  (reinforce_pp) take it per token; outcome estimators (grpo, rloo, ...) see the sequence score
  R + sum_t token_rewards_t, as verl's GRPO sums `token_level_rewards`.
  tree: (traj.parent_b, traj.fork_pos_b), needed by algo.attribution='hard' (spec §1.4), which gives every token
  shared by branches the mean advantage of the trajectories sharing it.
  """
  from aepo_jax import objectives

  name = config.algo.advantage
  fn = objectives.advantage(name)
  defaults = objectives.advantage_defaults(name)
  hp = {"norm_by_std": config.algo.norm_by_std} if "norm_by_std" in defaults else {}

  def soft(rewards_b, group_ids_b, mask_bt, token_rewards_bt=None):
    if token_rewards_bt is None:
      return fn(rewards_b, group_ids_b, mask_bt, **hp)
    if "token_rewards" in defaults:
      return fn(rewards_b, group_ids_b, mask_bt, token_rewards=token_rewards_bt, **hp)
    seq_b = np.asarray(rewards_b, np.float32) + np.sum(np.asarray(token_rewards_bt) * (np.asarray(mask_bt) > 0), 1)
    return fn(seq_b, group_ids_b, mask_bt, **hp)

  def adv(rewards_b, group_ids_b, mask_bt, token_rewards_bt=None, *, tree=None):
    out = soft(rewards_b, group_ids_b, mask_bt, token_rewards_bt)
    if config.algo.attribution == "soft":
      return out
    if tree is None:
      raise ValueError(
        "algo.attribution='hard' needs the branching tree: call the advantage function with "
        "tree=(traj.parent_b, traj.fork_pos_b), or set algo.attribution='soft'."
      )
    return objectives.hard_attribution(out, mask_bt, *tree)

  return adv


def correct_b(traj, prompts) -> np.ndarray:
  """float[N]: 1 where the trajectory's answer is correct (`rewards.eval_correct`), for DAPO's 'acc' filter.

  Each answer is checked in a `rewards.shared_pool()` worker within the pool's timeout; one over it counts as wrong.
  """
  from aepo_jax import rewards as rewards_lib

  items = [
    (text, prompts[int(g)].answers, prompts[int(g)].family)
    for text, g in zip(traj.response_text, np.asarray(traj.group_id_b))
  ]
  ok = rewards_lib.shared_pool().map(rewards_lib.eval_correct, items, default=False)
  return np.asarray([float(bool(v)) for v in ok], np.float32)


def make_rl_update_step(config, model_cfg, optimizer, mesh):
  """The RL update step as `config` sets it up (loss, KL, entropy, aggregation, logits): what the trainer runs and
  launch/compile.py compiles for a slice."""
  from aepo_jax.train import _step

  t, r, a = config.train, config.rollout, config.algo
  seq_len = r.max_prompt_len + r.max_response_len
  return _step.make_update_step(
    model_cfg,
    loss_fn=a.loss,
    loss_hp=loss_hparams(config),
    optimizer=optimizer,
    micro_batches=t.ppo_mini_batch_size * r.n // t.micro_batch_size,
    mesh=mesh,
    temperature=r.temperature,
    kl_name=a.kl.name,
    kl_coef=0.0 if a.kl.use_in_reward else a.kl.coef,
    need_entropy=a.loss == "aepo" and a.entropy_advantage_coef > 0,
    logit_capacity=_step.logit_capacity(t.logit_fraction, t.micro_batch_size, seq_len),
    saved_logits_mb=t.saved_logits_mb,
    aggregation=a.aggregation,
    off_policy=a.off_policy,
    off_policy_hp=off_policy_hparams(config),
  )


def off_policy_hparams(config) -> dict:
  """algo.off_policy_cap -> the correction's keyword hyperparameters (0: its own default cap)."""
  from aepo_jax import objectives

  a = config.algo
  if a.off_policy == "none":
    return {}
  cap = float(a.off_policy_cap) or objectives.off_policy(a.off_policy).__kwdefaults__["cap"]
  return {"cap": cap}


def loss_hparams(config) -> dict:
  """algo.* -> the keyword hyperparameters the configured loss accepts (spec §1.5, §2.2, §3)."""
  from aepo_jax import objectives

  a = config.algo
  accepted = objectives.policy_loss_defaults(a.loss)
  candidates = {
    "clip_low": a.clip_low,
    "clip_high": a.clip_high,
    "clip_c": a.clip_c or None,
    "agg": a.agg,
    "entropy_advantage_coef": a.entropy_advantage_coef,
    "preserve_high_clip_grad": a.preserve_high_clip_grad,
  }
  return {k: v for k, v in candidates.items() if k in accepted}


# ---------------------------------------------------------------------------------------------------------
# Metrics of a rollout, and evaluation.
# ---------------------------------------------------------------------------------------------------------
def rollout_metrics(traj, rewards_b, adv_bt) -> dict:
  mask = np.asarray(traj.loss_mask_bt) > 0
  out = {
    "reward/mean": float(np.mean(rewards_b)),
    "reward/std": float(np.std(rewards_b)),
    "reward/format_errors": float(np.mean(rewards_b < 0)),
    "rollout/response_len_mean": float(np.mean(traj.response_len_b)),
    "rollout/tool_calls_mean": float(np.mean(traj.num_tool_calls_b)),
    "rollout/trajectories": float(len(rewards_b)),
    "actor/advantage_mean": float(np.mean(np.asarray(adv_bt)[mask])) if mask.any() else 0.0,
    "rollout/sampler_entropy_mean": float(np.mean(np.asarray(traj.sampler_entropy_bt)[mask])) if mask.any() else 0.0,
  }
  out.update({k if "/" in k else f"rollout/{k}": float(v) for k, v in dict(traj.stats).items()})
  return out


def rollout_histograms(traj, adv_bt) -> dict:
  mask = np.asarray(traj.loss_mask_bt) > 0
  return {
    "actor/entropy": np.asarray(traj.sampler_entropy_bt)[mask],
    "actor/advantage": np.asarray(adv_bt)[mask],
    "rollout/response_len": np.asarray(traj.response_len_b),
    "rollout/tool_calls": np.asarray(traj.num_tool_calls_b),
  }


def serve_judge(config):
  """(config with eval.judge_url / judge_model pointing at it, server): `eval.judge_checkpoint` served by
  `aepo_jax.serve.Server` on 127.0.0.1 (a free port) in this process, for the validation's LLM judge. The caller
  shuts the server down. (None, config) unchanged when no judge checkpoint is set."""
  ckpt = config.eval.judge_checkpoint
  if not ckpt:
    return config, None
  from aepo_jax import eval as eval_lib
  from aepo_jax.serve import Server

  policy = eval_lib.load_policy(ckpt, dtype=config.model.dtype)
  server = Server(
    policy.config,
    policy.params,
    policy.tokenizer,
    model_name=ckpt,
    max_slots=8,
    max_len=min(8192, policy.config.max_position_embeddings or 8192),  # never beyond the judge's context
    port=0,
  ).start()
  server.warmup()
  log.info("judge %s served at %s", ckpt, server.url)
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.eval.judge_url, config.eval.judge_model, config.eval.judge_checkpoint = server.url + "/v1", ckpt, ""
  return config, server


def make_eval_rollout(config, model_cfg, tokenizer, tools) -> Rollout:
  """The validation rollout (policy 'none', n = 1, eval.temperature: greedy by default)."""
  e = config.eval
  return Rollout(
    config,
    model_cfg,
    tokenizer,
    tools,
    policy_name="none",
    temperature=e.temperature,
    n=1,
    prompts_per_call=max(host_share(e.batch_size or config.data.prompts_per_step), 1),
    max_response_len=e.max_response_len or None,
  )


def evaluate(config, rollout: Rollout, params, records_path: str = "") -> dict:
  """n = 1 accuracy on each validation source (ARPO validation, spec §1.7; greedy unless eval.temperature), by
  `eval.evaluate` on this host's validation rollout: eval/<source>/accuracy (answer correct by `eval.Scorer`: math
  equivalence / EM; with eval.judge_url, the evaluation protocol's LLM judge OR'ed with math equivalence on QA and
  deep-search sets), eval/<source>/reward and eval/<source>/tool_calls (mean calls per answer), eval/accuracy.

  Every host evaluates its own share of the examples on its own devices; the sums are combined across hosts once
  per source at the end (the only collectives: that and copying the weights)."""
  from aepo_jax import eval as eval_lib
  from aepo_jax import rewards as rewards_lib

  e = config.eval
  policy = eval_lib.Policy(rollout.engine.config, rollout.weights(params), rollout.tokenizer, "in-training")
  protocol = e.get("protocol", "project")
  judge_cls = rewards_lib.OfficialJudge if protocol == "official" else rewards_lib.OpenAICompatibleJudge
  judge = judge_cls(e.judge_url, e.judge_model) if e.judge_url else None
  # The loop brings the engine, tools and result format of training; the settings only batch, template and seed.
  settings = eval_lib.EvalSettings(
    n=1,
    batch_size=rollout.prompts_per_call,
    max_prompt_len=config.rollout.max_prompt_len,
    template=config.data.template,
    seed=jax.process_index(),
  )
  evaluator = eval_lib.Evaluator(
    policy,
    None,
    eval_lib.Scorer(judge, timeout_s=config.reward.timeout_s, protocol=protocol),
    settings,
    show_progress=False,
    loop=rollout.loop,
    rollout_policy=rollout.policy,
  )
  limit = e.num_prompts or config.data.val_size
  sources = {}
  for source in config.data.val:
    examples = _examples(config, source, "val")
    sources[_short(source)] = examples[:limit] if limit else examples
  return eval_lib.evaluate(evaluator, sources, reward_timeout_s=config.reward.timeout_s, records_path=records_path)


def _short(source: str) -> str:
  return os.path.splitext(os.path.basename(str(source)))[0] or "val"
