"""Mesh construction and the logical-axis rules table (sharding is data, not model code)."""
from __future__ import annotations

import logging
from typing import Mapping, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axis (or tuple of axes, or None = replicated). One table for model, cache and batch.
DEFAULT_RULES = (
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", None),
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("cache_batch", ("data", "fsdp")),
    ("cache_length", None),
    ("cache_kv_heads", "tensor"),
)


def make_mesh(shape: Mapping[str, int] | Sequence[int], devices: Optional[Sequence] = None) -> Mesh:
  """A (data, fsdp, tensor) mesh. `shape` is a dict or a 3-tuple; one entry may be -1 (use the rest)."""
  if isinstance(shape, Mapping):
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
      raise ValueError(f"mesh shape has unknown axes {sorted(unknown)}; allowed axes are {MESH_AXES}.")
    sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
  else:
    sizes = [int(s) for s in shape]
  devices = list(devices if devices is not None else jax.devices())
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh shape {sizes}: at most one axis may be -1.")
  if -1 in sizes:
    rest = int(np.prod([s for s in sizes if s != -1]))
    if len(devices) % rest:
      raise ValueError(f"mesh shape {dict(zip(MESH_AXES, sizes))} does not divide {len(devices)} devices.")
    sizes[sizes.index(-1)] = len(devices) // rest
  if int(np.prod(sizes)) != len(devices):
    raise ValueError(
        f"mesh shape {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices but {len(devices)} are "
        "available; make the product of the mesh axes equal the device count (or use -1 for one axis).")
  return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def logical_to_mesh(spec: PartitionSpec, rules=DEFAULT_RULES) -> PartitionSpec:
  return nn.logical_to_mesh_axes(tuple(spec), rules)


def _fit(spec: PartitionSpec, shape, mesh: Mesh) -> PartitionSpec:
  """Drop mesh axes that do not divide a dimension (e.g. 3 KV heads over tensor=4): replicate instead."""
  out = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    size = int(np.prod([mesh.shape[a] for a in names])) if names else 1
    if names and dim % size:
      logging.info("sharding: dim %d not divisible by mesh axes %s (size %d); replicating it.", dim, names, size)
      out.append(None)
    else:
      out.append(axes)
  return PartitionSpec(*out)


def logical_sharding(logical_specs, shapes, mesh: Mesh, rules=DEFAULT_RULES):
  """NamedShardings for a pytree of logical PartitionSpecs, given matching shapes (arrays or ShapeDtypeStructs)."""
  return jax.tree.map(
      lambda spec, x: NamedSharding(mesh, _fit(logical_to_mesh(spec, rules), x.shape, mesh)),
      logical_specs, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))
