"""Where the trainer meets the other parts: model loading, data, tools, rollout, reward, evaluation.

Each function here is the single integration point with one part of the system, so `_trainer.py` reads as
the algorithm and this file as the plumbing. Parts are imported lazily: an SFT-only run never imports
the rollout engine or the tools.
"""
from __future__ import annotations

import logging
import os
import tempfile
from typing import Optional

import jax
import numpy as np

log = logging.getLogger("aepo_jax.train")


# ---------------------------------------------------------------------------------------------------------
# Model and tokenizer.
# ---------------------------------------------------------------------------------------------------------
def load_model(config):
  """(ModelConfig, host params, tokenizer or None) as `config.model` says.

  init='random': the preset `model.name` with `model.overrides` (tokenizer only if `model.tokenizer`).
  init='pretrained': a named checkpoint (`aepo_jax.model.load_pretrained`), a local HF directory, or a
  gs:// HF directory (copied to a local temporary directory first).
  """
  from aepo_jax import model as model_lib
  mc = config.model
  kw = dict(dtype=mc.dtype, param_dtype=mc.param_dtype, remat=mc.remat, **dict(mc.overrides))
  tokenizer = None
  if mc.init == "random":
    cfg = model_lib.preset(mc.name, **kw)
    params = model_lib.init_params(cfg, jax.random.PRNGKey(config.train.seed))
  elif str(mc.name).startswith("gs://") or os.path.isdir(mc.name):
    path = _local_copy(mc.name)
    cfg, params = model_lib.load_hf(path, dtype=mc.param_dtype)
    cfg = cfg.replace(**kw)
    tokenizer = _tokenizer(path)
  else:
    if not hasattr(model_lib, "load_pretrained"):
      raise ValueError(f"model.name={mc.name!r} is neither a directory nor gs://, and aepo_jax.model has no "
                       "load_pretrained(); use model.init='random' with a preset or an HF directory.")
    cfg, params = model_lib.load_pretrained(mc.name, dtype=mc.param_dtype)
    cfg = cfg.replace(**kw)
    tokenizer = _tokenizer(model_lib.pretrained_dir(mc.name))
  if mc.tokenizer:
    tokenizer = _tokenizer(_local_copy(mc.tokenizer))
  return cfg, params, tokenizer


def _tokenizer(path: str):
  from aepo_jax import model as model_lib
  return model_lib.Tokenizer.from_dir(path)


def _local_copy(path: str) -> str:
  if not str(path).startswith("gs://"):
    return path
  from etils import epath
  local = tempfile.mkdtemp(prefix="aepo_jax_model_")
  for f in epath.Path(path).iterdir():
    if f.is_file():
      (epath.Path(local) / f.name).write_bytes(f.read_bytes())
  return local


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
  """(tokens, loss_mask) demonstrations: tool results and the prompt have loss_mask 0."""
  s = config.sft
  if s.source == "synthetic":
    return synthetic_sft_examples(model_cfg.vocab_size, num=max(s.batch_size * 4, 16),
                                  length=min(s.max_len, 32), seed=s.seed)
  from aepo_jax import data as data_lib
  if tokenizer is None:
    raise ValueError(f"sft.source={s.source!r} needs a tokenizer; set model.tokenizer or use a pretrained model.")
  if s.source != "suite":
    raise ValueError(f"sft.source={s.source!r}: use 'suite' (the task suite's demonstrations) or 'synthetic'.")
  from aepo_jax.train import _batch
  eos = int(model_cfg.eos_token_ids[0])
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


_SUITES: dict = {}


def _suite(config):
  """The generated task suite (cached per settings: SFT, RL, evaluation and search share one)."""
  key = (tuple(sorted(dict(config.data.suite).items())), config.data.template)
  if key not in _SUITES:
    from aepo_jax import data as data_lib
    corpus_dir = tempfile.mkdtemp(prefix="aepo_jax_suite_")
    _SUITES[key] = data_lib.generate_suite(**dict(config.data.suite), corpus_dir=corpus_dir,
                                           template=config.data.template)
  return _SUITES[key]


