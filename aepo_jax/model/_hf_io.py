"""Hugging Face safetensors checkpoints <-> our parameter tree.

`load_hf` streams tensor by tensor: with a mesh, each parameter is placed straight onto its NamedSharding
through `jax.make_array_from_callback`, so a host holds its own shards plus at most one HF tensor. A local
directory is read with safetensors' `safe_open`; a gs:// one in place (`RemoteSafetensors`: each shard's header,
then one ranged read per tensor of only the rows this host's shards need, `_host_rows`), so no weight file is ever
copied to local disk.
Our layout (flax DenseGeneral) vs HF (torch Linear, weight [out, in]):
  q/k/v kernel [L, D, N, hd] <- weight [N*hd, D] transposed;   o kernel [L, H, hd, D] <- weight [D, H*hd].T
  q/k/v bias   [L, N, hd]    <- bias [N*hd];                   mlp kernels [L, in, out] <- weight.T
  lm_head kernel [D, V] <- lm_head.weight.T;  embedding [V, D] and norm scales as they are.
Qwen3-MoE (sparse layers; the published per-expert names, which transformers 5 and vLLM read and write):
  router kernel [L, D, E] <- mlp.gate.weight [E, D].T;  expert kernels [L, E, in, out] <- mlp.experts.{e}.*.weight.T
A model with dense and sparse layers stores both blocks in every layer: the tensors a layer's kind lacks in the
checkpoint are read as zeros and not written.
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from aepo_jax.model._remote_safetensors import RemoteSafetensors
from aepo_jax.model._config import ModelConfig
from aepo_jax.model._hf_config import from_hf_config, to_hf_config
from aepo_jax.model._sharding import param_shapes, param_shardings

_INDEX = "model.safetensors.index.json"

# Our path below the root (layer params below 'layers') -> (HF name, kind). '{i}' is the layer index.
_LAYER = {
  ("self_attn", "q_proj", "kernel"): ("model.layers.{i}.self_attn.q_proj.weight", "in_heads"),
  ("self_attn", "k_proj", "kernel"): ("model.layers.{i}.self_attn.k_proj.weight", "in_heads"),
  ("self_attn", "v_proj", "kernel"): ("model.layers.{i}.self_attn.v_proj.weight", "in_heads"),
  ("self_attn", "q_proj", "bias"): ("model.layers.{i}.self_attn.q_proj.bias", "reshape"),
  ("self_attn", "k_proj", "bias"): ("model.layers.{i}.self_attn.k_proj.bias", "reshape"),
  ("self_attn", "v_proj", "bias"): ("model.layers.{i}.self_attn.v_proj.bias", "reshape"),
  ("self_attn", "o_proj", "kernel"): ("model.layers.{i}.self_attn.o_proj.weight", "transpose"),
  ("self_attn", "q_norm", "scale"): ("model.layers.{i}.self_attn.q_norm.weight", "same"),
  ("self_attn", "k_norm", "scale"): ("model.layers.{i}.self_attn.k_norm.weight", "same"),
  ("mlp", "gate_proj", "kernel"): ("model.layers.{i}.mlp.gate_proj.weight", "transpose"),
  ("mlp", "up_proj", "kernel"): ("model.layers.{i}.mlp.up_proj.weight", "transpose"),
  ("mlp", "down_proj", "kernel"): ("model.layers.{i}.mlp.down_proj.weight", "transpose"),
  ("mlp", "gate", "kernel"): ("model.layers.{i}.mlp.gate.weight", "transpose"),
  ("mlp", "experts", "gate_proj", "kernel"): ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "transpose"),
  ("mlp", "experts", "up_proj", "kernel"): ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", "transpose"),
  ("mlp", "experts", "down_proj", "kernel"): ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", "transpose"),
  ("input_layernorm", "scale"): ("model.layers.{i}.input_layernorm.weight", "same"),
  ("post_attention_layernorm", "scale"): ("model.layers.{i}.post_attention_layernorm.weight", "same"),
}
_TOP = {
  ("embed_tokens", "embedding"): ("model.embed_tokens.weight", "same"),
  ("norm", "scale"): ("model.norm.weight", "same"),
  ("lm_head", "kernel"): ("lm_head.weight", "transpose"),
}


def _to_ours(w, kind: str, shape: tuple):
  """One HF tensor -> our layout for one layer (`shape` excludes the layers axis)."""
  if kind == "in_heads":  # [N*hd, D] -> [D, N, hd]
    return w.T.reshape(shape)
  if kind == "transpose":  # [out, in] -> [in, out]; o_proj: [D, H*hd] -> [H, hd, D]
    return w.T.reshape(shape)
  return w.reshape(shape)


def _to_hf(x, kind: str):
  """Inverse of `_to_ours` for one layer."""
  if kind == "in_heads":
    return x.reshape(x.shape[0], -1).T
  if kind == "transpose":
    return x.reshape(-1, x.shape[-1]).T
  return x.reshape(-1) if kind == "reshape" else x


def _hf_shape(kind: str, shape: tuple) -> tuple:
  if kind == "in_heads":
    return (math.prod(shape[1:]), shape[0])
  if kind == "transpose":
    return (shape[-1], math.prod(shape[:-1]))
  return (math.prod(shape),) if kind == "reshape" else tuple(shape)


def _entries(config: ModelConfig, shapes):
  """(our path, [(index into our leaf, HF name)], kind, our shape of one HF tensor) for every parameter: the
  index is () for a top-level leaf, (layer,) for a stacked one, (layer, expert) for an expert kernel. Layers whose
  kind lacks the tensor (dense MLP in a sparse layer, router or experts in a dense one) have no entry."""
  out = []
  sparse = config.moe_layers
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    keys = tuple(k.key for k in path)
    if keys[0] != "layers":
      name, kind = _TOP[keys]
      out.append((keys, [((), name)], kind, tuple(leaf.shape)))
      continue
    name, kind = _LAYER[keys[1:]]
    moe_leaf = keys[2] in ("gate", "experts")
    layers = [i for i in range(config.num_layers) if keys[1] != "mlp" or sparse[i] == moe_leaf]
    if keys[2] == "experts":
      items = [((i, e), name.format(i=i, e=e)) for i in layers for e in range(config.num_experts)]
      out.append((keys, items, kind, tuple(leaf.shape[2:])))
    else:
      out.append((keys, [((i,), name.format(i=i)) for i in layers], kind, tuple(leaf.shape[1:])))
  return out


def _set(tree: dict, keys: tuple, value):
  for k in keys[:-1]:
    tree = tree.setdefault(k, {})
  tree[keys[-1]] = value


# ----------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------
# Files of an HF directory that hold weights: what a copy of only its tokenizer and config files leaves out.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def _remote(path) -> bool:
  return str(path).startswith("gs://")


def _dir(path: str):
  """`path` as an etils Path: config.json, the index and the listing are read through it, local or gs://."""
  from etils import epath

  return epath.Path(path)


