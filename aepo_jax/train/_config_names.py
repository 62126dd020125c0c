"""The config's key names: `flatten` (a config as {'a.b.c': value}), the did-you-mean hint that ends every
unknown-name error (config, preflight, CLI), and the unknown-key checks against `base_config()`. Re-exported by
`_config.py`."""

from __future__ import annotations

import difflib
from typing import Optional

import ml_collections

from aepo_jax.train._defaults import base_config


def flatten(c, prefix="") -> dict:
  """{'a.b.c': value} of a config (`model.overrides` stays one dict-valued key)."""
  out = {}
  for k, v in c.items():
    key = f"{prefix}{k}"
    if isinstance(v, (ml_collections.ConfigDict, dict)) and key != "model.overrides":
      out.update(flatten(v, key + "."))
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


def _base_keys() -> set:
  return set(flatten(base_config()))


def unknown_key_hint(key: str) -> Optional[str]:
  """None when `key` ('rollout.n') is a key of base_config(); else the ending of its error: `; did you mean 'x'?`,
  or where the keys are listed."""
  known = _base_keys()
  return None if key in known else did_you_mean(key, known, otherwise=_SEE_BASE)


def _unknown_keys(config) -> list[str]:
  known = _base_keys()
  errors = []
  for key in flatten(config):
    if key not in known:
      errors.append(f"config key {key!r} does not exist" + did_you_mean(key, known, otherwise=_SEE_BASE))
  return errors
