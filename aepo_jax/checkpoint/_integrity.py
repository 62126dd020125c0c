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

With several processes the bytes are hashed where they were written: at save each host hashes the files Orbax
wrote for it (`state/ocdbt.process_N/`, `state/array_metadatas/process_N`) into `integrity.p<N>.json` before the
commit barrier, and process 0 merges these into the one manifest, hashing only the rest (metadata, the merged
OCDBT manifest; with ocdbt=False the zarr chunks too, whose writer their names do not tell). At restore each host
hashes its own files and an even share of the rest, and all hosts exchange what they found, so that each stops
with the same error naming the file.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import uuid
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax import lax

from aepo_jax import parallel

MANIFEST = "integrity.json"
PART = "integrity.p{}.json"  # one host's hashes of the files it wrote, merged into MANIFEST before the commit
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
# Orbax names the files each process writes: `state/ocdbt.process_N/...` (its arrays' OCDBT data and manifest) and
# `state/array_metadatas/process_N`. Everything else is written by process 0 for all (metadata, the merged OCDBT
# manifest and its `d/` file, `meta/`) or, with ocdbt=False, is a zarr chunk whose name does not tell its writer.
_WRITTEN_BY = re.compile(r"^[^/]+/(?:ocdbt\.process_(\d+)/|array_metadatas/process_(\d+)$)")


def writer(rel: str) -> Optional[int]:
  """The process that wrote the item file `rel` (a path relative to the step), or None: process 0's, or unknown."""
  m = _WRITTEN_BY.match(rel)
  return None if m is None else int(m.group(1) or m.group(2))


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
  return {rel: {"size": os.path.getsize(full)} for rel, full in _local_files(step_dir).items()}


def _local_files(step_dir: str) -> dict:
  """{path relative to step_dir: full path} of the item files. Before process 0 finalizes a save an item still
  sits in Orbax's `<item>.orbax-checkpoint-tmp*` (renamed, bytes unchanged): its files are named as after."""
  out = {}
  for item in ITEMS:
    top = os.path.join(step_dir, item)
    if not os.path.isdir(top):
      top = ([top] + sorted(glob.glob(glob.escape(top) + ".orbax-checkpoint-tmp*")))[-1]
    for dirpath, _, names in os.walk(top):
      for n in names:
        full = os.path.join(dirpath, n)
        out[f"{item}/{os.path.relpath(full, top)}"] = full
  return out


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(8 << 20):
      h.update(chunk)
  return h.hexdigest()


def _write_json(path: epath.Path, obj) -> None:
  text = json.dumps(obj, indent=0, sort_keys=True)
  if _is_remote(path):
    path.write_text(text)  # one object upload: all or nothing
  else:
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def hash_own_files(step_dir: str, process: int) -> dict:
  """{path: {size, sha256}} of the item files `process` wrote; {} on gs:// (the listing has their crc32c)."""
  if _is_remote(step_dir):
    return {}
  own = {rel: full for rel, full in _local_files(str(step_dir).rstrip("/")).items() if writer(rel) == process}
  return {rel: {"size": os.path.getsize(full), "sha256": _sha256(full)} for rel, full in own.items()}


def write_part(step_dir: str, process: int) -> None:
  """`integrity.p<process>.json`: this host's hashes of its own files, for process 0's `write_manifest`."""
  _write_json(epath.Path(step_dir) / PART.format(process), {"files": hash_own_files(step_dir, process)})