def read_hf_config(path: str, dtype: str = "float32") -> ModelConfig:
  if not _dir(path).is_dir():
    raise FileNotFoundError(f"load_hf: checkpoint directory {path!r} does not exist.")
  cfg_path = _dir(path) / "config.json"
  if not cfg_path.is_file():
    raise FileNotFoundError(f"load_hf: {cfg_path} is missing; a Hugging Face checkpoint directory needs it.")
  try:
    hf = json.loads(cfg_path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"load_hf: {cfg_path} is not valid JSON ({e}).") from None
  return from_hf_config(hf, dtype=dtype, source=str(cfg_path))


def _weight_files(path: str) -> dict:
  """HF tensor name -> safetensors file, from the index file or the files' own headers."""
  root = _dir(path)
  index = root / _INDEX
  if index.is_file():
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not weight_map:
      raise ValueError(f"load_hf: {index} has no 'weight_map'.")
    files = {name: str(root / fname) for name, fname in weight_map.items()}
    for fname in sorted(set(files.values())):
      if not _dir(fname).is_file():
        raise FileNotFoundError(f"load_hf: {fname} is listed in {index} but does not exist (partial download?).")
    for fname in sorted(set(files.values())):  # validate every header up front
      with _open(fname):
        pass
    return files
  names = sorted(p.name for p in root.iterdir() if p.name.endswith(".safetensors"))
  if not names:
    raise FileNotFoundError(
      f"load_hf: no *.safetensors weights in {path} (expected model.safetensors or shards with {_INDEX})."
    )
  files = {}
  for fname in names:
    with _open(str(root / fname)) as f:
      files.update({k: str(root / fname) for k in f.keys()})
  return files