def _examples(config, source: str, split: str):
  """Examples of a data source (syntax in base_config: suite | ARPO RL file | benchmark | .parquet)."""
  from aepo_jax import data as data_lib
  if source == "suite":
    suite = _suite(config)
    return list(suite.train if split == "train" else suite.heldout)
  if source in data_lib.ARPO_RL_FILES or source.endswith(".parquet"):
    return data_lib.load_arpo_parquet(source)
  if source in data_lib.BENCHMARKS:
    return data_lib.load_benchmark(source)
  raise ValueError(f"data source {source!r} is unknown: use 'suite', an ARPO RL file "
                   f"({', '.join(data_lib.ARPO_RL_FILES)}), a benchmark ({', '.join(sorted(data_lib.BENCHMARKS))}) "
                   "or a .parquet path.")


def prompt_loader(config, tokenizer):
  """(iterator of prompt batches with get_state/set_state, number of training prompts); this host's shard."""
  from aepo_jax import data as data_lib
  examples = _examples(config, config.data.train, "train")
  per_host = config.data.prompts_per_step // jax.process_count()
  loader = data_lib.make_loader(examples, batch_size=per_host, seed=config.data.seed, shuffle=config.data.shuffle,
                                shard_index=jax.process_index(), shard_count=jax.process_count(),
                                drop_remainder=True)
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
        timeout_s=tc.python_timeout, allow_unsandboxed=tc.allow_unsandboxed,
        limits=tools_lib.PythonLimits(memory_mb=tc.python_memory_mb, max_output_chars=tc.python_max_output))
  if "search" in tc.names:
    corpus = tc.search_corpus or None
    if tc.search_backend == "local" and corpus is None:
      corpus = str(_suite(config).corpus_path)  # the suite's generated corpus
    backend = tools_lib.make_search_backend(tc.search_backend, url=tc.search_url or None, corpus=corpus)
    tools["search"] = tools_lib.SearchTool(backend, topk=tc.search_topk)
  if not tools:
    return None
  return tools_lib.ToolSet(tools, mode=mode, call_limit=tc.call_limit, retry_count=tc.retry_count,
                           timeout_s=tc.python_timeout + 30.0, max_workers=tc.max_workers)


def policy_config(config):
  """rollout.* -> the rollout part's PolicyConfig (spec §1.7, §2.1)."""
  from aepo_jax.rollout import PolicyConfig
  r = config.rollout
  return PolicyConfig(
      n=r.n, initial_rollouts=r.initial_rollouts, beam_size=r.beam_size, entropy_weight=r.entropy_weight,
      branch_threshold=r.branch_probability, entropy_window=r.entropy_window, estimator=r.entropy_estimator,
      mode=r.mode, penalty_slope=r.consecutive_penalty, penalty_counts_refills=r.penalize_refills,
      enable_dynamic_rollouts=r.enable_dynamic_rollouts, premonitor_beta=r.premonitor_beta,
      probe_tokens=r.probe_tokens)


def prompt_ids(config, tokenizer, example) -> list:
  from aepo_jax.data import build_messages
  ids = tokenizer.apply_chat_template(build_messages(example, config.data.template), add_generation_prompt=True)
  if len(ids) > config.rollout.max_prompt_len:
    raise ValueError(f"a prompt has {len(ids)} tokens > rollout.max_prompt_len={config.rollout.max_prompt_len}; "
                     "raise it or shorten the template.")
  return ids