def write_manifest(step_dir: str, parts: Optional[list] = None) -> None:
  """Record every item file of `step_dir` (before the commit: the manifest is then part of the checkpoint).

  Process 0 only. `parts`: other hosts' `hash_own_files`; None reads (then removes) their `write_part` files. A file
  no part covers with its current size is hashed here.
  """
  files = _listing(step_dir)
  part_files = []
  if parts is None:
    part_files = [] if _is_remote(step_dir) else sorted(epath.Path(step_dir).glob(PART.format("*")))
    parts = []
    for p in part_files:
      try:
        parts.append(json.loads(p.read_text())["files"])
      except (OSError, ValueError, KeyError, TypeError):
        pass  # its files are hashed below
  if not _is_remote(step_dir):
    hashed = {rel: rec for part in parts for rel, rec in part.items()}
    full = _local_files(str(step_dir).rstrip("/"))
    for rel, rec in files.items():
      done = hashed.get(rel)
      ok = done and done.get("size") == rec["size"] and done.get("sha256")
      rec["sha256"] = done["sha256"] if ok else _sha256(full[rel])
  _write_json(epath.Path(step_dir) / MANIFEST, {"version": 1, "files": files})
  for p in part_files:
    p.unlink(missing_ok=True)


def _share(recorded: dict, host: int, hosts: int) -> set:
  """The hashed files `host` checks at restore: those it wrote, then its part of the rest (largest first, each to
  the host with the fewest bytes so far). The same split on every host: it depends on the manifest alone."""
  load, mine, rest = [0] * hosts, set(), []
  for rel, rec in recorded.items():
    if not rec.get("sha256"):
      continue
    w = writer(rel)
    if w is None or w >= hosts:  # a checkpoint written by more hosts than read it: their files are shared out
      rest.append(rel)
      continue
    load[w] += rec.get("size", 0)
    if w == host:
      mine.add(rel)
  for rel in sorted(rest, key=lambda r: (-recorded[r].get("size", 0), r)):
    h = min(range(hosts), key=lambda i: (load[i], i))
    load[h] += recorded[rel].get("size", 0)
    if h == host:
      mine.add(rel)
  return mine


def file_problems(step_dir: str, host: Optional[int] = None, hosts: Optional[int] = None) -> list[str]:
  """Files of `step_dir` that are missing, of another size, or with other bytes than its manifest records.
  Without a manifest (older checkpoints, a sync save killed right after its commit) only the items' presence
  is checked.

  Sizes, presence and gs:// crc32c are checked for every file; bytes only for this host's share of the files
  (`host` of `hosts`, default this process of all): `agreed_file_problems` gives every host the union."""
  host = jax.process_index() if host is None else host
  hosts = jax.process_count() if hosts is None else hosts
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
  share = _share(recorded, host, hosts) if hosts > 1 else None
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
    elif rec.get("sha256") and (share is None or rel in share):
      try:
        same = _sha256(os.path.join(step_dir, rel)) == rec["sha256"]
      except OSError as e:
        out.append(f"{rel} cannot be read ({e})")
        continue
      if not same:
        out.append(f"{rel} differs from the sha256 recorded at save (its bytes changed)")
  return out


def merge_problems(per_host: list) -> list[str]:
  """One list from every host's problems: a problem all hosts found as it is, another tagged with its finders."""
  found: dict = {}
  for h, problems in enumerate(per_host):
    for p in problems:
      found.setdefault(p, []).append(h)
  out = []
  for p, hs in found.items():
    if len(hs) < len(per_host):
      p += f" [host {hs[0]}]" if len(hs) == 1 else f" [hosts {', '.join(map(str, hs))}]"
    out.append(p)
  return out


def agreed_file_problems(step_dir: str) -> list[str]:
  """`file_problems` of `step_dir` checked by all hosts together, each its share: the same list on every host (one
  host's damaged file stops all with the same error). Every process calls it at the same point; it never raises
  on one host alone, so none is left waiting in the collective."""
  if jax.process_count() == 1:
    return file_problems(step_dir)
  try:
    mine = file_problems(step_dir)
  except Exception as e:  # noqa: BLE001 - reported, so that every host reaches the collective
    mine = [f"its files cannot be checked ({(str(e).splitlines() or [type(e).__name__])[0]})"]
  return merge_problems(parallel.allgather_json(mine))
