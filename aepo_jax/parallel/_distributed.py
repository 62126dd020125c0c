"""Multi-host start-up and placing a parameter tree onto a mesh."""
from __future__ import annotations

import logging
import os
from typing import Optional

import jax

from aepo_jax.parallel._mesh import DEFAULT_RULES, logical_sharding


def _cluster_detected() -> bool:
  """Environment markers of a multi-process launch that `jax.distributed.initialize()` can auto-configure."""
  if "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):  # multi-host Cloud TPU VM / GKE
    return True
  for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
    if int(os.environ.get(key, "1") or 1) > 1:
      return True
  return False


def initialize_distributed(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
                           process_id: Optional[int] = None, **kwargs) -> tuple[int, int]:
  """Starts `jax.distributed` when this is a multi-process run; a no-op on a single host.

  Explicit arguments (or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID) start it as given; a
  detected cluster (multi-host TPU, SLURM, MPI) starts it with auto-detection. Call it before any other jax
  call touches the devices. Returns (process_index, process_count).
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
    if (jax.config.jax_platforms or "").startswith("cpu"):  # CPU collectives across processes go through gloo
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, **kwargs)
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