def make_rollout(config, model_cfg, tokenizer, tools, mesh, *, policy_name: Optional[str] = None,
                 temperature: Optional[float] = None, n: Optional[int] = None, result_mode: str = "train",
                 prompts_per_call: Optional[int] = None, max_response_len: Optional[int] = None):
  """fn(params, prompts (list of Example), key) -> Trajectories (docs/rollout_contract.md).

  prompts_per_call / max_response_len default to this host's data.prompts_per_step / rollout.max_response_len.
  """
  from aepo_jax import rollout as rollout_lib
  r = config.rollout
  pc = policy_config(config)
  if n is not None:
    import dataclasses
    pc = dataclasses.replace(pc, n=n, initial_rollouts=min(pc.initial_rollouts, n))
  policy = rollout_lib.rollout_policy(policy_name or r.policy, pc)
  per_host = prompts_per_call or config.data.prompts_per_step // jax.process_count()
  slots = r.max_slots or per_host * pc.n
  if prompts_per_call is not None:
    slots = max(slots, per_host * pc.n)
  response_len = max_response_len or r.max_response_len
  tags = tuple(t for t in ("search", "python") if t in tuple(config.tools.names))
  engine = rollout_lib.Engine(
      model_cfg, max_slots=slots, max_len=r.max_prompt_len + response_len, eos_ids=model_cfg.eos_token_ids,
      stop_sequences=rollout_lib.stop_sequences_from_strings(tokenizer, [f"</{t}>" for t in tags]),
      sampling=rollout_lib.SamplingParams(temperature=r.temperature if temperature is None else temperature,
                                          top_p=r.top_p, top_k=r.top_k),
      entropy_window=r.entropy_window, topk_entropy=r.topk_entropy, mesh=mesh)
  loop = rollout_lib.AgentLoop(engine, tokenizer, tools, rollout_lib.AgentConfig(
      max_response_len=response_len, max_tool_calls=config.tools.call_limit, chunk_steps=r.decode_chunk,
      tool_tags=tags, result_mode=result_mode), pad_id=pad_id(model_cfg, tokenizer))

  def rollout(params, prompts, key):
    seed = int(jax.random.randint(key, (), 0, 2**31 - 1))
    return loop.rollout(params, [prompt_ids(config, tokenizer, ex) for ex in prompts], policy, seed=seed)

  return rollout


def make_reward(config):
  """fn(traj, prompts) -> rewards [N]: the configured reward on each decoded response (spec §1.6)."""
  from aepo_jax import rewards as rewards_lib
  score = getattr(rewards_lib, config.reward.name)

  def reward(traj, prompts):
    answers = [prompts[g].answers for g in np.asarray(traj.group_id_b)]
    r = np.asarray([score(text, gts) for text, gts in zip(traj.response_text, answers)], np.float32)
    if config.algo.overlong_buffer:  # DAPO overlong shaping (spec §3.2)
      from aepo_jax import objectives
      r = r + np.asarray(objectives.overlong_reward_penalty(
          np.asarray(traj.response_len_b), max_response_length=config.rollout.max_response_len,
          buffer_length=config.algo.overlong_buffer, penalty_factor=config.algo.overlong_factor))
    return r
  return reward


def advantage_fn(config):
  """fn(rewards_b, group_ids_b, mask_bt, token_rewards_bt=None) -> advantages_bt.

  token_rewards_bt (the KL-in-reward penalty, verl `apply_kl_penalty`): estimators with token-level returns
  (reinforce_pp) take it per token; outcome estimators (grpo, rloo, ...) see the sequence score
  R + sum_t token_rewards_t, as verl's GRPO sums `token_level_rewards`.
  """
  from aepo_jax import objectives
  name = config.algo.advantage
  fn = objectives.advantage(name)
  defaults = objectives.advantage_defaults(name)
  hp = {"norm_by_std": config.algo.norm_by_std} if "norm_by_std" in defaults else {}

  def adv(rewards_b, group_ids_b, mask_bt, token_rewards_bt=None):
    if token_rewards_bt is None:
      return fn(rewards_b, group_ids_b, mask_bt, **hp)
    if "token_rewards" in defaults:
      return fn(rewards_b, group_ids_b, mask_bt, token_rewards=token_rewards_bt, **hp)
    seq_b = np.asarray(rewards_b, np.float32) + np.sum(np.asarray(token_rewards_bt) * (np.asarray(mask_bt) > 0), 1)
    return fn(seq_b, group_ids_b, mask_bt, **hp)
  return adv


def correct_b(traj, prompts) -> np.ndarray:
  """float[N]: 1 where the trajectory's answer is correct (`rewards.eval_correct`), for DAPO's 'acc' filter."""
  from aepo_jax import rewards as rewards_lib
  out = []
  for text, g in zip(traj.response_text, np.asarray(traj.group_id_b)):
    ex = prompts[int(g)]
    out.append(float(bool(rewards_lib.eval_correct(text, ex.answers, ex.family))))
  return np.asarray(out, np.float32)


def loss_hparams(config) -> dict:
  """algo.* -> the keyword hyperparameters the configured loss accepts (spec §1.5, §2.2, §3)."""
  from aepo_jax import objectives
  a = config.algo
  accepted = objectives.policy_loss_defaults(a.loss)
  candidates = {"clip_low": a.clip_low, "clip_high": a.clip_high, "clip_c": a.clip_c or None, "agg": a.agg,
                "entropy_advantage_coef": a.entropy_advantage_coef,
                "preserve_high_clip_grad": a.preserve_high_clip_grad}
  return {k: v for k, v in candidates.items() if k in accepted}


