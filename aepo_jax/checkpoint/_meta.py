"""What a checkpoint's `meta` holds besides arrays: data-iterator state, the ModelConfig, JSON-safe values, and the
comparison of a checkpoint's model section with the current config."""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

import jax
import numpy as np


def tree_bytes(tree) -> int:
  return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def encode_iterator_state(state) -> Any:
  """Grain iterator state as JSON: MapDataset iterators give dicts, DataLoader iterators give bytes."""
  if isinstance(state, bytes):
    return {"__bytes__": base64.b64encode(state).decode("ascii")}
  return state


def decode_iterator_state(state) -> Any:
  if isinstance(state, dict) and set(state) == {"__bytes__"}:
    return base64.b64decode(state["__bytes__"])
  return state


def model_config_to_json(model_cfg) -> dict:
  return dataclasses.asdict(model_cfg)


def model_config_from_json(d: dict):
  """The ModelConfig saved in a checkpoint's meta (lists back to the tuples the frozen dataclass hashes)."""
  from aepo_jax.model import ModelConfig

  d = dict(d)
  d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
  if d.get("rope_scaling"):
    d["rope_scaling"] = tuple(tuple(kv) for kv in d["rope_scaling"])
  return ModelConfig(**d)


_SHAPE_NEUTRAL = (  # model fields that do not change parameter shapes: a resume across them is allowed
  "model.dtype",
  "model.remat",
  "model.tokenizer",
  "model.init",
  "model.overrides.attention_impl",
  "model.overrides.splash_block_q",
  "model.overrides.splash_block_kv",
  "model.overrides.scan_unroll",
)


def _flat_model(config) -> dict:
  """{'model.<field>': value, 'model.overrides.<field>': value} of a config (a ConfigDict, or the dict its JSON
  reads back as)."""
  model = config["model"]
  model = dict(model.to_dict() if hasattr(model, "to_dict") else model)
  overrides = dict(model.pop("overrides", None) or {})
  out = {}

  def walk(node, prefix):
    for k, v in node.items():
      if isinstance(v, dict):
        walk(v, f"{prefix}{k}.")
      else:
        out[f"{prefix}{k}"] = v

  walk(model, "model.")
  out.update({f"model.overrides.{k}": v for k, v in overrides.items()})
  for k in _SHAPE_NEUTRAL:
    out.pop(k, None)
  return out


def model_mismatch(saved_config, config) -> list[str]:
  """`model.*` fields that differ between a checkpoint's config and the current one (dtype changes are allowed).

  `saved_config`: a ConfigDict or the dict of its JSON. A `model.*` field one side lacks (a config written before
  the field existed) is not compared; `model.overrides.*` are compared whichever side sets them."""
  canon = lambda d: {k: json.loads(json.dumps(v, default=str)) for k, v in d.items()}  # tuples == lists
  a, b = canon(_flat_model(saved_config)), canon(_flat_model(config))
  keys = {k for k in set(a) | set(b) if k.startswith("model.overrides.") or (k in a and k in b)}
  return [
    f"{k}: checkpoint={a.get(k, '<unset>')!r} current={b.get(k, '<unset>')!r}"
    for k in sorted(keys)
    if a.get(k) != b.get(k)
  ]


def _no_numpy_scalar(x):
  if isinstance(x, np.generic):
    return np.asarray(x)
  return x


def _abstract(x):
  sharding = getattr(x, "sharding", None)
  if sharding is None:  # host arrays / plain shapes: restore onto the first local device
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def _json_default(x):
  if isinstance(x, (np.generic, np.ndarray)):
    return x.tolist()
  if isinstance(x, jax.Array):
    return np.asarray(x).tolist()
  if isinstance(x, bytes):
    return encode_iterator_state(x)
  return str(x)
