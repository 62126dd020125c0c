"""The experiment config: one base with every key and its default, validation at load, CLI overrides.

Experiment files (`configs/*.py`) start from `base_config()` and override; the base is locked, so a key
that does not exist is an error at the line that sets it. `validate()` runs before any device is claimed
and names the key and the fix for each problem it finds.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import logging
import math
import os
from typing import Optional

import ml_collections

MODES = ("sft", "rl", "both")


def base_config() -> ml_collections.ConfigDict:
  """Every key with its default.

  Algorithm constants are those of the released ARPO/AEPO code and scripts (spec §1.7, §2.4; n, N0, batch and
  lengths from the 14B deep-search scripts), with the paper's full AEPO method switched on. Where a default is
  deliberately not the code's, its comment says so: rollout.entropy_estimator ('exact', the paper's entropy),
  rollout.mode ('corrected') and algo.aggregation ('global'). The `:released` presets of configs/ set the code's
  values (configs/common.py `released`); the rollout.* defaults equal `aepo_jax.rollout.PolicyConfig()`'s.
  """
  c = ml_collections.ConfigDict()
  c.workdir = "/tmp/aepo_jax_run"  # local path or gs://bucket/path: checkpoints, metrics, plots, config
  c.mode = "both"  # sft | rl | both (SFT first, then RL from its final parameters)

  # Model: a preset name (random init), 'smollm2-135m-instruct' (load_pretrained), an HF dir, or gs://.
  c.model = ml_collections.ConfigDict()
  c.model.name = "smollm2-135m-instruct"
  c.model.init = "pretrained"  # pretrained (load the weights named by `name`) | random (preset shape)
  c.model.dtype = "float32"  # compute dtype; bfloat16 on TPU, float32 on CPU (XLA's CPU bf16 is slow)
  c.model.param_dtype = "float32"
  c.model.remat = False
  c.model.tokenizer = ""  # '' = the tokenizer that comes with the model
  # The preset whose shape the checkpoint at `name` has (e.g. qwen3-14b for a gs:// Qwen3-14B SFT checkpoint): lets
  # launch/compile.py build the model's programs without reading the checkpoint. '' = read `name` (preset/HF dir).
  c.model.shape = ""
  # ModelConfig field overrides (e.g. num_layers=2 for a tiny test model). Validated against ModelConfig.
  c.model.overrides = ml_collections.ConfigDict()

  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))  # -1 allowed once: the rest

  c.data = ml_collections.ConfigDict()
  # Sources: 'suite' (the generated task suite: its train split; its held-out split in `val`), an ARPO RL
  # file name (hard_search_1k, train_10k, valid, gaia_test, hle_test; $AEPO_ARPO_DATA), a benchmark name (gaia,
  # hle, math500, ...; aepo_jax.data.BENCHMARKS) or a .jsonl / .parquet file, local or gs://, of question/answer
  # records or verl records (docs/data.md). GAIA/HLE never go in `train`.
  c.data.train = "suite"
  c.data.val = ()
  c.data.template = "code_search"
  # Fields of question/answer records in .jsonl / .parquet sources: `answer` holds a string, a number or a list
  # of accepted answers; `system` (optional) a record's own system prompt, used instead of the template's.
  c.data.fields = ml_collections.ConfigDict(dict(question="question", answer="answer", system="system"))
  c.data.family = "qa"  # answers of those records: qa (math equivalence or exact match) | math (equivalence only)
  c.data.prompts_per_step = 64  # train_batch_size, in prompts
  c.data.seed = 0
  c.data.shuffle = True
  c.data.val_size = 0  # 0 = the whole validation set
  # The generated suite (aepo_jax.data.generate_suite): mix = shares of (arith, kb, both) tasks; top_k = pages
  # per search result in the demos; tool_demo_fraction = share of demos that call tools (the rest answer from
  # memory: a cold start that has not learnt when its tools are needed, which RL then has to teach).
  c.data.suite = ml_collections.ConfigDict(
    dict(seed=0, n_train=512, n_heldout=64, difficulty=1, mix=(0.4, 0.4, 0.2), top_k=3, tool_demo_fraction=1.0)
  )

  c.tools = ml_collections.ConfigDict()
  c.tools.names = ("python", "search")
  c.tools.python_timeout = 120.0
  c.tools.python_memory_mb = 1024
  c.tools.python_max_output = 4096
  c.tools.allow_unsandboxed = False
  # local (BM25 over search_corpus) | retrieval (a retrieval server at search_url) | replay (the query -> result
  # cache in search_corpus, default ARPO's search_cache.json) | serper | brave | bing (web APIs, key in
  # $SERPER_API_KEY / $BRAVE_API_KEY / $BING_API_KEY)
  c.tools.search_backend = "local"
  c.tools.search_url = ""
  c.tools.search_corpus = ""  # '' = the task suite's generated corpus
  c.tools.search_topk = 10
  # snippets: the result is the hits' `Page i: <snippet>` lines (the training tool, spec §4) | browse: the evaluation's
  # SDS browser (spec §2.5): the hits' pages are fetched from tools.browse.pages and an LLM at
  # tools.browse.summarizer_url (any OpenAI-compatible server) condenses them into the result.
  c.tools.search_mode = "snippets"
  # pages: a directory of page files or a corpus JSONL ('' = tools.search_corpus); max_pages: hits fetched per
  # query; page_chars: characters of each page shown to the summariser; live: fetch a hit's http(s) URL that the
  # store lacks (off: the snippet stands in for it).
  c.tools.browse = ml_collections.ConfigDict(
    dict(pages="", summarizer_url="", summarizer_model="", max_pages=10, page_chars=5000, live=False)
  )
  c.tools.call_limit = 6
  c.tools.retry_count = 4
  c.tools.max_workers = 64

  c.rollout = ml_collections.ConfigDict()
  c.rollout.policy = "aepo"  # none | arpo | aepo
  c.rollout.n = 12  # group size = total budget per prompt
  c.rollout.initial_rollouts = 6
  c.rollout.beam_size = 2
  c.rollout.branch_probability = 0.5
  c.rollout.entropy_weight = 0.2
  # exact (the paper: full-vocabulary entropy, mean over the window) | official (the code: top-k truncated entropy
  # summed over the window / ln|V|, spec §1.2 2.2)
  c.rollout.entropy_estimator = "exact"
  # corrected (ours: per-trajectory initial entropy, decision after the tool result) | faithful (the code's quirks
  # Q1 and the one-call lag, spec §1.2, §5)
  c.rollout.mode = "corrected"
  c.rollout.entropy_window = 20
  c.rollout.topk_entropy = 10
  c.rollout.consecutive_penalty = 0.05  # slope of P̂(l) = slope·l (spec §2.1)
  c.rollout.penalize_refills = True
  c.rollout.enable_dynamic_rollouts = True  # paper: True; released scripts: False (spec §2.6)
  c.rollout.premonitor_beta = 0.5
  c.rollout.probe_tokens = 50
  c.rollout.max_prompt_len = 2000
  c.rollout.max_response_len = 6192
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0  # 0 = off (verl's -1)
  # Sampler extras (vLLM semantics; training scripts: off). repetition_penalty: logits of every token already in the
  # row (prompt, generated, tool results) divided by it when positive, multiplied when negative; 1 = off.
  # min_p: keep tokens with probability >= min_p x the top one; 0 = off. The evaluation protocol uses 1.1 and 0.
  c.rollout.repetition_penalty = 1.0
  c.rollout.min_p = 0.0
  c.rollout.max_slots = 0  # 0 = prompts_per_step * n
  c.rollout.decode_chunk = 32
  # Each host rolls out its own prompts on its own devices, independently of the other hosts: the policy weights
  # are copied once per RL step from the training mesh onto this per-host mesh (-1 once: the rest of the host's
  # devices), in rollout.dtype ('' = model.dtype: bfloat16 on accelerators, float32 on CPU).
  c.rollout.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=-1))
  c.rollout.dtype = ""
  c.rollout.prefill_chunk = 256  # tokens per prefill/extend call and row
  c.rollout.prefill_rows = 16  # rows per prefill/extend call (bounds its activations and KV window)
  # The engine's KV cache (aepo_jax/rollout/_pages.py). 'auto': paged on TPU (a pool of pages shared by the host's
  # slots; a fork shares its parent's full pages; decode through JAX's Pallas paged-attention kernel), dense
  # elsewhere (a max_len row per slot; the CPU kernels read dense rows). kv_tokens: the paged pool in tokens per
  # host, 0 = max_slots x max_len (every slot at full length at once). A smaller pool fits longer contexts: slots
  # that run short wait, and the agent loop preempts (re-prefills later) when nothing else can go on.
  c.rollout.kv_layout = "auto"
  c.rollout.page_size = 64
  c.rollout.kv_tokens = 0

  # timeout_s: wall time per response in a scoring worker (math-verify on a hostile answer can run for minutes);
  # past it the response scores 0 and the step goes on.
  c.reward = ml_collections.ConfigDict(dict(name="deep_research", timeout_s=10.0))

  c.algo = ml_collections.ConfigDict()
  c.algo.advantage = "grpo"
  c.algo.norm_by_std = True
  c.algo.loss = "aepo"
  c.algo.clip_low = 0.2
  c.algo.clip_high = 0.2
  c.algo.clip_c = 3.0  # dual clip; 0 = off
  c.algo.agg = "token-mean"
  # How micro-batch losses combine under gradient accumulation: global (ours: one token-mean over the whole
  # mini-batch, as one big batch) | verl (the code: each micro-batch's own mean, weighted by its share of the
  # sequences; use_dynamic_bsz, spec §1.5, §5 item 10).
  c.algo.aggregation = "global"
  # Credit for a prefix shared by branches (spec §1.4): soft (the code: GRPO on every trajectory, the prefix
  # repeated per copy) | hard (the paper's option: each shared prefix token gets the mean advantage of the
  # trajectories that share it).
  c.algo.attribution = "soft"
  # Importance weights for tokens the engine sampled under another policy than the trainer's pi_old (its own numeric
  # precision, or an older parameter version): none | tis (truncated IS, w = min(pi_old/pi_sampler, cap); verl PR
  # #2953) | decoupled (AReaL's decoupled PPO: tokens with w > cap leave the loss). cap 0: the method's default (tis
  # 2, decoupled 5). objectives/_off_policy.py.
  c.algo.off_policy = "none"
  c.algo.off_policy_cap = 0.0
  c.algo.entropy_advantage_coef = 0.2  # paper's full method; 0 reproduces the released runs (spec §2.3)
  c.algo.preserve_high_clip_grad = True
  # KL to the reference (the RL start): a loss term (coef > 0), or with use_in_reward a token-level reward
  # penalty −coef·KL(old, ref) (verl use_kl_in_reward: then there is no KL loss term).
  c.algo.kl = ml_collections.ConfigDict(dict(name="low_var_kl", coef=0.0, use_in_reward=False))
  # DAPO dynamic sampling: drop groups whose filter_metric ('acc' = answer correct, or 'reward') is the same
  # for every trajectory, and keep generating (at most max_num_gen_batches batches; 0 = no limit) until
  # data.prompts_per_step groups are kept.
  c.algo.filter_groups = False
  c.algo.filter_metric = "acc"
  c.algo.max_num_gen_batches = 10
  c.algo.overlong_buffer = 0  # DAPO overlong shaping; 0 = off
  c.algo.overlong_factor = 1.0

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 1e-6
  c.optim.warmup_steps = 0
  c.optim.schedule = "constant"  # constant | cosine | linear
  c.optim.end_lr_fraction = 0.0
  c.optim.weight_decay = 0.01
  c.optim.grad_clip = 1.0
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.eps = 1e-8

  c.train = ml_collections.ConfigDict()
  c.train.steps = 0  # RL steps; 0 = derive from epochs and the train set size
  c.train.epochs = 1
  c.train.ppo_mini_batch_size = 8  # in prompts (verl convention)
  c.train.micro_batch_size = 8  # in sequences (gradient accumulation)
  c.train.ppo_epochs = 1
  c.train.seed = 0
  c.train.nan_limit = 3  # non-finite losses skipped before a clear stop
  c.train.eval_every = 0  # 0 = only before and after RL
  c.train.log_every = 1
  # > 0: the update steps (SFT and RL) compute the LM head only at loss positions, up to this fraction of a
  # micro-batch's rows x length (a micro-batch with more loss tokens takes the dense path: same result, only the
  # time differs). The head is ~1/4 of a small model's step FLOPs; prompts and padding need no logits.
  c.train.logit_fraction = 0.0
  # The update steps keep a micro-batch's float32 logits from the forward for the backward when they take at most
  # this many MiB (one LM-head matmul fewer per step); larger ones are recomputed chunk by chunk. 0: always recompute.
  c.train.saved_logits_mb = 1024.0
  # Peak dense TFLOP/s of one chip, for perf/mfu; 0 = the known TPU/GPU kinds' table (no MFU on CPU).
  c.train.peak_tflops = 0.0

  c.sft = ml_collections.ConfigDict()
  c.sft.enabled = False
  # 'suite' (the generated suite's demonstrations), 'synthetic' (tests), or a .jsonl / .parquet file (local or gs://,
  # read as a stream) of chat traces in LLaMA-Factory's alpaca (instruction/input/output) or sharegpt
  # (conversations / messages) form; tool results inside an assistant turn (<result>...</result>) get no loss
  # (docs/data.md). Traces longer than max_len are cut there (LLaMA-Factory's cutoff_len; the papers use 15,000).
  c.sft.source = "suite"
  c.sft.steps = 100
  c.sft.lr = 7e-6  # AEPO cold start: 7e-6, cosine, warm-up 0.1 (spec §2.4)
  c.sft.schedule = "cosine"
  c.sft.warmup_frac = 0.1
  c.sft.batch_size = 8
  c.sft.micro_batch_size = 8
  c.sft.max_len = 1024
  # 0: one demo per row of max_len. R > 0: each step's batch_size demos are packed into R rows of max_len
  # (attention within each demo; the same loss on fewer padded tokens); micro_batch_size then counts rows.
  c.sft.packed_rows = 0
  c.sft.seed = 0

  c.eval = ml_collections.ConfigDict()
  c.eval.before_rl = True
  c.eval.after_rl = True
  c.eval.num_prompts = 0  # 0 = data.val_size
  c.eval.temperature = 0.0  # greedy, n = 1 (ARPO validation)
  c.eval.max_response_len = 0  # 0 = rollout.max_response_len
  c.eval.batch_size = 0  # prompts per evaluation rollout; 0 = data.prompts_per_step
  # An LLM judge (any OpenAI-compatible server: base URL and model) for the QA and deep-search validation sets,
  # OR'ed with math equivalence as in the evaluation protocol (spec §2.5); '' = math equivalence / exact match only.
  c.eval.judge_url = ""
  c.eval.judge_model = ""
  # Or serve a judge from this process: a bundled model name, an HF directory or a training checkpoint (local or
  # gs://), behind aepo_jax.serve on 127.0.0.1 for the run (each host its own); excludes judge_url.
  c.eval.judge_checkpoint = ""
  # Scoring of the validation answers: 'project' (math-verify, the strict judge) or 'official' (the official
  # ARPO/AEPO evaluator's metrics, judge prompt and reply rule: aepo_jax.eval._scoring). The paper configs: official.
  c.eval.protocol = "project"

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 10
  c.checkpoint.keep = 3
  c.checkpoint.best_metric = "eval/accuracy"  # '' = keep no best
  c.checkpoint.best_mode = "max"
  c.checkpoint.async_save = True
  c.checkpoint.ocdbt = True  # Orbax's OCDBT format (few files); False = one zarr per array (storage emulators)
  c.checkpoint.compression = True  # zstd (Orbax's default); False: ~20% larger, ~4x less CPU per save (small hosts)
  # A checkpoint whose files or arrays differ from their checksums at save, or hold NaN/inf: 'fallback' moves it
  # aside (<step>.damaged) and resumes from the newest intact step; 'stop' names it and the intact step, and stops.
  c.checkpoint.on_corrupt = "fallback"
  # A rerun in a workdir that holds checkpoints resumes them only if it is the same run (model, data sources,
  # objective, rollout policy, seeds: workdir/fingerprint.json); 'check' refuses another run naming the differences,
  # 'force' resumes the checkpoints with this config anyway (and records its fingerprint).
  c.checkpoint.resume = "check"
  # A multi-host run needs a workdir every host sees (gs://...). A local path is refused unless it is shared
  # storage mounted at the same path on every host (NFS, Filestore, or several processes on one machine).
  c.checkpoint.shared_workdir = False

  c.metrics = ml_collections.ConfigDict(dict(jsonl=True, tensorboard=True, histograms=True, progress=True))
  c.lock()
  c.model.overrides.unlock()  # the one open dict: ModelConfig fields, checked in validate()
  return c


# ---------------------------------------------------------------------------------------------------------
# Validation.


class ConfigError(ValueError):
  """A config value that cannot run; the message names the key and the fix."""


def _flatten(c, prefix=""):
  out = {}
  for k, v in c.items():
    key = f"{prefix}{k}"
    if isinstance(v, (ml_collections.ConfigDict, dict)) and key != "model.overrides":
      out.update(_flatten(v, key + "."))
    else:
      out[key] = v
  return out


_SEE_BASE = "; see aepo_jax/train/_config.py:base_config()"


def _edit_distance(a: str, b: str) -> int:
  """Optimal string alignment distance: insertions, deletions, substitutions and swaps of neighbours each cost 1
  (a typed 'apeo' is one swap from 'aepo', two edits from 'arpo')."""
  d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
  for i in range(1, len(a) + 1):
    for j in range(1, len(b) + 1):
      d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
      if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
        d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
  return d[len(a)][len(b)]


def did_you_mean(name, choices, *, prefix: str = "", otherwise: str = "") -> str:
  """The hint `; did you mean 'x'?` for the choice x closest to `name` ('prefix.x' with a prefix), or `otherwise`
  when none is close: the one ending of every unknown-name error (config, preflight, CLI). Close: within difflib's
  0.6 similarity or two edits (a swap of neighbours is one edit); the fewest edits win, then difflib's ratio."""
  name, choices = str(name), [str(c) for c in choices]
  close = set(difflib.get_close_matches(name, choices, n=len(choices) or 1))
  close |= {c for c in choices if _edit_distance(name.lower(), c.lower()) <= min(2, max(1, len(name) // 3))}
  if not close:
    return otherwise
  best = min(
    close, key=lambda c: (_edit_distance(name.lower(), c.lower()), -difflib.SequenceMatcher(None, name, c).ratio())
  )
  return f"; did you mean {f'{prefix}.{best}' if prefix else best!r}?"


def _unknown_keys(config) -> list[str]:
  known = set(_flatten(base_config()))
  errors = []
  for key in _flatten(config):
    if key not in known:
      errors.append(f"config key {key!r} does not exist" + did_you_mean(key, known, otherwise=_SEE_BASE))
  return errors


def _model_override_errors(config) -> list[str]:
  from aepo_jax.model import ModelConfig  # no jax device is touched by importing the dataclass

  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  errs = []
  for k in config.model.overrides.keys():
    if k not in fields:
      errs.append(f"model.overrides.{k} is not a ModelConfig field" + did_you_mean(k, fields))
  return errs


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


def _choices(config) -> list:
  """(key, value, known names) for every key whose choices a registry or a part's own table holds."""
  from aepo_jax import objectives, tools
  from aepo_jax.rollout import policies
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
    config.model.init in ("pretrained", "random"), f"model.init={config.model.init!r}: use 'pretrained' or 'random'."
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
  need(
    a.off_policy_cap == 0 or (a.off_policy_cap >= 1 if a.off_policy == "tis" else a.off_policy_cap > 1),
    f"algo.off_policy_cap={a.off_policy_cap}: a cap on pi_old/pi_sampler must be "
    f"{'>= 1' if a.off_policy == 'tis' else '> 1'}, or 0 for the method's default.",
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


# ---------------------------------------------------------------------------------------------------------
# Loading.


def load_config(path: str, arg: Optional[str] = None, overrides: Optional[dict] = None, **validate_kw):
  """Load `configs/x.py` (its `get_config(arg)`), apply {'rollout.n': 8, ...} overrides, validate."""
  if not os.path.exists(path):
    raise ConfigError(f"config file {path!r} does not exist; see configs/ for the available experiments.")
  module = _import_file(path)
  config = module.get_config(arg) if arg is not None else module.get_config()
  for key, value in (overrides or {}).items():
    set_key(config, key, value)
  return validate(config, **validate_kw)


def _import_file(path: str):
  spec = importlib.util.spec_from_file_location(f"configs_{os.path.splitext(os.path.basename(path))[0]}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_sibling(config_file: str, name: str):
  """The module configs/<name>.py beside `config_file` (an experiment's `__file__`), imported by path: configs/ is a
  folder of files, not a package. `common = load_sibling(__file__, "common")` is how experiments share settings."""
  path = os.path.join(os.path.dirname(os.path.abspath(config_file)), f"{name}.py")
  if not os.path.exists(path):
    raise ConfigError(f"{config_file}: load_sibling({name!r}) found no {path}.")
  return _import_file(path)


def set_key(config, dotted: str, value):
  """config['a.b.c'] = value with a did-you-mean on a wrong key."""
  *parents, leaf = dotted.split(".")
  node = config
  for i, p in enumerate(parents):
    if p not in node:
      raise ConfigError(
        f"config key {'.'.join(parents[: i + 1])!r} does not exist" + _did_you_mean_key(p, node, ".".join(parents[:i]))
      )
    node = node[p]
  if leaf not in node and node is not config.get("model", {}).get("overrides"):
    raise ConfigError(f"config key {dotted!r} does not exist" + _did_you_mean_key(leaf, node, ".".join(parents)))
  with node.ignore_type():
    node[leaf] = value


def _did_you_mean_key(key, node, prefix=""):
  return did_you_mean(key, node.keys(), prefix=prefix, otherwise=f"; known keys here: {', '.join(node.keys())}")


def split_model_overrides(argv: list) -> tuple[list, dict]:
  """(argv without them, {field: value}) for `--config.model.overrides.FIELD=VALUE` flags: the overrides dict
  starts empty in most configs, and absl's config flags cannot add keys to it. Values are Python literals
  (`2`, `1e6`, `'bfloat16'`, `(2,)`) or else strings."""
  import ast

  rest, found = [], {}
  prefix = "--config.model.overrides."
  for arg in argv:
    if arg.startswith(prefix) and "=" in arg:
      key, value = arg[len(prefix) :].split("=", 1)
      try:
        found[key] = ast.literal_eval(value)
      except (ValueError, SyntaxError):
        found[key] = value
    else:
      rest.append(arg)
  return rest, found


def apply_model_overrides(config, overrides: dict):
  if overrides:
    with config.unlocked(), config.model.overrides.ignore_type():
      config.model.overrides.update(overrides)
  return config


def to_json(config) -> str:
  return json.dumps(config.to_dict(), sort_keys=True, default=str)


def from_json(text: str) -> ml_collections.ConfigDict:
  """A config saved with a checkpoint, merged onto the base (so old checkpoints gain new defaults)."""
  saved = json.loads(text)
  config = base_config()
  config.unlock()
  config.update_from_flattened_dict(
    {k: v for k, v in _flatten(ml_collections.ConfigDict(saved)).items() if k in _flatten(config)}
  )
  with config.model.overrides.unlocked():
    for k, v in saved.get("model", {}).get("overrides", {}).items():
      config.model.overrides[k] = tuple(v) if isinstance(v, list) else v  # ModelConfig must stay hashable
  config.lock()
  return config
