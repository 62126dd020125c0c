"""Multi-host start-up, the platform a launcher is about to use, and moving parameters between meshes."""

from __future__ import annotations

import glob
import logging
import os
from typing import Optional

import jax
import numpy as np

from aepo_jax.parallel._mesh import DEFAULT_RULES, MESH_AXES, local_mesh, logical_sharding

# Environment markers of a Cloud TPU VM (single or multi-host) or a TPU pod on GKE.
_TPU_ENV = (
  "TPU_WORKER_HOSTNAMES",
  "TPU_WORKER_ID",
  "TPU_ACCELERATOR_TYPE",
  "CLOUD_TPU_TASK_ID",
  "MEGASCALE_COORDINATOR_ADDRESS",
)


def _forced_platform() -> str:
  return (os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_PLATFORM_NAME") or "").split(",")[0].strip().lower()


def on_tpu_vm() -> bool:
  """This process runs on a Cloud TPU VM or a GKE TPU node (env markers or TPU device files), and JAX is not told
  to use another platform. Needs no JAX backend (safe before jax.distributed.initialize)."""
  forced = _forced_platform()
  if forced and forced != "tpu":
    return False
  return tpu_host_markers()


def tpu_host_markers() -> bool:
  """A Cloud TPU VM's or GKE TPU node's env markers or TPU device files are here (whatever JAX_PLATFORMS says)."""
  if any(os.environ.get(k) for k in _TPU_ENV):
    return True
  return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def platform_is_cpu() -> bool:
  """JAX will run on the CPU here: JAX_PLATFORMS says cpu, or no TPU or GPU is visible. Needs no JAX backend, so a
  launcher can decide on XLA:CPU flags before JAX starts (they would be unknown flags to XLA:TPU)."""
  forced = _forced_platform()
  if forced:
    return forced == "cpu"
  return not (on_tpu_vm() or glob.glob("/dev/nvidia[0-9]*"))


def _cluster_detected() -> bool:
  """Environment markers of a multi-process launch that `jax.distributed.initialize()` can auto-configure."""
  if on_tpu_vm():  # Cloud TPU VMs (one host or many) and GKE: coordinator and ids from the TPU metadata
    return True
  for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
    if int(os.environ.get(key, "1") or 1) > 1:
      return True
  return False


def initialize_distributed(
  coordinator_address: Optional[str] = None,
  num_processes: Optional[int] = None,
  process_id: Optional[int] = None,
  *,
  cpu_collectives: str = "gloo",
  **kwargs,
) -> tuple[int, int]:
  """Starts `jax.distributed` when this is (or may be) a multi-process run; a no-op on a plain single host.

  Explicit arguments (or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID) start it as given (CPU
  processes exchange collectives through `cpu_collectives`, gloo by default); on every Cloud TPU VM and GKE TPU
  node, and under SLURM / MPI, it starts with auto-detection, so every host of a pod joins without flags. Call it
  before any other jax call touches the devices. Returns (process_index, process_count).
  """
  coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
    num_processes = int(os.environ["JAX_NUM_PROCESSES"])
  if process_id is None and os.environ.get("JAX_PROCESS_ID"):
    process_id = int(os.environ["JAX_PROCESS_ID"])
  explicit = coordinator_address is not None or num_processes not in (None, 1)
  if jax.distributed.is_initialized():
    return jax.process_index(), jax.process_count()
  if explicit:
    if platform_is_cpu():  # CPU collectives across processes go through gloo
      jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
      coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id, **kwargs
    )
  elif _cluster_detected():
    jax.distributed.initialize(**kwargs)
  else:
    logging.info("initialize_distributed: single process, jax.distributed not started.")
  return jax.process_index(), jax.process_count()


def shard_params(params, logical_axes, mesh, rules=DEFAULT_RULES):
  """`params` placed on the NamedShardings that `logical_axes` (e.g. model.param_logical_axes) + `rules` give.

  Fine for params that already fit on one host; a checkpoint is better loaded sharded (model.load_hf(mesh=)).
  """
  shardings = logical_sharding(logical_axes, params, mesh, rules)
  return jax.tree.map(jax.device_put, params, shardings)


