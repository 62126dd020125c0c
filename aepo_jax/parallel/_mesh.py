"""Mesh construction and the logical-axis rules table (sharding is data, not model code)."""

from __future__ import annotations

import contextlib
import contextvars
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
  ("activation_heads", "tensor"),
  ("activation_kv_heads", "tensor"),
  ("activation_mlp", "tensor"),
  ("activation_vocab", "tensor"),
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
  ("cache_pages", None),  # the paged pool: every slot of a host draws from it (the engine refuses data x fsdp > 1)
)


def make_mesh(shape: Mapping[str, int] | Sequence[int], devices: Optional[Sequence] = None) -> Mesh:
  """A (data, fsdp, tensor) mesh. `shape` is a dict or a 3-tuple; one entry may be -1 (use the rest).

  On TPU the device order follows the physical topology (`jax.experimental.mesh_utils`), so the tensor axis,
  which talks most, maps onto neighbouring chips; with several slices (multi-slice, devices with distinct
  `slice_index`) the data axis spans the slices over DCN and the others stay inside each slice's ICI. CPU
  devices (and any platform mesh_utils has no layout for) are used in the order given."""
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
      "available; make the product of the mesh axes equal the device count (or use -1 for one axis)."
    )
  return Mesh(_device_array(sizes, devices), MESH_AXES)


def _device_array(sizes: list, devices: list) -> np.ndarray:
  if devices[0].platform != "tpu" or len(devices) == 1:
    return np.asarray(devices).reshape(sizes)
  from jax.experimental import mesh_utils

  slices = sorted({getattr(d, "slice_index", 0) for d in devices})
  if len(slices) > 1:
    if sizes[0] % len(slices):
      raise ValueError(
        f"mesh data={sizes[0]} must be a multiple of the {len(slices)} slices (the data axis spans "
        "the slices over DCN); set mesh.data to a multiple of the slice count."
      )
    ici = [sizes[0] // len(slices)] + sizes[1:]
    return mesh_utils.create_hybrid_device_mesh(ici, [len(slices), 1, 1], devices, allow_split_physical_axes=True)
  return mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)


def local_mesh(shape: Mapping[str, int] | Sequence[int] = (1, 1, -1), devices: Optional[Sequence] = None) -> Mesh:
  """A (data, fsdp, tensor) mesh over this process's own devices (default: all of them on the tensor axis): where
  a host runs its rollouts independently of the other hosts."""
  return make_mesh(shape, devices if devices is not None else jax.local_devices())


def logical_to_mesh(spec: PartitionSpec, rules=DEFAULT_RULES) -> PartitionSpec:
  return nn.logical_to_mesh_axes(tuple(spec), rules)


def _fit(spec: PartitionSpec, shape, mesh: Mesh, quiet: bool = False) -> PartitionSpec:
  """Drop mesh axes that do not divide a dimension (e.g. 3 KV heads over tensor=4): replicate instead."""
  out = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    size = int(np.prod([mesh.shape[a] for a in names])) if names else 1
    if names and dim % size:
      (logging.debug if quiet else logging.info)(
        "sharding: dim %d not divisible by mesh axes %s (size %d); replicating it.", dim, names, size
      )
      out.append(None)
    else:
      out.append(axes)
  return PartitionSpec(*out)


def logical_sharding(logical_specs, shapes, mesh: Mesh, rules=DEFAULT_RULES):
  """NamedShardings for a pytree of logical PartitionSpecs, given matching shapes (arrays or ShapeDtypeStructs)."""
  return jax.tree.map(
    lambda spec, x: NamedSharding(mesh, _fit(logical_to_mesh(spec, rules), x.shape, mesh)),
    logical_specs,
    shapes,
    is_leaf=lambda x: isinstance(x, PartitionSpec),
  )


# ---------------------------------------------------------------------------------------------------------
# Activation sharding constraints. Model code names logical axes (`constrain(x, ("activation_batch", ...))`); they
# take effect only while a step is traced inside `sharding_context(mesh, rules)` (the jitted steps do this), and
# are no-ops elsewhere (e.g. an eager forward on one device).
_CONTEXT: contextvars.ContextVar = contextvars.ContextVar("aepo_jax_sharding_context", default=None)


@contextlib.contextmanager
def sharding_context(mesh: Optional[Mesh], rules=DEFAULT_RULES):
  """Within this context `constrain` pins activations to `mesh` through `rules`. A one-device mesh (or None)
  makes every constraint a no-op."""
  token = _CONTEXT.set(None if mesh is None else (mesh, tuple(rules)))
  try:
    yield
  finally:
    _CONTEXT.reset(token)


def current_mesh() -> Optional[Mesh]:
  """The mesh of the enclosing `sharding_context` (one device included), or None outside one."""
  ctx = _CONTEXT.get()
  return None if ctx is None else ctx[0]


def activation_spec(shape, logical_axes: Sequence[Optional[str]]) -> Optional[PartitionSpec]:
  """The mesh PartitionSpec that `constrain` gives an array of `shape` with these logical axes under the current
  `sharding_context` (axes that do not divide a dimension dropped); None outside a context or on one device."""
  ctx = _CONTEXT.get()
  if ctx is None or ctx[0].devices.size == 1:
    return None
  mesh, rules = ctx
  return _fit(logical_to_mesh(PartitionSpec(*logical_axes), rules), shape, mesh, quiet=True)


def constrain(x, logical_axes: Sequence[Optional[str]]):
  """`x` with a sharding constraint from its logical axes (one name or None per dimension) under the current
  `sharding_context`; dimensions the mapped mesh axes do not divide stay replicated. No context: `x` unchanged."""
  spec = activation_spec(x.shape, logical_axes)
  if spec is None:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(current_mesh(), spec))
