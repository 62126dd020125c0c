"""Shardings of a model's parameters on a mesh (logical axes of the decoder + a rules table)."""

from __future__ import annotations

from aepo_jax.model._config import ModelConfig
from aepo_jax.model._functional import param_logical_axes, param_shapes
from aepo_jax.parallel import DEFAULT_RULES, logical_sharding


def param_shardings(config: ModelConfig, mesh, rules=None):
  """NamedSharding for every parameter: `param_logical_axes` mapped through `rules` (default DEFAULT_RULES)."""
  return logical_sharding(param_logical_axes(config), param_shapes(config), mesh, rules or DEFAULT_RULES)