# ---------------------------------------------------------------------------------------------------------
# Small agreements across processes (host-side values; every process calls them at the same point).
# ---------------------------------------------------------------------------------------------------------
def any_host(flag: bool) -> bool:
  """True when `flag` holds on at least one process; `flag` itself on one process."""
  if jax.process_count() == 1:
    return bool(flag)
  from jax.experimental import multihost_utils

  return bool(np.asarray(multihost_utils.process_allgather(np.asarray([bool(flag)], np.int32))).max())


def every_host(flag: bool) -> bool:
  """True when `flag` holds on every process; `flag` itself on one process."""
  return not any_host(not flag)


def allgather_json(obj) -> list:
  """`obj` (JSON-serialisable) of every process, in process order; `[obj]` on one process."""
  if jax.process_count() == 1:
    return [obj]
  import json

  from jax.experimental import multihost_utils

  data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int64))).reshape(-1)
  padded = np.zeros((int(sizes.max()),), np.uint8)
  padded[: data.size] = data
  every = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
  return [json.loads(bytes(every[p, : sizes[p]]).decode()) for p in range(len(sizes))]


# ---------------------------------------------------------------------------------------------------------
# Host-local copies of global arrays (rollouts: every host decodes on its own devices).
# ---------------------------------------------------------------------------------------------------------
def hosts_mesh(shape=(1, 1, -1), devices=None):
  """A mesh ('hosts', data, fsdp, tensor) over all devices (or `devices`, e.g. a TPU topology's) in which row p is
  process p's `local_mesh(shape)` (built by the same code, in the same device order): an array sharded on it with a
  spec that does not name 'hosts' is a full copy on every host's own devices."""
  by_process: dict = {}
  for d in jax.devices() if devices is None else devices:
    by_process.setdefault(d.process_index, []).append(d)
  rows = [local_mesh(shape, devs).devices for _, devs in sorted(by_process.items())]
  if len({r.shape for r in rows}) != 1:
    raise ValueError(
      f"hosts_mesh: processes have different local meshes {[r.shape for r in rows]}; every host "
      "needs the same number of devices."
    )
  return jax.sharding.Mesh(np.stack(rows), ("hosts",) + MESH_AXES)


def _copy_dtypes(leaves, dtype) -> list:
  """Each leaf's dtype in the host-local copy: `dtype` for floating leaves, if given."""
  return [np.dtype(dtype) if dtype is not None and np.issubdtype(x.dtype, np.floating) else x.dtype for x in leaves]


def _cast_fn(dtypes):
  def cast(*xs):
    return [x.astype(dt) for x, dt in zip(xs, dtypes)]

  return cast


def _host_copy_shardings(shardings, devices=None, process_index=None) -> list:
  """The hosts-mesh shardings of `shardings` (NamedShardings over one process's local mesh): the same spec on every
  host's own devices."""
  mesh = shardings[0].mesh
  everywhere = hosts_mesh(tuple(mesh.shape[a] for a in MESH_AXES), devices)
  mine = everywhere.devices[jax.process_index() if process_index is None else process_index]
  for s in shardings:
    if s.mesh.devices.shape != mine.shape or any(a != b for a, b in zip(s.mesh.devices.flat, mine.flat)):
      raise ValueError(
        "to_host_local: the rollout shardings are not on this process's local_mesh; build them on "
        "parallel.local_mesh(...) (the same order on every host)."
      )
  return [jax.sharding.NamedSharding(everywhere, s.spec) for s in shardings]


