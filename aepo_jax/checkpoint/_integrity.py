"""What a checkpoint held when it was saved, recorded then and checked at every restore.

Two records, each catching what the other cannot:
  array checksums  in the checkpoint's `meta` item, so committed together with the arrays: for every array of the
                   state, two 32-bit sums of a hash of (value bits, flat position) and its count of non-finite
                   values. Computed where the state lives (a sharded reduction, no extra I/O) and recomputed after
                   a restore: a changed value is found whatever the storage format or sharding, and named by its
                   array path.
  file manifest    `integrity.json` in the step directory: size and sha256 (local) or the object's crc32c (gs://,
                   from the listing, nothing downloaded) of every file of the `state` and `meta` items. Checked
                   before any array is read, so a missing, truncated or altered file is named before tensorstore
                   meets it.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax import lax

MANIFEST = "integrity.json"
ITEMS = ("state", "meta")  # the Checkpointer's items; orbax's own top-level files change after the commit

# ---------------------------------------------------------------------------------------------------------
# Array checksums.
# ---------------------------------------------------------------------------------------------------------
_U = jnp.uint32


def _fmix32(h):
  """MurmurHash3's finalizer: a bijection of uint32 that spreads every input bit over the output."""
  h = (h ^ (h >> 16)) * _U(0x85EBCA6B)
  h = (h ^ (h >> 13)) * _U(0xC2B2AE35)
  return h ^ (h >> 16)


def _supported(dtype) -> bool:
  return dtype == np.bool_ or (jnp.issubdtype(dtype, jnp.number) and not jnp.issubdtype(dtype, jnp.complexfloating))


def _leaf_summary(x):
  """uint32[3]: two sums of a per-element hash and the number of non-finite values.

  The element hash is a bijection of the value bits at a fixed position, so a single changed element always
  changes the first sum; the position enters the hash, so moved blocks are found too. Sums wrap mod 2**32, which
  makes them independent of sharding and reduction order.
  """
  size = np.dtype(x.dtype).itemsize
  if x.dtype == np.bool_:
    w = x.astype(_U)
  elif size == 4 or size == 8:  # 8 bytes: two words in a trailing axis
    w = lax.bitcast_convert_type(x, _U)
  else:
    w = lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(_U)
  pos, stride = jnp.zeros(w.shape, _U), 1
  for axis in range(w.ndim - 1, -1, -1):
    pos = pos + lax.broadcasted_iota(_U, w.shape, axis) * _U(stride % 2**32)
    stride *= w.shape[axis]
  e = _fmix32(w * _U(0xCC9E2D51) + pos * _U(0x9E3779B9))
  nonfinite = jnp.sum(~jnp.isfinite(x), dtype=_U) if jnp.issubdtype(x.dtype, jnp.inexact) else _U(0)
  return jnp.stack([jnp.sum(e, dtype=_U), jnp.sum(_fmix32(e ^ _U(0x5BD1E995)), dtype=_U), nonfinite])


_group_summaries = jax.jit(lambda xs: jnp.stack([_leaf_summary(x) for x in xs]))


def _to_host(x) -> np.ndarray:
  if x.is_fully_addressable:
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def array_checksums(tree) -> dict:
  """{array path: {shape, dtype, sum, nonfinite}} for every leaf of `tree` (jax or numpy arrays).

  Leaves are summarised in one jitted call per placement (committed arrays on different device sets cannot
  share a computation); every process of a multi-host run must call this with the same tree.
  """
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  leaves = [x if isinstance(x, jax.Array) else np.asarray(x) for _, x in flat]
  groups: dict = {}
  for i, x in enumerate(leaves):
    if _supported(x.dtype):
      placement = frozenset(x.sharding.device_set) if isinstance(x, jax.Array) and x.committed else None
      groups.setdefault(placement, []).append(i)
  sums: list = [None] * len(leaves)
  for index in groups.values():
    for i, row in zip(index, _to_host(_group_summaries([leaves[i] for i in index]))):
      sums[i] = row
  out = {}
  for (path, _), x, s in zip(flat, leaves, sums):
    out[jax.tree_util.keystr(path)] = {
      "shape": list(x.shape),
      "dtype": str(x.dtype),
      "sum": None if s is None else f"{int(s[0]):08x}{int(s[1]):08x}",
      "nonfinite": 0 if s is None else int(s[2]),
    }
  return out


def structure_problems(recorded: dict, abstract_tree, *, partial: bool = False) -> list[str]:
  """How the arrays recorded at save differ from the ones `abstract_tree` asks for (paths and shapes)."""
  want = {jax.tree_util.keystr(p): list(np.shape(x)) for p, x in jax.tree_util.tree_flatten_with_path(abstract_tree)[0]}
  out = []
  for k, shape in want.items():
    if k not in recorded:
      out.append(f"{k}: not in the checkpoint")
    elif recorded[k]["shape"] != shape:
      out.append(f"{k}: shape {recorded[k]['shape']} in the checkpoint, {shape} now")
  if not partial:
    out += [f"{k}: in the checkpoint, not in the current state" for k in recorded if k not in want]
  return out


