"""The experiment config: one base with every key and its default, validation at load, CLI overrides.

Experiment files (`configs/*.py`) start from `base_config()` and override; the base is locked, so a key
that does not exist is an error at the line that sets it. `validate()` runs before any device is claimed
and names the key and the fix for each problem it finds (the defaults are in `_defaults.py`, the checks in
`_config_checks.py`; this module re-exports them).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Optional

import ml_collections

from aepo_jax.train._defaults import base_config
from aepo_jax.train._config_checks import (  # re-exported: the config's names are all in this module
  MODES,
  ConfigError,
  mesh_rules,
  mesh_shape,
  validate,
)
from aepo_jax.train._config_names import did_you_mean, flatten, unknown_key_hint

__all__ = [
  "MODES",
  "ConfigError",
  "apply_model_overrides",
  "base_config",
  "did_you_mean",
  "find_config",
  "flatten",
  "from_json",
  "load_config",
  "load_sibling",
  "mesh_rules",
  "mesh_shape",
  "resolve_config_flag",
  "set_key",
  "split_model_overrides",
  "to_json",
  "unknown_key_hint",
  "validate",
]


def shipped_configs_dir() -> Path:
  """The experiment configs this package ships: `aepo_jax/configs` in an installed package (setup.py maps the
  checkout's configs/ there), else the checkout's configs/ beside aepo_jax/."""
  package = Path(__file__).resolve().parents[1]
  return package / "configs" if (package / "configs").is_dir() else package.parent / "configs"


def find_config(path: str) -> str:
  """`path` ('configs/x.py[:arg]') when that file exists, else the shipped config of that name, so the README's
  `--config=configs/cpu_default.py` also works from any directory with an installed (non-editable) package. Neither:
  a ConfigError naming the closest shipped config."""
  file, sep, arg = path.partition(":")
  if os.path.exists(file):
    return path
  shipped = shipped_configs_dir()
  found = shipped / os.path.normpath(file).removeprefix("configs" + os.sep)
  if not os.path.isabs(file) and found.is_file():
    return f"{found}{sep}{arg}"
  names = sorted(str(p.relative_to(shipped.parent)) for p in shipped.rglob("*.py") if p.name != "common.py")
  raise ConfigError(
    f"config file {file!r} exists neither here nor among the shipped configs ({shipped})"
    + did_you_mean(os.path.normpath(file), names, otherwise=f"; they are {', '.join(names)}")
  )


def resolve_config_flag(argv: list, name: str = "config") -> list:
  """argv with the config file flag (`--config=PATH` or `--config PATH`) resolved by `find_config`; the launchers
  call it before absl parses the flag, which loads the file."""
  out = list(argv)
  for i, a in enumerate(out):
    if a.startswith(f"--{name}="):
      out[i] = f"--{name}=" + find_config(a.split("=", 1)[1])
    elif a == f"--{name}" and i + 1 < len(out):
      out[i + 1] = find_config(out[i + 1])
  return out


def load_config(path: str, arg: Optional[str] = None, overrides: Optional[dict] = None, **validate_kw):
  """Load `configs/x.py` (its `get_config(arg)`; a shipped config by that name when no such file is here, see
  `find_config`), apply {'rollout.n': 8, ...} overrides, validate."""
  path = find_config(path)
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
    {k: v for k, v in flatten(ml_collections.ConfigDict(saved)).items() if k in flatten(config)}
  )
  with config.model.overrides.unlocked():
    for k, v in saved.get("model", {}).get("overrides", {}).items():
      config.model.overrides[k] = tuple(v) if isinstance(v, list) else v  # ModelConfig must stay hashable
  config.lock()
  return config