def _open(fname: str):
  if _remote(fname):
    return RemoteSafetensors(fname)
  try:
    return safe_open(fname, framework="numpy")
  except (SafetensorError, OSError) as e:
    raise ValueError(
      f"load_hf: {fname} is not a readable safetensors file ({e}); re-download or re-export it."
    ) from None


class _Reader:
  """Reads one HF tensor at a time, keeping the open file handles (safe_open, or `RemoteSafetensors` for gs://)."""

  def __init__(self, files: dict, path: str):
    self.files, self.path, self._open = files, path, {}

  def _handle(self, name: str):
    if name not in self.files:
      index = _dir(self.path) / _INDEX
      where = index if index.is_file() else self.path
      raise KeyError(
        f"load_hf: tensor {name!r} is missing from the checkpoint ({where}); the checkpoint is "
        "partial or does not match config.json."
      )
    fname = self.files[name]
    if fname not in self._open:
      self._open[fname] = _open(fname).__enter__()
    return self._open[fname], fname

  def check_shape(self, name: str, expected: tuple):
    handle, fname = self._handle(name)
    if isinstance(handle, RemoteSafetensors):
      found = handle.shape(name)
    else:
      try:
        found = tuple(handle.get_slice(name).get_shape())
      except SafetensorError as e:
        raise KeyError(f"load_hf: tensor {name!r} is missing from {fname} ({e}).") from None
    if found != tuple(expected):
      raise ValueError(
        f"load_hf: tensor {name!r} in {fname} has shape {list(found)} but config.json implies {list(expected)}."
      )

  def close(self):
    for handle in self._open.values():
      handle.__exit__(None, None, None)
    self._open.clear()

  def get(self, name: str, rows: Optional[tuple] = None) -> np.ndarray:
    """Tensor `name`, or its rows [lo, hi) along axis 0: a gs:// file reads only those; a local one reads it whole
    (safe_open's fast path) and returns a view."""
    handle, fname = self._handle(name)
    if isinstance(handle, RemoteSafetensors):
      return handle.get_tensor(name, rows)
    try:
      w = handle.get_tensor(name)
    except SafetensorError as e:
      raise ValueError(f"load_hf: could not read tensor {name!r} from {fname} ({e}); the file is corrupt.") from None
    return w if rows is None else w[rows[0] : rows[1]]


def load_hf(path: str, dtype: str = "float32", mesh=None, rules=None):
  """(config, params) from a Hugging Face directory (local or gs://) of a Llama / Qwen2 / Qwen3 / Qwen3-MoE checkpoint.

  A gs:// directory is read in place: config.json and the index through etils epath, each safetensors shard by
  its header and one ranged read per tensor (with `mesh`, of only the rows this host's shards need); nothing is
  copied to local disk. `dtype` sets both parameter and compute dtype of the returned config. With `mesh`, each
  parameter lands on the NamedSharding that `param_logical_axes` + `rules` (default `DEFAULT_RULES`) give it.
  """
  config = read_hf_config(path, dtype)
  reader = _Reader(_weight_files(path), path)
  try:
    return config, _read_params(config, reader, dtype, mesh, rules)
  finally:
    reader.close()


