"""Mesh construction and the logical-axis rules table (sharding is data, not model code)."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
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
  # Qwen3-MoE's stacked experts [E, D, F]: None keeps every expert on every device (F over tensor); a mesh axis
  # (`expert_parallel_rules`) splits them over it, whole, for expert parallelism (model/_expert_parallel.py).
  # Ahead of 'embed', so it takes that axis before D does (a mesh axis shards one dimension; the first row naming
  # it wins).
  ("expert", None),
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


def expert_parallel_rules(axis: str | tuple = "fsdp", rules=DEFAULT_RULES) -> tuple:
  """`rules` with the stacked experts over the mesh axis (or axes) `axis`: each device of it holds E / n whole
  experts, and the sparse block sends each (token, expert) pair to its expert by an all-to-all over it. The axis must
  be one the batch rows are split over ('fsdp', 'data' or both): no new mesh axis, so every mesh keeps working."""
  return tuple((name, axis if name == "expert" else mesh_axes) for name, mesh_axes in rules)


def make_mesh(shape: Mapping[str, int] | Sequence[int], devices: Optional[Sequence] = None) -> Mesh:
  """A (data, fsdp, tensor) mesh. `shape` is a dict or a 3-tuple; one entry may be -1 (use the rest).

  On TPU the device order follows the physical topology (`jax.experimental.mesh_utils`), so the tensor axis,
  which talks most, maps onto neighbouring chips; with several slices (multi-slice, devices with distinct
  `slice_index`) the data axis spans the slices over DCN and the others stay inside each slice's ICI. CPU
  devices (and any platform mesh_utils has no layout for) are used in the order given, unless a TPU slice's order
  is emulated (`emulate_topology`): then they are laid out as that slice's chips would be."""
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
  emulation = _emulation() if devices[0].platform == "cpu" else None
  if emulation is not None:  # the slice's order, mapped onto CPU devices
    return emulation.to_cpu(_device_array(sizes, emulation.to_topology(devices)))
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


# ---------------------------------------------------------------------------------------------------------
# A TPU slice's device order on CPU processes. CPU devices are process-major (`jax.devices()`); a slice's meshes are
# not (mesh_utils orders chips by physical coordinates, so a mesh axis may alternate between hosts). With a slice
# named here, every mesh built by `make_mesh` / `local_mesh` / `hosts_mesh` over CPU devices is built for the
# slice's chips by the same TPU code and mapped back: chip (process p, local index i) -> CPU device (p, i).
# ---------------------------------------------------------------------------------------------------------
EMULATE_TOPOLOGY_ENV = "AEPO_EMULATE_TOPOLOGY"
_EMULATE: dict = {"name": None, "cache": None}


class _Emulation:
  """The two-way map between a slice's chips (`jax.experimental.topologies`) and this run's CPU devices."""

  def __init__(self, name: str, topo_devices: Sequence, cpu_devices: Sequence):
    self.name = name
    self._to_topo, self._to_cpu = {}, {}
    for p in sorted({d.process_index for d in topo_devices}):
      chips = sorted((d for d in topo_devices if d.process_index == p), key=lambda d: d.id)
      cpus = sorted((d for d in cpu_devices if d.process_index == p), key=lambda d: d.id)
      for chip, cpu in zip(chips, cpus):
        self._to_topo[cpu.id], self._to_cpu[chip.id] = chip, cpu

  def to_topology(self, devices: Sequence) -> list:
    missing = [d for d in devices if d.id not in self._to_topo]
    if missing:
      raise ValueError(f"emulated slice {self.name}: devices {missing} have no chip of the slice.")
    return [self._to_topo[d.id] for d in devices]

  def to_cpu(self, chips: np.ndarray) -> np.ndarray:
    out = np.empty(chips.shape, dtype=object)
    for index, chip in np.ndenumerate(chips):
      out[index] = self._to_cpu[chip.id]
    return out


@contextlib.contextmanager
def _libtpu_off_a_tpu_vm(name: str):
  """Off a TPU VM, libtpu starts without the accelerator type and worker hostnames a VM's metadata gives, and
  prints an error block to stderr ("Failed to find host bounds...", "INVALID_ARGUMENT: unexpected worker hostname")
  that looks like a failure although describing and compiling for a slice work. While it loads (here), give it the
  slice's type and this host; restored afterwards, so nothing later takes this process for a TPU VM. The compiled
  programs are the same either way (checked on v5p, v6e and v5e slices: identical text). Nothing changes on a
  TPU VM or where either variable is set."""
  from aepo_jax.parallel._distributed import tpu_host_markers

  keys = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")
  if any(k in os.environ for k in keys) or tpu_host_markers():
    yield
    return
  gen, _, dims = name.partition(":")
  chips = int(np.prod([int(d) for d in dims.split("x")])) if dims.replace("x", "").isdigit() else 1
  # Cloud TPU's names: v5e is "v5litepod-<chips>", v4 and v5p count TensorCores (two a chip), v6e counts chips.
  kind = {"v5e": f"v5litepod-{chips}", "v6e": f"v6e-{chips}"}.get(gen, f"{gen}-{2 * chips}")
  os.environ.update({"TPU_ACCELERATOR_TYPE": kind, "TPU_WORKER_HOSTNAMES": "localhost"})
  try:
    yield
  finally:
    for k in keys:
      os.environ.pop(k, None)