def value_problems(recorded: Optional[dict], tree) -> list[str]:
  """Arrays of a restored `tree` that differ from their checksums at save, or hold NaN/inf (always a problem:
  a resumed run would skip every update). `recorded` None (a checkpoint without checksums): finiteness only."""
  out = []
  for k, got in array_checksums(tree).items():
    rec = (recorded or {}).get(k)
    if got["nonfinite"]:
      when = " (already at save)" if rec and rec["nonfinite"] else ""
      out.append(f"{k}: {got['nonfinite']} non-finite values{when}")
    comparable = rec and rec["sum"] and got["sum"] and rec["dtype"] == got["dtype"] and rec["shape"] == got["shape"]
    if comparable and rec["sum"] != got["sum"]:
      out.append(f"{k}: checksum {got['sum']}, {rec['sum']} at save (values changed in storage)")
  return out


# ---------------------------------------------------------------------------------------------------------
# File manifest.
# ---------------------------------------------------------------------------------------------------------
def _is_remote(path) -> bool:
  return str(path).startswith("gs://")


def _fs(path: str):
  from etils.epath import backend  # the fsspec instance epath (hence orbax) uses

  return backend.fsspec_backend.fs(path)


def _listing(step_dir: str) -> dict:
  """{path relative to step_dir: {size[, crc32c]}} of the files of the checkpoint items."""
  step_dir = str(step_dir).rstrip("/")
  out = {}
  if _is_remote(step_dir):
    fs = _fs(step_dir)
    fs.invalidate_cache()
    root = step_dir[len("gs://") :]
    for item in ITEMS:
      for name, info in fs.find(f"{step_dir}/{item}", detail=True).items():
        if info.get("type", "file") == "file":
          rec = {"size": int(info["size"])}
          if info.get("crc32c"):
            rec["crc32c"] = info["crc32c"]
          out[name[len(root) + 1 :]] = rec
    return out
  for item in ITEMS:
    for dirpath, _, names in os.walk(os.path.join(step_dir, item)):
      for n in names:
        full = os.path.join(dirpath, n)
        out[os.path.relpath(full, step_dir)] = {"size": os.path.getsize(full)}
  return out


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(8 << 20):
      h.update(chunk)
  return h.hexdigest()


def write_manifest(step_dir: str) -> None:
  """Record every item file of `step_dir` (before the commit: the manifest is then part of the checkpoint)."""
  files = _listing(step_dir)
  if not _is_remote(step_dir):
    for rel, rec in files.items():
      rec["sha256"] = _sha256(os.path.join(step_dir, rel))
  text = json.dumps({"version": 1, "files": files}, indent=0, sort_keys=True)
  path = epath.Path(step_dir) / MANIFEST
  if _is_remote(step_dir):
    path.write_text(text)  # one object upload: all or nothing
  else:
    tmp = path.with_name(f"{MANIFEST}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def file_problems(step_dir: str) -> list[str]:
  """Files of `step_dir` that are missing, of another size, or with other bytes than its manifest records.
  Without a manifest (older checkpoints, a sync save killed right after its commit) only the items' presence
  is checked."""
  step_dir = str(step_dir).rstrip("/")
  path = epath.Path(step_dir) / MANIFEST
  current = _listing(step_dir)
  absent = [item for item in ITEMS if not any(k.startswith(item + "/") for k in current)]
  out = [f"{item}/ is missing" for item in absent]
  if not path.exists():
    return out
  try:
    recorded = json.loads(path.read_text())["files"]
  except (ValueError, KeyError, TypeError) as e:
    return out + [f"{MANIFEST} is unreadable ({e})"]
  for rel, rec in sorted(recorded.items()):
    got = current.get(rel)
    if rel.split("/", 1)[0] in absent:
      continue
    if got is None:
      out.append(f"{rel} is missing")
    elif got["size"] != rec["size"]:
      how = "truncated" if got["size"] < rec["size"] else "grown"
      out.append(f"{rel} has {got['size']} bytes, {rec['size']} at save ({how})")
    elif rec.get("crc32c") and got.get("crc32c") and rec["crc32c"] != got["crc32c"]:
      out.append(f"{rel} has crc32c {got['crc32c']}, {rec['crc32c']} at save (the object was replaced)")
    elif rec.get("sha256") and _sha256(os.path.join(step_dir, rel)) != rec["sha256"]:
      out.append(f"{rel} differs from the sha256 recorded at save (its bytes changed)")
  return out
