"""What defines a run, recorded in its workdir, so that a rerun resumes only its own checkpoints.

`workdir/fingerprint.json` holds the config keys that make a run this run (model, data sources, objective,
rollout policy, seeds); sizes, schedules, logging, evaluation and performance settings are left out, so a finished
run rerun with more steps, or with another batch split, continues. A rerun whose fingerprint differs from the
recorded one is refused while the workdir holds checkpoints (`check_resume`), naming the differing keys and the
ways on: a new --config.workdir, or --config.checkpoint.resume=force.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

from etils import epath

from aepo_jax.train import _config

log = logging.getLogger("aepo_jax.train")

FILE = "fingerprint.json"
# Prefixes of the keys that define a run (a key is kept if it equals one or starts with one followed by ".").
_KEYS = (
  "model.name",
  "model.init",
  "model.shape",
  "model.overrides",
  "data.train",
  "data.family",
  "data.template",
  "data.fields",
  "data.suite",
  "data.seed",
  "data.shuffle",
  "sft.enabled",
  "sft.source",
  "sft.seed",
  "algo",
  "rollout.policy",
  "reward.name",
  "train.seed",
)
# Inside those: settings that change speed or memory, not the run.
_PERFORMANCE = ("attention_impl", "splash_block_q", "splash_block_kv", "scan_unroll")


class RunMismatchError(_config.ConfigError):
  """A rerun in a workdir whose checkpoints belong to another run."""


def fingerprint(config) -> dict:
  flat = _config.flatten(config)
  out = {}
  for key, value in flat.items():
    if not any(key == p or key.startswith(p + ".") for p in _KEYS):
      continue
    if key == "model.overrides":
      for k, v in sorted(dict(value).items()):
        if k not in _PERFORMANCE:
          out[f"model.overrides.{k}"] = v
      continue
    out[key] = value
  return json.loads(json.dumps(out, default=str))  # tuples -> lists, as read back


def _has_checkpoints(workdir: str) -> Optional[str]:
  """The newest committed step of any phase ("rl/3"), or None."""
  found = []
  for phase in ("sft", "rl"):
    d = epath.Path(workdir) / "checkpoints" / phase
    try:
      steps = [int(p.name) for p in d.iterdir() if p.name.isdigit()] if d.exists() else []
    except OSError:
      steps = []
    if steps:
      found.append(f"{phase}/{max(steps)}")
  return found[-1] if found else None


def _recorded(workdir: str) -> Optional[dict]:
  """The fingerprint the workdir's run recorded (fingerprint.json, or that of its config.json: older runs)."""
  base = epath.Path(workdir)
  try:
    if (base / FILE).exists():
      return json.loads((base / FILE).read_text())
    if (base / "config.json").exists():
      return fingerprint(_config.from_json((base / "config.json").read_text()))
  except (OSError, ValueError) as e:
    log.warning("%s: the recorded run cannot be read (%s); not checking what the checkpoints belong to.", workdir, e)
  return None


def differences(recorded: dict, current: dict) -> list[str]:
  return [
    f"{k}: recorded {recorded.get(k, '<unset>')!r}, now {current.get(k, '<unset>')!r}"
    for k in sorted(set(recorded) | set(current))
    if recorded.get(k) != current.get(k)
  ]


def check_resume(config) -> None:
  """Raise RunMismatchError if `config.workdir` holds checkpoints of a run with another fingerprint (unless
  checkpoint.resume='force'). Reads only; `record` writes the fingerprint once the run goes ahead."""
  workdir = str(config.workdir)
  latest = _has_checkpoints(workdir)
  if latest is None:
    return
  recorded = _recorded(workdir)
  if recorded is None:
    return
  diff = differences(recorded, fingerprint(config))
  if not diff:
    return
  if config.checkpoint.resume == "force":
    log.warning(
      "checkpoint.resume=force: resuming the checkpoints in %s (newest %s) with another run's settings:\n  %s",
      workdir,
      latest,
      "\n  ".join(diff),
    )
    return
  raise RunMismatchError(
    f"workdir {workdir!r} holds the checkpoints (newest {latest}) of another run; resuming them would not train "
    "what this command asks for. Differences:\n  "
    + "\n  ".join(diff)
    + "\nUse a new --config.workdir for this run, or --config.checkpoint.resume=force to continue those "
    "checkpoints with these settings."
  )


def record(config) -> None:
  """Write this run's fingerprint (the chief only, after `check_resume`)."""
  (epath.Path(config.workdir) / FILE).write_text(json.dumps(fingerprint(config), indent=1, sort_keys=True))