def to_host_local(tree, local_shardings, dtype=None):
  """Every process's own copy of the global arrays `tree` on its local mesh (the meshes of `local_shardings`, a
  matching pytree of NamedShardings over `local_mesh(...)`), cast to `dtype` if given.

  A cast where the arrays are (one jitted program on their own mesh), then one reshard onto the hosts mesh (every
  process must call it at the same point, like any collective); the training mesh may order its devices in any way
  (a TPU slice's mesh is not host by host). Afterwards each copy is an ordinary single-process array, so hosts can
  compute on it independently, with no cross-host collective. On one process this is a plain reshard and cast, and a
  no-op (the same arrays) when the tree already has those shardings and dtype. `lower_host_copy` lowers the same two
  programs from abstract arrays (launch/compile.py)."""
  leaves, treedef = jax.tree.flatten(tree)
  shardings = treedef.flatten_up_to(local_shardings)
  dtypes = _copy_dtypes(leaves, dtype)

  if jax.process_count() == 1:
    if all(
      isinstance(x, jax.Array) and x.dtype == dt and x.sharding.is_equivalent_to(s, x.ndim)
      for x, s, dt in zip(leaves, shardings, dtypes)
    ):
      return tree
    # Cast where the arrays are, then move them (the rollout devices may be a subset of the training mesh's).
    return treedef.unflatten(
      [jax.device_put(x.astype(dt) if x.dtype != dt else x, s) for x, s, dt in zip(leaves, shardings, dtypes)]
    )
  global_sh = _host_copy_shardings(shardings)
  cast_dtypes = any(x.dtype != dt for x, dt in zip(leaves, dtypes))
  # A jitted program's inputs and outputs share one device order, so the cast stays on the training mesh and the
  # move to the hosts mesh (another order of the same devices) is device_put's reshard.
  casted = jax.jit(_cast_fn(dtypes), out_shardings=[x.sharding for x in leaves])(*leaves) if cast_dtypes else leaves
  copies = jax.device_put(casted, global_sh)
  out = [
    jax.make_array_from_single_device_arrays(x.shape, s, [shard.data for shard in x.addressable_shards])
    for x, s in zip(copies, shardings)
  ]
  return treedef.unflatten(out)


def lower_host_copy(tree, local_shardings, dtype=None, devices=None) -> dict:
  """The programs `to_host_local` runs on a pod, lowered (not run) from abstract arrays: `tree` holds
  ShapeDtypeStructs with their training-mesh shardings, `local_shardings` host 0's rollout shardings over `devices`
  (a TPU topology's chips). {'cast': the cast on the training mesh (absent when no leaf changes dtype), 'move':
  the reshard onto the hosts mesh, one program per leaf}.

  The move is what `jax.device_put` compiles for a reshard between two orders of the same devices, leaf by leaf (its
  batched form runs one program per array): the input's shards are relabelled in the target's device order (no
  data moves) and an identity program with the target sharding moves the data. That relabelling
  (`_logical_device_ids`) is JAX's own, mirrored here so the move can be compiled ahead of time. One program for
  every leaf at once would hold every leaf's temporaries together, which the run never does."""
  leaves, treedef = jax.tree.flatten(tree)
  shardings = treedef.flatten_up_to(local_shardings)
  dtypes = _copy_dtypes(leaves, dtype)
  global_sh = _host_copy_shardings(shardings, devices, process_index=shardings[0].mesh.devices.flat[0].process_index)
  out = {}
  if any(x.dtype != dt for x, dt in zip(leaves, dtypes)):
    out["cast"] = jax.jit(_cast_fn(dtypes), out_shardings=[x.sharding for x in leaves]).lower(*leaves)
  target = list(global_sh[0].mesh.devices.flat)
  index = {d: i for i, d in enumerate(target)}

  def relabelled(x, dt):
    mesh = x.sharding.mesh
    same_order = jax.sharding.Mesh(np.asarray(target, dtype=object).reshape(mesh.devices.shape), mesh.axis_names)
    ids = tuple(index[d] for d in mesh.devices.flat)
    return jax.ShapeDtypeStruct(
      x.shape, dt, sharding=jax.sharding.NamedSharding(same_order, x.sharding.spec, _logical_device_ids=ids)
    )

  moved = [relabelled(x, dt) for x, dt in zip(leaves, dtypes)]
  out["move"] = [jax.jit(lambda x: x, out_shardings=s).lower(m) for m, s in zip(moved, global_sh)]
  return out
