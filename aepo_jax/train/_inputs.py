"""The run's inputs: the model and tokenizer (`load_model`), SFT examples, the RL prompts of this host
(`prompt_loader`, `host_share`), and the generated suite, which lives as long as the run (`run_scope`)."""

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


def load_model(config, mesh=None):
  """(ModelConfig, params, tokenizer or None) as `config.model` says, the parameters straight on `mesh`.

  init='random': the preset `model.name` with `model.overrides` (tokenizer only if `model.tokenizer`), drawn by one
  jitted program into its shardings. init='pretrained': a named checkpoint (`aepo_jax.model.load_pretrained`), a
  local HF directory, or a gs:// HF directory (its safetensors shards read in place by ranged reads, never copied to
  local disk; only its small tokenizer files go through a local temporary directory, removed after loading). HF and
  named checkpoints are read tensor by tensor into each host's own shards (`model.load_hf(mesh=)`): no parameter is
  ever whole on one device, and no host copy outlives the load.
  init='checkpoint': the parameters of another run's Orbax checkpoint at `model.name` (a step directory, a phase
  directory or a training workdir, local or gs://; e.g. RL from an SFT run), read into their shardings; its
  model config and tokenizer are the ones that run saved (`model.tokenizer` overrides the tokenizer).
  """
  from aepo_jax import model as model_lib

  from aepo_jax.train import _config

  rules = _config.mesh_rules(config)  # expert parallelism (mesh.expert_axis) places the experts as they load
  mc = config.model
  overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in mc.overrides.items()}  # a config read from JSON
  kw = dict(dtype=mc.dtype, param_dtype=mc.param_dtype, remat=mc.remat, **overrides)
  tokenizer = None
  if mc.init == "random":
    cfg = model_lib.preset(mc.name, **kw)
    key = jax.random.PRNGKey(config.train.seed)
    if mesh is None:
      params = model_lib.init_params(cfg, key)
    else:
      params = jax.jit(
        lambda k: model_lib.init_params(cfg, k), out_shardings=model_lib.param_shardings(cfg, mesh, rules)
      )(key)
  elif mc.init == "checkpoint":
    from aepo_jax import checkpoint

    ref = checkpoint.resolve_checkpoint(str(mc.name))
    if ref.kind != "orbax":
      raise checkpoint.CheckpointNotFoundError(
        f"model.name={mc.name!r} is a {ref.kind} model, not an Orbax checkpoint of a training run; load it "
        "with model.init='pretrained'."
      )
    policy = checkpoint.load_policy(ref, tokenizer=mc.tokenizer or None, dtype=mc.param_dtype, mesh=mesh, rules=rules)
    log.info("model: %s", policy.source)
    return policy.config.replace(**kw), policy.params, policy.tokenizer
  elif str(mc.name).startswith("gs://") or os.path.isdir(mc.name):
    cfg, params = model_lib.load_hf(mc.name, dtype=mc.param_dtype, mesh=mesh, rules=rules)  # a gs:// directory in place
    if not mc.tokenizer:
      with _local_files(mc.name) as path:
        tokenizer = _tokenizer(path)
    cfg = cfg.replace(**kw)
  else:
    cfg, params = model_lib.load_pretrained(mc.name, dtype=mc.param_dtype, mesh=mesh, rules=rules)
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
  """`path` itself, or for gs:// a local temporary copy of the directory's files other than weights (the tokenizer
  and config files; streamed in 64 MiB pieces, never whole in memory), removed on exit."""
  if not str(path).startswith("gs://"):
    yield path
    return
  from etils import epath

  from aepo_jax import model as model_lib

  local = tempfile.mkdtemp(prefix="aepo_jax_model_")
  try:
    for f in epath.Path(path).iterdir():
      if f.is_file() and not f.name.endswith(model_lib.WEIGHT_SUFFIXES):
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
    return trace_examples(s.source, tokenizer, eos, max_len=s.max_len, mask_results=s.mask_results)
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


def trace_examples(path: str, tokenizer, eos: int, *, max_len: int, mask_results: bool = True) -> list:
  """(tokens, loss_mask) per assistant turn of every trace in `path` (`data.read_traces`): the conversation before
  the turn rendered by the chat template with the generation prompt (no loss; earlier assistant turns as the
  template writes them), then the turn's own text (loss) with its tool results (no loss; mask_results=False: only
  the observation turns folded into it), then EOS (loss). Each example is cut at max_len (LLaMA-Factory's
  cutoff_len); one with no loss token left is dropped and counted."""
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
        (tokenizer.encode_continuation(text), trained)
        for text, trained in data_lib.trace_segments(
          turn["content"], mask_results=mask_results, observed=turn.get(data_lib.TRACE_OBSERVED, ())
        )
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
