"""Mesh (data, fsdp, tensor), the logical-axis rules table, and multi-host start-up.

  make_mesh(shape, devices=None)                         a Mesh over the axes MESH_AXES
  DEFAULT_RULES                                          logical axis -> mesh axis table
  logical_sharding(logical_specs, shapes, mesh, rules)   NamedShardings for a pytree
  shard_params(params, logical_axes, mesh, rules)        device_put a pytree onto those shardings
  initialize_distributed(...) -> (process_index, process_count)   jax.distributed for multi-host; no-op on one
  use_cpu_xla_flags()                                    the XLA:CPU flags this code is tuned for (before JAX starts)
"""
from aepo_jax.parallel._distributed import initialize_distributed, shard_params
from aepo_jax.parallel._mesh import DEFAULT_RULES, MESH_AXES, logical_sharding, logical_to_mesh, make_mesh
from aepo_jax.parallel._xla_flags import CPU_XLA_FLAGS, use_cpu_xla_flags
