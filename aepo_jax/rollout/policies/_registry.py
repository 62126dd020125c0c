"""Rollout policies by name, selected by config independently of the loss (style: "registered by name")."""

from __future__ import annotations

from aepo_jax.rollout.policies._base import PolicyConfig, RolloutPolicy

_POLICIES: dict = {}


def register_rollout_policy(name: str):
  """Class decorator: `@register_rollout_policy("arpo")`."""

  def wrap(cls):
    if name in _POLICIES:
      raise ValueError(f"rollout policy {name!r} is already registered (by {_POLICIES[name].__name__}).")
    cls.name = name
    _POLICIES[name] = cls
    return cls

  return wrap


def rollout_policy(name: str, config: PolicyConfig = PolicyConfig(), **overrides) -> RolloutPolicy:
  """A new policy object (it holds state across rollout calls: the faithful Q1 table)."""
  if name not in _POLICIES:
    raise ValueError(f"Unknown rollout policy {name!r}; registered: {sorted(_POLICIES)}.")
  return _POLICIES[name](config, **overrides)


def rollout_policy_names() -> list:
  return sorted(_POLICIES)