# ---------------------------------------------------------------------------------------------------------
# Metrics of a rollout, and evaluation.
# ---------------------------------------------------------------------------------------------------------
def rollout_metrics(traj, rewards_b, adv_bt) -> dict:
  mask = np.asarray(traj.loss_mask_bt) > 0
  out = {"reward/mean": float(np.mean(rewards_b)), "reward/std": float(np.std(rewards_b)),
         "reward/format_errors": float(np.mean(rewards_b < 0)),
         "rollout/response_len_mean": float(np.mean(traj.response_len_b)),
         "rollout/tool_calls_mean": float(np.mean(traj.num_tool_calls_b)),
         "rollout/trajectories": float(len(rewards_b)),
         "actor/advantage_mean": float(np.mean(np.asarray(adv_bt)[mask])) if mask.any() else 0.0,
         "rollout/sampler_entropy_mean": float(np.mean(np.asarray(traj.sampler_entropy_bt)[mask])) if mask.any()
         else 0.0}
  out.update({k if "/" in k else f"rollout/{k}": float(v) for k, v in dict(traj.stats).items()})
  return out


def rollout_histograms(traj, adv_bt) -> dict:
  mask = np.asarray(traj.loss_mask_bt) > 0
  return {"actor/entropy": np.asarray(traj.sampler_entropy_bt)[mask],
          "actor/advantage": np.asarray(adv_bt)[mask],
          "rollout/response_len": np.asarray(traj.response_len_b),
          "rollout/tool_calls": np.asarray(traj.num_tool_calls_b)}


_EVAL_ROLLOUTS: dict = {}


def evaluate(config, model_cfg, params, tokenizer, tools, mesh) -> dict:
  """n = 1 accuracy on each validation source (ARPO validation, spec §1.7; greedy unless eval.temperature):
  eval/<source>/accuracy (answer correct by `rewards.eval_correct`: math equivalence / EM, no LLM judge),
  eval/<source>/reward and eval/<source>/tool_calls (mean calls per answer)."""
  from aepo_jax import rewards as rewards_lib
  e = config.eval
  per_call = (e.batch_size or config.data.prompts_per_step) // jax.process_count()
  key = id(config)
  if key not in _EVAL_ROLLOUTS:
    _EVAL_ROLLOUTS[key] = make_rollout(config, model_cfg, tokenizer, tools, mesh, policy_name="none",
                                       temperature=e.temperature, n=1, prompts_per_call=per_call,
                                       max_response_len=e.max_response_len or None)
  rollout = _EVAL_ROLLOUTS[key]
  out = {}
  for source in config.data.val:
    examples = _examples(config, source, "val")
    limit = config.eval.num_prompts or config.data.val_size
    examples = examples[:limit] if limit else examples
    correct, reward, calls = [], [], []
    for i in range(0, len(examples), per_call):
      chunk = examples[i:i + per_call]
      traj = rollout(params, chunk, jax.random.key(i))
      correct.extend(correct_b(traj, chunk).tolist())
      reward.extend(float(rewards_lib.deep_research(text, chunk[int(g)].answers))
                    for text, g in zip(traj.response_text, np.asarray(traj.group_id_b)))
      calls.extend(np.asarray(traj.num_tool_calls_b, np.float32).tolist())
    name = _short(source)
    out[f"eval/{name}/accuracy"] = float(np.mean(correct)) if correct else 0.0
    out[f"eval/{name}/reward"] = float(np.mean(reward)) if reward else 0.0
    out[f"eval/{name}/tool_calls"] = float(np.mean(calls)) if calls else 0.0
  accs = [v for k, v in out.items() if k.endswith("/accuracy")]
  if accs:
    out["eval/accuracy"] = float(np.mean(accs))
  return out


def _short(source: str) -> str:
  return os.path.splitext(os.path.basename(str(source)))[0] or "val"


def local_rows(n_rows: int) -> Optional[slice]:
  p, n = jax.process_index(), jax.process_count()
  return slice(p * n_rows // n, (p + 1) * n_rows // n)