def _read_params(config: ModelConfig, reader: _Reader, dtype: str, mesh, rules) -> dict:
  shapes = param_shapes(config)
  entries = _entries(config, shapes)
  for _, items, kind, shape in entries:  # fail on any missing tensor or shape mismatch before reading data
    for _, name in items:
      reader.check_shape(name, _hf_shape(kind, shape))
  flat_shapes = {tuple(k.key for k in p): tuple(s.shape) for p, s in jax.tree_util.tree_flatten_with_path(shapes)[0]}
  flat_shardings = None
  if mesh is not None:
    shardings = param_shardings(config, mesh, rules)
    flat_shardings = {tuple(k.key for k in p): s for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}
  np_dtype = jnp.dtype(dtype)
  params = {}
  for keys, items, kind, shape in entries:
    full_shape = flat_shapes[keys]
    if flat_shardings is None:
      value = np.zeros(full_shape, np_dtype)  # zeros: the tensors a layer's kind lacks
      for index, name in items:
        value[index] = _to_ours(reader.get(name), kind, shape).astype(np_dtype)
      _set(params, keys, jnp.asarray(value))
      continue
    sharding = flat_shardings[keys]
    indices = sharding.addressable_devices_indices_map(full_shape).values()
    rows, part, origin = _host_rows(kind, shape, full_shape, indices) or (None, shape, (0,) * len(shape))

    def tensors(items=items, kind=kind, rows=rows, part=part):
      for index, name in items:
        yield index, _to_ours(reader.get(name, rows), kind, part).astype(np_dtype)

    _set(params, keys, _place(tensors(), full_shape, np_dtype, sharding, origin))
  return params


def _row_axes(kind: str, ndim: int) -> tuple:
  """Our axes (of the part of the leaf one HF tensor fills) that the HF tensor's axis 0 runs over, outermost first."""
  if kind == "in_heads":  # [N*hd, D] -> [D, N, hd]
    return (1, 2)
  if kind == "transpose":  # [out, in] -> [in..., out]
    return (ndim - 1,)
  return tuple(range(ndim)) if kind == "reshape" else (0,)


def _host_rows(kind: str, shape: tuple, full_shape: tuple, indices) -> Optional[tuple]:
  """(HF rows (lo, hi), our shape of those rows, their offset in our `shape`): the one block of HF rows that covers
  every shard in `indices` (this host's), or None when that is every row or the shards are not a block of rows. With
  fsdp across hosts, a host then reads its part of e.g. o_proj / down_proj instead of the whole tensor."""
  if not shape:
    return None
  lead, axes = len(full_shape) - len(shape), _row_axes(kind, len(shape))
  spans = {axis: {idx[lead + axis].indices(shape[axis])[:2] for idx in indices} for axis in axes}
  if any(s != {(0, shape[axis])} for axis, s in spans.items() if axis != axes[0]):
    return None
  lo, hi = min(a for a, _ in spans[axes[0]]), max(b for _, b in spans[axes[0]])
  if (lo, hi) == (0, shape[axes[0]]):
    return None
  stride = math.prod(shape[axis] for axis in axes[1:])
  part = shape[: axes[0]] + (hi - lo,) + shape[axes[0] + 1 :]
  return (lo * stride, hi * stride), part, tuple(lo if axis == axes[0] else 0 for axis in range(len(shape)))


def _place(tensors, full_shape, np_dtype, sharding, origin: tuple):
  """Fill only this host's (unique) shards, one HF tensor at a time, then build the global array. `tensors` yields
  (index of the leading axes of our leaf, value of a block of the remaining axes that starts at `origin` and covers
  this host's shards)."""
  index_map = sharding.addressable_devices_indices_map(full_shape)
  buffers = {}
  for index in index_map.values():
    key = tuple((s.start, s.stop) for s in index)
    if key not in buffers:
      buffers[key] = (index, np.zeros(_slice_shape(full_shape, index), np_dtype))
  for lead, w in tensors:
    for index, buf in buffers.values():
      local = []
      for i, s, n in zip(lead, index, full_shape):
        lo, hi = s.start or 0, n if s.stop is None else s.stop
        if not lo <= i < hi:
          break
        local.append(i - lo)
      else:
        tail = zip(index[len(lead) :], full_shape[len(lead) :], origin)
        buf[tuple(local)] = w[tuple(slice(s.indices(n)[0] - o, s.indices(n)[1] - o) for s, n, o in tail)]
  return jax.make_array_from_callback(
    full_shape, sharding, lambda index: buffers[tuple((s.start, s.stop) for s in index)][1]
  )


