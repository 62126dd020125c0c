"""The policy to evaluate, from any of: a named pretrained model, an HF directory, or an Orbax training checkpoint
(local or gs://). The Orbax path reads only the `params` of the `state` item (never the optimizer state) with
the `Checkpointer`, and the ModelConfig and tokenizer from the checkpoint's `meta`.

  resolve_checkpoint(path) -> CheckpointRef     cheap: existence and kind, no arrays read (runs before compute)
  load_policy(path_or_ref, tokenizer=None) -> Policy(config, params, tokenizer, source)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from typing import Any, Optional

from aepo_jax.checkpoint._checkpointer import Checkpointer
from aepo_jax.checkpoint._meta import model_config_from_json
from aepo_jax.checkpoint._storage import CheckpointCorruptError, CheckpointError, check_remote


class CheckpointNotFoundError(FileNotFoundError):
  """The --checkpoint path does not exist or holds nothing we can load."""


class CheckpointDamagedError(CheckpointNotFoundError):
  """The checkpoint's files or parameters differ from what was saved, or cannot be read."""


@dataclasses.dataclass(frozen=True)
class CheckpointRef:
  """kind: 'pretrained' | 'hf' | 'orbax'. For orbax: `directory` (the phase dir) and `step`."""

  path: str
  kind: str
  directory: str = ""
  step: Optional[int] = None


@dataclasses.dataclass
class Policy:
  config: Any  # aepo_jax.model.ModelConfig
  params: Any
  tokenizer: Any  # aepo_jax.model.Tokenizer
  source: str  # description for the report


def _epath(path: str):
  from etils import epath

  return epath.Path(path)


def _is_step_dir(p) -> bool:
  return p.name.isdigit() and p.is_dir()


def _has_steps(p) -> bool:
  return p.is_dir() and any(c.name.isdigit() and c.is_dir() for c in p.iterdir())


def resolve_checkpoint(path: str) -> CheckpointRef:
  """What `path` is, checked without reading weights. Raises CheckpointNotFoundError with the fix."""
  from aepo_jax.model import PRETRAINED

  if path in PRETRAINED:
    return CheckpointRef(path, "pretrained")
  if str(path).startswith("gs://"):  # fail in seconds, not after gcsfs's minute of retries
    try:
      check_remote(path)
    except CheckpointError as e:
      raise CheckpointNotFoundError(f"--checkpoint {e}") from None
  p = _epath(path)
  if not p.exists():
    raise CheckpointNotFoundError(
      f"--checkpoint {path!r} does not exist. Give an Orbax checkpoint (a step dir like .../checkpoints/rl/6, "
      f"a phase dir .../checkpoints/rl, or a training workdir), an HF directory with config.json, or a "
      f"pretrained name ({', '.join(sorted(PRETRAINED))})."
    )
  # A training workdir also holds a config.json (the experiment's); its checkpoints/ dir decides.
  if (p / "config.json").exists() and not (p / "checkpoints").exists():
    return CheckpointRef(path, "hf")
  if _is_step_dir(p):
    return CheckpointRef(path, "orbax", str(p.parent), int(p.name))
  for cand in (p, p / "checkpoints" / "rl", p / "checkpoints" / "sft"):
    if cand.exists() and _has_steps(cand):
      return CheckpointRef(path, "orbax", str(cand), None)
  raise CheckpointNotFoundError(
    f"--checkpoint {path!r} exists but holds neither config.json (HF) nor numbered Orbax step directories "
    "(nor checkpoints/rl or checkpoints/sft below it)."
  )


@contextlib.contextmanager
def _local_dir(path: str):
  """A gs:// directory's files other than weights (tokenizer, config) copied (flat, file by file) to a temporary
  local directory that is removed on exit; a local path as it is. The weights are read in place (`load_hf`)."""
  if not str(path).startswith("gs://"):
    yield str(path)
    return
  from aepo_jax import model as model_lib

  with tempfile.TemporaryDirectory(prefix="aepo_eval_") as local:
    for f in _epath(path).iterdir():
      if f.is_file() and not f.name.endswith(model_lib.WEIGHT_SUFFIXES):
        with f.open("rb") as src, open(os.path.join(local, f.name), "wb") as dst:
          shutil.copyfileobj(src, dst, 1 << 20)
    yield local


def load_tokenizer(path_or_name: str):
  """Tokenizer of a pretrained name or an HF directory (local or gs://)."""
  from aepo_jax.model import PRETRAINED, Tokenizer, pretrained_dir

  if path_or_name in PRETRAINED:
    return Tokenizer.from_dir(pretrained_dir(path_or_name))
  with _local_dir(path_or_name) as local:
    return Tokenizer.from_dir(local)


