"""Mesh (data, fsdp, tensor), the logical-axis rules table, and multi-host start-up.

  make_mesh(shape, devices=None)                 a Mesh over the axes MESH_AXES
  DEFAULT_RULES                                  logical axis -> mesh axis table
  logical_sharding(logical_specs, shapes, mesh)  NamedShardings for a pytree
"""
from aepo_jax.parallel._mesh import DEFAULT_RULES, MESH_AXES, logical_sharding, logical_to_mesh, make_mesh