def _slice_shape(shape, index):
  return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))


# ----------------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------------
SAVE_DTYPES = ("float32", "bfloat16", "float16")


def _shard_plan(config: ModelConfig, shapes, itemsize: int, max_shard_bytes: int) -> list:
  """Shards of [(HF name, our path, index into our leaf, kind)], cut from the shapes alone (so the file names,
  which carry the shard count, are known before any tensor is materialised)."""
  shards, current, size = [], [], 0
  for keys, items, kind, shape in _entries(config, shapes):
    nbytes = math.prod(shape) * itemsize
    for index, name in items:
      if current and size + nbytes > max_shard_bytes:
        shards.append(current)
        current, size = [], 0
      current.append((name, keys, index, kind))
      size += nbytes
  shards.append(current)
  return shards


def _write_text(out, name: str, text: str):
  (out / name).write_text(text)


def save_hf(
  config: ModelConfig,
  params,
  path: str,
  *,
  max_shard_bytes: int = 2 * 1024**3,
  dtype: Optional[str] = None,
  generation_config: Optional[dict] = None,
):
  """Write `path/config.json`, `generation_config.json` and safetensors shards (+ index when more than one).

  `path` is local or gs://; shards are written one at a time (a gs:// shard through a local temporary file), so
  the host holds one shard beside the params. `dtype` (float32, bfloat16, float16; default: the params' dtype)
  sets the stored dtype. `generation_config` (e.g. the base model's) is written as given, with bos / eos / pad
  ids filled in from `config` only where it has none. Tied embeddings store no `lm_head.weight`.
  """
  import shutil
  import tempfile

  from etils import epath

  if dtype is not None and str(dtype) not in SAVE_DTYPES:
    raise ValueError(f"save_hf: dtype={dtype!r}; choose one of {SAVE_DTYPES}.")
  shapes = param_shapes(config)
  leaves = {tuple(k.key for k in p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
  expected = {e[0] for e in _entries(config, shapes)}
  if set(leaves) != expected:
    raise ValueError(
      f"save_hf: params do not match config (missing {sorted(expected - set(leaves))}, "
      f"unexpected {sorted(set(leaves) - expected)})."
    )
  out_dtype = jnp.dtype(dtype or jax.tree.leaves(params)[0].dtype)
  out = epath.Path(path)
  out.mkdir(parents=True, exist_ok=True)
  remote = str(path).startswith("gs://")
  shards = _shard_plan(config, shapes, out_dtype.itemsize, max_shard_bytes)
  weight_map, total, cached = {}, 0, (None, None)
  with tempfile.TemporaryDirectory(prefix="aepo_jax_export_") as staging:
    for n, plan in enumerate(shards):
      tensors = {}
      for name, keys, index, kind in plan:
        if cached[0] != keys:  # one of our (stacked) leaves at a time, as a host array of the stored dtype
          cached = (keys, np.asarray(jax.device_get(leaves[keys])).astype(out_dtype))
        x = cached[1][index]
        tensors[name] = np.ascontiguousarray(_to_hf(x, kind))
      fname = "model.safetensors" if len(shards) == 1 else f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
      local = os.path.join(staging if remote else os.fspath(out), fname)
      save_file(tensors, local, metadata={"format": "pt"})
      total += sum(t.nbytes for t in tensors.values())
      weight_map.update({name: fname for name in tensors})
      del tensors
      if remote:
        with open(local, "rb") as src, (out / fname).open("wb") as dst:
          shutil.copyfileobj(src, dst, 16 << 20)
        os.remove(local)
  if len(shards) > 1:
    _write_text(
      out, _INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
    )
  _write_text(out, "config.json", json.dumps(to_hf_config(config, torch_dtype=str(out_dtype)), indent=2))
  generation = dict(generation_config or {})
  for key, value in (
    ("bos_token_id", config.bos_token_id),
    ("pad_token_id", config.pad_token_id),
    ("eos_token_id", list(config.eos_token_ids) or None),
  ):
    if generation.get(key) is None and value is not None:
      generation[key] = value
  _write_text(out, "generation_config.json", json.dumps(generation, indent=2))
  return path