def _orbax_tokenizer_source(meta: dict) -> Optional[str]:
  """model.tokenizer, else model.name (a pretrained name or HF dir) of the training config saved in meta."""
  import json

  cfg = meta.get("config")
  if isinstance(cfg, str):
    cfg = json.loads(cfg)
  model = (cfg or {}).get("model", {})
  for key in ("tokenizer", "name"):
    value = model.get(key)
    if value:
      return value
  return None


def training_config(ref: CheckpointRef | str) -> Optional[dict]:
  """The training config a run saved with its checkpoint (as a dict), or None for a pretrained name, an HF
  directory or a checkpoint without one. Reads the newest committed step's metadata only (no arrays), read-only."""
  import json

  ref = resolve_checkpoint(ref) if isinstance(ref, str) else ref
  if ref.kind != "orbax":
    return None
  ckpt = Checkpointer(ref.directory, read_only=True)
  try:
    step = ckpt.latest_step() if ref.step is None else ref.step
    cfg = ckpt.restore_meta(step).get("config") if step is not None else None
  except Exception:  # noqa: BLE001 - no saved config is no default; load_policy reports a damaged checkpoint
    cfg = None
  finally:
    ckpt.close()
  return json.loads(cfg) if isinstance(cfg, str) else cfg


def load_policy(
  ref: CheckpointRef | str, tokenizer: Optional[str] = None, dtype: str = "float32", mesh=None, rules=None
) -> Policy:
  """(config, params, tokenizer) of a checkpoint; `tokenizer` (name or dir) overrides the checkpoint's own.

  mesh: the parameters are read straight into their shardings on it (each host reads its own shards; a training
  run that starts from another run's checkpoint, `model.init='checkpoint'`), through `rules` (default
  `parallel.DEFAULT_RULES`); None: host arrays."""
  import jax

  from aepo_jax import model as model_lib

  ref = resolve_checkpoint(ref) if isinstance(ref, str) else ref
  if ref.kind == "pretrained":
    cfg, params = model_lib.load_pretrained(ref.path, dtype=dtype, mesh=mesh, rules=rules)
    tok = load_tokenizer(tokenizer or ref.path)
    return Policy(cfg, params, tok, f"pretrained {ref.path}")
  if ref.kind == "hf":
    cfg, params = model_lib.load_hf(ref.path, dtype=dtype, mesh=mesh, rules=rules)  # gs:// in place
    with _local_dir(ref.path) as local:
      try:
        tok = load_tokenizer(tokenizer) if tokenizer else model_lib.Tokenizer.from_dir(local)
      except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"{e} Or pass --tokenizer=DIR_OR_NAME.") from e
    return Policy(cfg, params, tok, f"hf {ref.path}")
  ckpt = Checkpointer(ref.directory, read_only=True)  # never cleans a writer's save
  try:
    step = ckpt.latest_step() if ref.step is None else ref.step
    if step is None:
      raise CheckpointNotFoundError(f"no committed checkpoint in {ref.directory!r} (an interrupted save?).")
    meta = ckpt.restore_meta(step)
    if "model_config" not in meta:
      raise CheckpointNotFoundError(
        f"checkpoint {ref.directory}/{step} holds no model_config in its meta; was it written by aepo_jax.train?"
      )
    cfg = model_config_from_json(meta["model_config"])
    if dtype:
      cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    shapes = model_lib.param_shapes(cfg)
    if mesh is None:
      params = jax.device_get(ckpt.restore_params(step, shapes))
      if dtype:  # a checkpoint saved in bfloat16 evaluates in the requested compute dtype
        params = jax.tree.map(lambda x: x.astype(dtype), params)
    else:
      shardings = model_lib.param_shardings(cfg, mesh, rules)
      abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
      params = ckpt.restore_params(step, abstract)
  except CheckpointCorruptError as e:
    others = [s for s in ckpt.all_steps() if s != e.step]
    hint = (
      f"evaluate another step (--checkpoint={ref.directory}/<step>, committed: {', '.join(map(str, others))}) "
      "or restore the named files."
      if others
      else "restore the named files."
    )
    raise CheckpointDamagedError(f"{e} It cannot be evaluated; {hint}") from None
  finally:
    ckpt.close()
  source = tokenizer or _orbax_tokenizer_source(meta)
  if not source:
    raise CheckpointNotFoundError(
      f"checkpoint {ref.directory}/{step} names no tokenizer (config.model.tokenizer "
      "or model.name); pass --tokenizer=DIR_OR_NAME."
    )
  try:
    tok = load_tokenizer(source)
  except (FileNotFoundError, ValueError) as e:
    raise CheckpointNotFoundError(
      f"tokenizer {source!r} of checkpoint {ref.directory}/{step} cannot be loaded ({e}); pass --tokenizer=DIR_OR_NAME."
    ) from e
  return Policy(cfg, params, tok, f"orbax {ref.directory} step {step}")