def topology_devices(name: str) -> list:
  """The chips of the TPU slice `name` (e.g. "v5p:2x2x2", "v6e:4x4"), each with its `process_index`; needs libtpu
  (it runs on a CPU host: no TPU is claimed)."""
  from jax.experimental import topologies

  # Describing or compiling for a slice claims no chip: do not take the lock a TPU job (or another process that
  # loaded libtpu for the same purpose, such as a parallel test or compile) on this host may hold.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    with _libtpu_off_a_tpu_vm(name):
      return list(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
  except Exception as e:  # libtpu missing, or a name it does not know
    raise ValueError(
      f"cannot describe the TPU slice {name!r} ({type(e).__name__}: {e}); give a slice such as v5p:2x2x2 or "
      "v6e:4x4 and install libtpu (pip install 'jax[tpu]')."
    ) from e


def slice_hosts(name: str) -> tuple[int, int]:
  """(hosts, chips per host) of the TPU slice `name` (libtpu, no TPU claimed): the processes and the CPU devices per
  process (`--xla_force_host_platform_device_count`) that emulate it. Safe before JAX's CPU backend starts."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # see _emulation
  chips = topology_devices(name)
  per_host = {p: sum(d.process_index == p for d in chips) for p in {d.process_index for d in chips}}
  if len(set(per_host.values())) != 1:
    raise ValueError(f"the TPU slice {name} has hosts with different chip counts {per_host}; it cannot be emulated.")
  return len(per_host), next(iter(per_host.values()))


def emulate_topology(name: Optional[str]) -> None:
  """Build every mesh of this run (on CPU devices) in the device order of the TPU slice `name`; None drops this
  setting (AEPO_EMULATE_TOPOLOGY, if set, still applies). Checks at once that the run has the slice's processes and
  devices per process; call it after `initialize_distributed` and before any mesh is built. The environment variable
  AEPO_EMULATE_TOPOLOGY=SLICE does the same, read when the first mesh is built."""
  _EMULATE["name"], _EMULATE["cache"] = (name or None), None
  if name:
    _emulation()


def emulated_topology() -> Optional[str]:
  """The slice whose order CPU meshes follow (`emulate_topology` or AEPO_EMULATE_TOPOLOGY), or None."""
  return _EMULATE["name"] or os.environ.get(EMULATE_TOPOLOGY_ENV) or None


def _emulation() -> Optional[_Emulation]:
  name = emulated_topology()
  if not name:
    return None
  cpu = jax.devices()
  key = (name, tuple(d.id for d in cpu))
  cached = _EMULATE["cache"]
  if cached is not None and cached[0] == key:
    return cached[1]
  if cpu[0].platform != "cpu":
    raise ValueError(
      f"emulating the TPU slice {name} is for CPU processes, but this run's devices are {cpu[0].platform}: a real "
      "slice already has its own order; drop --emulate_topology / AEPO_EMULATE_TOPOLOGY."
    )
  # Every process describes the slice with libtpu (no TPU claimed); without this only one process on the machine could
  # load it (/tmp/libtpu_lockfile).
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  chips = topology_devices(name)
  hosts = sorted({d.process_index for d in chips})
  per_host = {p: sum(d.process_index == p for d in chips) for p in hosts}
  have = {p: sum(d.process_index == p for d in cpu) for p in sorted({d.process_index for d in cpu})}
  if have != per_host:
    each = sorted(set(per_host.values()))
    raise ValueError(
      f"the TPU slice {name} has {len(hosts)} hosts with {each[0] if len(each) == 1 else each} chips each, but this "
      f"run has {len(have)} processes with {sorted(set(have.values()))} devices each: start {len(hosts)} processes "
      f"(--num_processes={len(hosts)}) with XLA_FLAGS=--xla_force_host_platform_device_count={each[0]}."
    )
  emulation = _Emulation(name, chips, cpu)
  _EMULATE["cache"] = (key, emulation)
  logging.info(
    "meshes in the order of the TPU slice %s: %d hosts x %d devices", name, len(hosts), next(iter(per_host.values()))
  )
  return emulation


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


def current_platform() -> str:
  """The platform being traced for: the enclosing `sharding_context` mesh's (a TPU slice compiled on a CPU host
  included), else the default backend's."""
  mesh = current_mesh()
  return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


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
