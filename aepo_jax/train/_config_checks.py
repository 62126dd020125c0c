"""Config checks: `validate()` (every problem with its key and fix) and the mesh sizes. The names of the config's keys
and the did-you-mean hint that ends every unknown-name error are in `_config_names.py`; the defaults and loading in
`_config.py`, which re-exports all of these."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Optional


from aepo_jax.train._config_names import _unknown_keys, did_you_mean

MODES = ("sft", "rl", "both")


class ConfigError(ValueError):
  """A config value that cannot run; the message names the key and the fix."""


def _model_override_errors(config) -> list[str]:
  from aepo_jax.model import ModelConfig  # no jax device is touched by importing the dataclass

  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  errs = []
  for k in config.model.overrides.keys():
    if k not in fields:
      errs.append(f"model.overrides.{k} is not a ModelConfig field" + did_you_mean(k, fields))
  return errs


ROUTING_REPLAY = ("none", "rollout", "measure")


def routing_replay_error(model_name: str) -> str:
  return (
    f"algo.routing_replay='rollout' / 'measure' replays / measures the experts of sparse layers, and the model "
    f"{model_name!r} has none; "
    "set algo.routing_replay='none' (a dense model has no routing to replay)."
  )


def model_has_experts(config) -> Optional[bool]:
  """Whether config.model has sparse (expert) layers, where its shape is known without loading it: a preset
  (model.shape or model.name) or a local Hugging Face directory's config.json, with model.overrides; None otherwise
  (the trainer checks again once the model config is built)."""
  import os

  from aepo_jax import model as model_lib

  mc = config.model
  name = str(mc.shape or mc.name)
  try:
    if name in model_lib.PRESETS:
      return model_lib.preset(name, **dict(mc.overrides)).has_experts
    if os.path.isfile(os.path.join(name, "config.json")):
      return model_lib.read_hf_config(name).replace(**dict(mc.overrides)).has_experts
  except (ValueError, OSError, TypeError):  # a bad override or file: reported by its own check
    return None
  return None


def mesh_shape(mesh_cfg, num_devices: int) -> dict:
  """The (data, fsdp, tensor) sizes for `num_devices`, resolving one -1; raises ConfigError naming the key."""
  sizes = {a: int(mesh_cfg[a]) for a in ("data", "fsdp", "tensor")}
  bad = [a for a, s in sizes.items() if s == 0 or s < -1]
  if bad:
    raise ConfigError(f"mesh.{bad[0]}={sizes[bad[0]]}: use a positive size or -1 (the remaining devices).")
  if list(sizes.values()).count(-1) > 1:
    raise ConfigError(f"mesh={sizes}: at most one of mesh.data/fsdp/tensor may be -1.")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if -1 in sizes.values():
    if num_devices % fixed:
      raise ConfigError(
        f"mesh={sizes}: the fixed axes (product {fixed}) do not divide the {num_devices} "
        "devices; change mesh.fsdp / mesh.tensor."
      )
    sizes[next(a for a, s in sizes.items() if s == -1)] = num_devices // fixed
  elif fixed != num_devices:
    raise ConfigError(
      f"mesh={sizes} needs {fixed} devices but {num_devices} are available; set one axis "
      "to -1 (e.g. --config.mesh.data=-1) or make the product equal the device count."
    )
  return sizes


EXPERT_AXES = ("", "data", "fsdp", "data,fsdp")


def mesh_rules(config) -> tuple:
  """The logical-axis rules table of the training mesh: `parallel.DEFAULT_RULES`, with a model's stacked experts
  split whole over `mesh.expert_axis` (expert parallelism, `parallel.expert_parallel_rules`) when it names one.
  Parameters, optimizer state, checkpoints and the update and log-prob programs all follow it; the rollout engine's
  per-host mesh keeps the default (its batch is not split over hosts' devices)."""
  from aepo_jax import parallel

  axis = str(config.mesh.get("expert_axis", "") or "")
  if axis not in EXPERT_AXES:
    raise ConfigError(f"mesh.expert_axis={axis!r}: use one of {EXPERT_AXES} ('' keeps every expert on every device).")
  if not axis:
    return parallel.DEFAULT_RULES
  return parallel.expert_parallel_rules(tuple(axis.split(",")) if "," in axis else axis)


def _choices(config) -> list:
  """(key, value, known names) for every key whose choices a registry or a part's own table holds."""
  from aepo_jax import objectives, tools
  from aepo_jax.rollout import AgentConfig, PartialRollouts, policies
  from aepo_jax.train._step import AGGREGATIONS

  r, a = config.rollout, config.algo
  return [
    ("algo.loss", a.loss, objectives.list_policy_losses()),
    ("algo.advantage", a.advantage, objectives.list_advantages()),
    ("algo.kl.name", a.kl.name, objectives.list_kl_estimators()),
    ("algo.agg", a.agg, objectives.AGG_MODES),
    ("algo.aggregation", a.aggregation, AGGREGATIONS),
    ("algo.attribution", a.attribution, objectives.ATTRIBUTIONS),
    ("algo.off_policy", a.off_policy, objectives.list_off_policy()),
    ("rollout.policy", r.policy, policies.rollout_policy_names()),
    ("rollout.entropy_estimator", r.entropy_estimator, policies.ESTIMATORS),
    ("rollout.mode", r.mode, policies.MODES),
    ("rollout.premonitor_formula", r.premonitor_formula, policies.PREMONITOR_FORMULAS),
    ("rollout.tool_results", r.tool_results, AgentConfig.TOOL_RESULTS),
    ("train.hand_back", config.train.hand_back, PartialRollouts.ORDERS),
    ("tools.search_mode", config.tools.search_mode, tools.SEARCH_MODES),
  ]


def _registry_errors(config) -> list[str]:
  """Every name-valued key checked against the registry or table that defines it (imported lazily)."""
  errs = []
  try:
    table = _choices(config)
  except (ImportError, AttributeError) as e:  # a partial install: say so, the trainer will fail on lookup
    logging.warning("config: cannot check the registered names (%s)", e)
    return []
  for key, value, names in table:
    names = list(names)
    if value not in names:
      errs.append(f"{key}={value!r} is not registered" + did_you_mean(value, names) + f" (known: {', '.join(names)})")
  return errs


def validate(config, *, num_devices: Optional[int] = None, check_registries: bool = True):
  """Raise ConfigError listing every problem (key + fix). Claims no device: pass `num_devices` to check the mesh."""
  errs = _unknown_keys(config)
  if errs:  # the rest would only add noise
    raise ConfigError("invalid config:\n  " + "\n  ".join(errs))
  errs += _model_override_errors(config)
  r, a, t, s, d = config.rollout, config.algo, config.train, config.sft, config.data
  sizes = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_position_embeddings",
  )
  for k, v in config.model.overrides.items():  # a non-positive size fails only deep inside model init, or not at all
    if k in sizes and not (isinstance(v, int) and v >= 1):
      errs.append(f"model.overrides.{k}={v!r}: must be a positive integer.")

  def need(ok, msg):
    if not ok:
      errs.append(msg)

  need(config.mode in MODES, f"mode={config.mode!r}: choose one of {MODES}.")
  need(
    config.model.init in ("pretrained", "random", "checkpoint"),
    f"model.init={config.model.init!r}: use 'pretrained', 'random' or 'checkpoint'.",
  )
  for k in ("dtype", "param_dtype"):
    need(
      config.model[k] in ("float32", "bfloat16", "float16"),
      f"model.{k}={config.model[k]!r}: use float32, bfloat16 or float16.",
    )
  need(r.n >= 1, f"rollout.n={r.n}: the group size must be >= 1.")
  need(
    1 <= r.initial_rollouts <= r.n,
    f"rollout.initial_rollouts={r.initial_rollouts} must lie in [1, rollout.n={r.n}]; lower it or raise rollout.n.",
  )
  need(r.beam_size >= 1, f"rollout.beam_size={r.beam_size}: must be >= 1.")
  need(0.0 <= r.branch_probability <= 1.0, f"rollout.branch_probability={r.branch_probability}: must be in [0, 1].")
  need(r.entropy_window >= 1 and r.topk_entropy >= 1, "rollout.entropy_window and rollout.topk_entropy must be >= 1.")
  need(r.consecutive_penalty >= 0, f"rollout.consecutive_penalty={r.consecutive_penalty}: must be >= 0.")
  need(r.max_prompt_len >= 1 and r.max_response_len >= 1, "rollout.max_prompt_len / max_response_len must be >= 1.")
  need(r.temperature >= 0, f"rollout.temperature={r.temperature}: must be >= 0.")
  need(0 < r.top_p <= 1, f"rollout.top_p={r.top_p}: must be in (0, 1].")
  need(r.top_k >= 0, f"rollout.top_k={r.top_k}: use 0 for off (not -1).")
  need(
    r.repetition_penalty > 0 and math.isfinite(r.repetition_penalty),
    f"rollout.repetition_penalty={r.repetition_penalty}: must be a finite number > 0 (1 = off; the evaluation "
    "protocol uses 1.1).",
  )
  need(0.0 <= r.min_p <= 1.0, f"rollout.min_p={r.min_p}: must be in [0, 1] (0 = off).")
  need(
    r.max_slots == 0 or r.max_slots >= r.n, f"rollout.max_slots={r.max_slots}: 0 (auto) or at least rollout.n={r.n}."
  )
  need(config.reward.timeout_s > 0, f"reward.timeout_s={config.reward.timeout_s}: must be > 0 (seconds per response).")
  need(r.decode_chunk >= 1, f"rollout.decode_chunk={r.decode_chunk}: must be >= 1.")
  need(r.decode_rows >= 0, f"rollout.decode_rows={r.decode_rows}: must be >= 0 (0: every active slot).")
  need(
    r.prefill_chunk >= 16 and r.prefill_rows >= 1,
    f"rollout.prefill_chunk={r.prefill_chunk} must be >= 16 and rollout.prefill_rows={r.prefill_rows} >= 1.",
  )
  need(
    r.dtype in ("", "float32", "bfloat16", "float16"),
    f"rollout.dtype={r.dtype!r}: use '' (= model.dtype), float32, bfloat16 or float16.",
  )
  from aepo_jax.rollout import KV_LAYOUTS

  need(r.kv_layout in KV_LAYOUTS, f"rollout.kv_layout={r.kv_layout!r}: use one of {KV_LAYOUTS}.")
  need(r.page_size >= 1, f"rollout.page_size={r.page_size}: must be >= 1 (tokens per KV page; 64 on TPU).")
  need(
    r.kv_tokens == 0 or r.kv_tokens >= r.max_prompt_len + r.max_response_len,
    f"rollout.kv_tokens={r.kv_tokens}: 0 (every slot at full length) or at least one trajectory, rollout."
    f"max_prompt_len + max_response_len = {r.max_prompt_len + r.max_response_len} tokens.",
  )
  rm = [int(r.mesh[k]) for k in ("data", "fsdp", "tensor")]
  need(
    all(v >= 1 or v == -1 for v in rm) and rm.count(-1) <= 1,
    f"rollout.mesh={dict(r.mesh)}: positive sizes, at most one -1 (the rest of a host's devices).",
  )

  need(
    0 <= a.clip_low < 1 or (a.loss == "cispo" and a.clip_low <= 1),
    f"algo.clip_low={a.clip_low}: must be in [0, 1) (the lower bound is 1 - clip_low).",
  )
  need(a.clip_high > 0, f"algo.clip_high={a.clip_high}: must be > 0 (the upper bound is 1 + clip_high).")
  need(a.clip_c == 0 or a.clip_c > 1, f"algo.clip_c={a.clip_c}: the dual clip must be > 1, or 0 for off.")
  need(a.entropy_advantage_coef >= 0, f"algo.entropy_advantage_coef={a.entropy_advantage_coef}: must be >= 0.")
  need(
    a.entropy_advantage_coef == 0 or a.loss == "aepo",
    f"algo.entropy_advantage_coef={a.entropy_advantage_coef} only acts with algo.loss='aepo' "
    f"(got {a.loss!r}); set it to 0.",
  )
  need(a.kl.coef >= 0, f"algo.kl.coef={a.kl.coef}: must be >= 0.")
  if a.verl_dynamic_bsz:
    need(
      a.aggregation == "verl",
      f"algo.verl_dynamic_bsz=True weights verl's micro-batches, which only algo.aggregation='verl' uses (got "
      f"{a.aggregation!r}); set algo.aggregation='verl' or turn it off.",
    )
    rows = config.train.ppo_mini_batch_size * config.rollout.n
    need(
      a.verl_world_size >= 1 and rows % a.verl_world_size == 0,
      f"algo.verl_world_size={a.verl_world_size}: verl splits each mini-batch of {rows} rows (train.ppo_mini_batch"
      "_size x rollout.n) evenly over its ranks; pick a divisor.",
    )
    longest = config.rollout.max_prompt_len + config.rollout.max_response_len
    need(
      a.verl_max_token_len == 0 or a.verl_max_token_len >= longest,
      f"algo.verl_max_token_len={a.verl_max_token_len}: verl needs room for the longest row ({longest} = "
      "rollout.max_prompt_len + max_response_len); raise it, or 0 for 2 x that.",
    )
  need(
    a.routing_replay in ROUTING_REPLAY,
    f"algo.routing_replay={a.routing_replay!r}: use one of {ROUTING_REPLAY} ('rollout', 'measure': a model with "
    "experts).",
  )
  if a.routing_replay != "none" and model_has_experts(config) is False:
    errs.append(routing_replay_error(config.model.shape or config.model.name))
  try:
    mesh_rules(config)  # names a bad mesh.expert_axis
  except ConfigError as e:
    errs.append(str(e))
  expert_axis = str(config.mesh.get("expert_axis", "") or "")
  aux_coef = float(config.model.overrides.get("router_aux_loss_coef", 0.0) or 0.0)
  need(aux_coef >= 0, f"model.overrides.router_aux_loss_coef={aux_coef}: use a weight >= 0 (0: off).")
  if aux_coef > 0 and model_has_experts(config) is False:
    errs.append(
      f"model.overrides.router_aux_loss_coef={aux_coef}, but model {config.model.shape or config.model.name!r} has "
      "no experts (no router to balance): leave it 0."
    )
  if expert_axis and model_has_experts(config) is False:
    errs.append(
      f"mesh.expert_axis={expert_axis!r}, but model {config.model.shape or config.model.name!r} has no experts: "
      "leave mesh.expert_axis=''."
    )
  need(
    a.off_policy_cap == 0 or (a.off_policy_cap >= 1 if a.off_policy == "tis" else a.off_policy_cap > 1),
    f"algo.off_policy_cap={a.off_policy_cap}: a cap on pi_old/pi_sampler must be "
    f"{'>= 1' if a.off_policy == 'tis' else '> 1'}, or 0 for the method's default.",
  )
  need(
    isinstance(t.max_staleness, int) and t.max_staleness >= 0,
    f"train.max_staleness={t.max_staleness!r}: an integer >= 0 (0 = synchronous steps).",
  )
  need(
    isinstance(t.call_floor, (int, float)) and not isinstance(t.call_floor, bool) and t.call_floor >= 0,
    f"train.call_floor={t.call_floor!r}: a number >= 0 (a fraction of the mean tokens per step; 0 = no floor).",
  )
  need(
    isinstance(t.staleness_ramp, bool),
    f"train.staleness_ramp={t.staleness_ramp!r}: True or False (fill the partial-rollout run one batch per step).",
  )
  need(
    not (t.max_staleness and a.filter_groups),
    f"train.max_staleness={t.max_staleness} with algo.filter_groups=True: DAPO's dynamic sampling is not supported "
    "with partial rollouts; set one of them off.",
  )
  need(a.filter_metric in ("acc", "reward"), f"algo.filter_metric={a.filter_metric!r}: use 'acc' or 'reward'.")
  need(a.max_num_gen_batches >= 0, f"algo.max_num_gen_batches={a.max_num_gen_batches}: must be >= 0 (0 = no limit).")
  need(
    not a.kl.use_in_reward or a.kl.coef > 0,
    f"algo.kl.use_in_reward=True with algo.kl.coef={a.kl.coef}: the penalty would be zero; set a coef > 0.",
  )
  need(a.overlong_buffer >= 0, f"algo.overlong_buffer={a.overlong_buffer}: must be >= 0.")
  need(
    a.overlong_buffer < r.max_response_len,
    f"algo.overlong_buffer={a.overlong_buffer} must be smaller than rollout.max_response_len={r.max_response_len}.",
  )

  tc, b = config.tools, config.tools.browse
  if tc.search_mode == "browse":
    need(
      bool(b.summarizer_url) and bool(b.summarizer_model),
      "tools.search_mode='browse' needs tools.browse.summarizer_url (an OpenAI-compatible base URL, e.g. "
      "http://127.0.0.1:8000/v1) and tools.browse.summarizer_model.",
    )
    need(
      bool(b.pages or tc.search_corpus or b.live),
      "tools.search_mode='browse' needs a page store: tools.browse.pages (a directory or a corpus JSONL) or "
      "tools.search_corpus, or tools.browse.live=True.",
    )
    need(
      b.max_pages >= 1 and b.page_chars >= 1,
      f"tools.browse.max_pages={b.max_pages} and tools.browse.page_chars={b.page_chars} must be >= 1.",
    )
  need(
    bool(config.eval.judge_url) == bool(config.eval.judge_model),
    "eval.judge_url and eval.judge_model go together (the OpenAI-compatible base URL and the model name).",
  )
  need(
    not (config.eval.judge_checkpoint and config.eval.judge_url),
    "eval.judge_checkpoint serves a judge here, eval.judge_url uses one elsewhere: set one of them.",
  )
  need(
    config.eval.get("protocol", "project") in ("official", "project"),
    f"eval.protocol={config.eval.get('protocol')!r} must be 'official' or 'project'.",
  )
  o = config.optim
  need(o.lr > 0, f"optim.lr={o.lr}: must be > 0.")
  need(o.schedule in ("constant", "cosine", "linear"), f"optim.schedule={o.schedule!r}: constant, cosine or linear.")
  need(
    o.warmup_steps >= 0 and o.grad_clip >= 0 and o.weight_decay >= 0,
    "optim.warmup_steps, optim.grad_clip and optim.weight_decay must be >= 0.",
  )
  need(0 <= o.b1 < 1 and 0 <= o.b2 < 1, f"optim.b1={o.b1}, optim.b2={o.b2}: must be in [0, 1).")

  need(d.prompts_per_step >= 1, f"data.prompts_per_step={d.prompts_per_step}: must be >= 1.")
  need(
    t.ppo_mini_batch_size >= 1 and d.prompts_per_step % t.ppo_mini_batch_size == 0,
    f"train.ppo_mini_batch_size={t.ppo_mini_batch_size} (prompts) must divide data.prompts_per_step="
    f"{d.prompts_per_step}; pick a divisor.",
  )
  need(
    t.micro_batch_size >= 1 and (t.ppo_mini_batch_size * r.n) % t.micro_batch_size == 0,
    f"train.micro_batch_size={t.micro_batch_size} (sequences) must divide ppo_mini_batch_size*n="
    f"{t.ppo_mini_batch_size * r.n}; pick a divisor.",
  )
  need(t.ppo_epochs >= 1, f"train.ppo_epochs={t.ppo_epochs}: must be >= 1.")
  need(t.steps >= 0, f"train.steps={t.steps}: must be >= 1 (or 0: train.epochs decide).")
  need(t.epochs >= 0, f"train.epochs={t.epochs}: must be >= 1 (or 0 with train.steps >= 1).")
  need(t.steps > 0 or t.epochs > 0, "train.steps=0 needs train.epochs > 0 (or set train.steps).")
  need(t.peak_tflops >= 0, f"train.peak_tflops={t.peak_tflops}: must be >= 0 (0: no MFU).")
  need(s.packed_rows >= 0, f"sft.packed_rows={s.packed_rows}: must be >= 0 (0 turns packing off).")
  need(d.val_size >= 0, f"data.val_size={d.val_size}: must be >= 0.")
  need(
    d.suite.n_train >= 1 and d.suite.n_heldout >= 0,
    f"data.suite.n_train={d.suite.n_train} must be >= 1 and data.suite.n_heldout={d.suite.n_heldout} >= 0.",
  )
  need(config.eval.num_prompts >= 0, f"eval.num_prompts={config.eval.num_prompts}: must be >= 0 (0: all).")
  tl = config.tools
  need(
    tl.call_limit >= 0 and tl.retry_count >= 0 and tl.max_workers >= 1 and tl.search_topk >= 1,
    f"tools.call_limit={tl.call_limit} and tools.retry_count={tl.retry_count} must be >= 0, tools.max_workers="
    f"{tl.max_workers} and tools.search_topk={tl.search_topk} >= 1.",
  )
  need(
    tl.python_max_output >= 1 and tl.python_memory_mb >= 1 and tl.python_timeout > 0,
    f"tools.python_max_output={tl.python_max_output}, tools.python_memory_mb={tl.python_memory_mb} and "
    f"tools.python_timeout={tl.python_timeout} must be > 0.",
  )
  need(
    t.nan_limit >= 0 and t.log_every >= 1 and t.eval_every >= 0,
    "train.nan_limit >= 0, train.log_every >= 1, train.eval_every >= 0.",
  )
  need(
    t.saved_logits_mb >= 0,
    f"train.saved_logits_mb={t.saved_logits_mb}: must be >= 0 (MiB of logits kept for the backward; 0: none).",
  )
  need(
    0.0 <= t.logit_fraction <= 1.0,
    f"train.logit_fraction={t.logit_fraction}: must be in [0, 1] (0: the LM head at every position).",
  )
  if s.enabled or config.mode == "sft":
    need(s.steps >= 1, f"sft.steps={s.steps}: must be >= 1 when SFT runs.")
    need(s.batch_size >= 1, f"sft.batch_size={s.batch_size}: demonstrations per step must be >= 1.")
    need(s.max_len >= 2, f"sft.max_len={s.max_len}: tokens per row must be >= 2 (a token and its target).")
    if s.packed_rows:
      need(
        0 < s.packed_rows <= s.batch_size and s.micro_batch_size >= 1 and s.packed_rows % s.micro_batch_size == 0,
        f"sft.packed_rows={s.packed_rows}: must be in [1, sft.batch_size={s.batch_size}] and a multiple of "
        f"sft.micro_batch_size={s.micro_batch_size} (0 turns packing off).",
      )
    else:
      need(
        s.micro_batch_size >= 1 and s.batch_size % s.micro_batch_size == 0,
        f"sft.micro_batch_size={s.micro_batch_size} must divide sft.batch_size={s.batch_size}.",
      )
    need(s.lr > 0 and 0 <= s.warmup_frac < 1, "sft.lr must be > 0 and sft.warmup_frac in [0, 1).")
    need(s.schedule in ("constant", "cosine", "linear"), f"sft.schedule={s.schedule!r}: constant, cosine or linear.")
    need(
      s.source in ("suite", "synthetic") or str(s.source).lower().endswith((".jsonl", ".parquet")),
      f"sft.source={s.source!r}: use 'suite', 'synthetic' or a .jsonl / .parquet file of chat traces (local or "
      "gs://; docs/data.md).",
    )
  su, ev = d.suite, config.eval
  need(
    0.0 <= su.tool_demo_fraction <= 1.0,
    f"data.suite.tool_demo_fraction={su.tool_demo_fraction}: the share of tool-using demos must be in [0, 1].",
  )
  need(su.top_k >= 1, f"data.suite.top_k={su.top_k}: search pages per demo result must be >= 1.")
  need(
    ev.batch_size >= 0 and ev.max_response_len >= 0 and ev.temperature >= 0,
    "eval.batch_size, eval.max_response_len (0 = the defaults) and eval.temperature must be >= 0.",
  )
  pass_k, pass_t = ev.get("pass_k", 0), ev.get("pass_k_temperature", 0.0) or config.rollout.temperature
  need(
    pass_k >= 0 and (pass_k == 0 or pass_t > 0),
    f"eval.pass_k={pass_k} at temperature {pass_t}: pass_k must be >= 0 (0: off), and its samples need a "
    "temperature > 0 (set eval.pass_k_temperature or rollout.temperature); k greedy answers are one answer.",
  )
  if config.mode == "sft" and not s.enabled:
    errs.append("mode='sft' with sft.enabled=False: set sft.enabled=True.")
  ck = config.checkpoint
  need(ck.every_steps >= 1 and ck.keep >= 1, "checkpoint.every_steps and checkpoint.keep must be >= 1.")
  need(ck.best_mode in ("max", "min"), f"checkpoint.best_mode={ck.best_mode!r}: 'max' or 'min'.")
  need(ck.on_corrupt in ("fallback", "stop"), f"checkpoint.on_corrupt={ck.on_corrupt!r}: 'fallback' or 'stop'.")
  need(ck.resume in ("check", "force"), f"checkpoint.resume={ck.resume!r}: 'check' or 'force'.")
  need(bool(config.workdir), "workdir is empty: set --config.workdir=/path or gs://bucket/path.")
  if num_devices is not None:
    try:
      shape = mesh_shape(config.mesh, num_devices)
      dp = shape["data"] * shape["fsdp"]
      if (t.micro_batch_size % dp) and (config.mode != "sft"):
        errs.append(
          f"train.micro_batch_size={t.micro_batch_size} must be a multiple of the data-parallel size "
          f"mesh.data*mesh.fsdp={dp}."
        )
      if (s.enabled or config.mode == "sft") and s.micro_batch_size % dp:
        errs.append(f"sft.micro_batch_size={s.micro_batch_size} must be a multiple of mesh.data*mesh.fsdp={dp}.")
    except ConfigError as e:
      errs.append(str(e))
  if check_registries:
    errs += _registry_errors(config)
  if errs:
    raise ConfigError("invalid config:\n  " + "\n  ".join(errs))
  return config
