"""Mesh (data, fsdp, tensor), the logical-axis rules table, and multi-host start-up.

make_mesh(shape, devices=None)                         a Mesh over the axes MESH_AXES (physical TPU topology order)
local_mesh(shape=(1, 1, -1))                           a Mesh over this process's own devices (its rollouts)
emulate_topology(slice) / emulated_topology()          CPU meshes in a TPU slice's device order (e.g. "v5p:2x2x2")
topology_devices(slice) / slice_hosts(slice)           a TPU slice's chips with their process_index / (hosts, chips each)
DEFAULT_RULES                                          logical axis -> mesh axis table
expert_parallel_rules(axis='fsdp', rules)              the table with MoE experts split over a batch axis
logical_sharding(logical_specs, shapes, mesh, rules)   NamedShardings for a pytree
shard_params(params, logical_axes, mesh, rules)        device_put a pytree onto those shardings
sharding_context(mesh, rules) / constrain(x, axes)     activation constraints by logical axis, active while tracing
current_mesh() / activation_spec(shape, axes)          the enclosing context's mesh / the spec `constrain` would use
current_platform()                                     that mesh's platform (a TPU slice compiled on CPU: 'tpu')
to_host_local(tree, local_shardings, dtype=None)       every host's own copy of global arrays (rollout weights)
lower_host_copy(tree, local_shardings, dtype, devices)  its programs lowered from abstract arrays (compile.py)
on_tpu_vm() / platform_is_cpu()                        what a launcher is about to run on (before JAX starts)
initialize_distributed(...) -> (process_index, process_count)   jax.distributed for multi-host; no-op on one
any_host(flag) / every_host(flag) / allgather_json(obj)  small agreements across processes (host values)
use_cpu_xla_flags()                                    the XLA:CPU flags this code is tuned for (before JAX starts)
use_compile_cache(setting, workdir) / compile_cache_stats()   a run's persistent compilation cache, and its hits
"""

from aepo_jax.parallel._compile_cache import (
  CompileCacheError,
  compile_cache_folder,
  compile_cache_stats,
  use_compile_cache,
)
from aepo_jax.parallel._distributed import (
  allgather_json,
  any_host,
  every_host,
  hosts_mesh,
  initialize_distributed,
  lower_host_copy,
  on_tpu_vm,
  platform_is_cpu,
  shard_params,
  to_host_local,
)
from aepo_jax.parallel._mesh import (
  DEFAULT_RULES,
  EMULATE_TOPOLOGY_ENV,
  MESH_AXES,
  activation_spec,
  constrain,
  current_mesh,
  current_platform,
  emulate_topology,
  emulated_topology,
  expert_parallel_rules,
  local_mesh,
  logical_sharding,
  logical_to_mesh,
  make_mesh,
  sharding_context,
  slice_hosts,
  topology_devices,
)
from aepo_jax.parallel._xla_flags import CPU_XLA_FLAGS, use_cpu_xla_flags
