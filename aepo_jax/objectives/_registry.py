"""Name -> function registries for policy losses, advantage estimators and KL estimators.

A config names its algorithm with a string (`policy_loss="aepo"`); the trainer looks the function up
here. New variants register themselves with a decorator, so adding one never edits the trainer.
"""

from __future__ import annotations

import inspect
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


class Registry:
  """A small name -> function table with aliases and helpful errors."""

  def __init__(self, kind: str):
    self.kind = kind
    self._fns: dict[str, Callable] = {}

  def register(self, *names: str) -> Callable[[F], F]:
    """Decorator registering a function under one or more names (the first is canonical)."""
    if not names:
      raise ValueError(f"register a {self.kind} under at least one name")

    def decorator(fn: F) -> F:
      for name in names:
        known = self._fns.get(name)
        if known is not None and known is not fn:
          raise ValueError(
            f"{self.kind} {name!r} is already registered to {known.__module__}.{known.__name__}; pick another name"
          )
        self._fns[name] = fn
      return fn

    return decorator

  def get(self, name: str) -> Callable:
    try:
      return self._fns[name]
    except KeyError:
      raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None

  def names(self) -> list[str]:
    return sorted(self._fns)

  def defaults(self, name: str) -> dict:
    """Keyword-only hyperparameters of `name` and their defaults (what a config may override)."""
    sig = inspect.signature(self.get(name))
    return {p.name: p.default for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}


POLICY_LOSSES = Registry("policy loss")
ADVANTAGES = Registry("advantage estimator")
KL_ESTIMATORS = Registry("KL estimator")
OFF_POLICY = Registry("off-policy correction")

register_policy_loss = POLICY_LOSSES.register
register_advantage = ADVANTAGES.register
register_kl = KL_ESTIMATORS.register
register_off_policy = OFF_POLICY.register


def policy_loss(name: str) -> Callable:
  """`fn(log_prob, old_log_prob, advantages, mask, entropy=None, **hp) -> (loss, metrics)`."""
  return POLICY_LOSSES.get(name)


def advantage(name: str) -> Callable:
  """`fn(rewards_b, group_ids_b, mask_bt, **hp) -> advantages_bt` (zero where mask is zero)."""
  return ADVANTAGES.get(name)


def kl(name: str) -> Callable:
  """`fn(log_prob_bt, ref_log_prob_bt) -> kl_bt` per-token estimator."""
  return KL_ESTIMATORS.get(name)


def off_policy(name: str) -> Callable:
  """`fn(proximal_log_prob, behaviour_log_prob, mask, **hp) -> (weights_bt, mask_bt, metrics)`: per-token
  importance weights (stop-gradient) and the mask of tokens the loss keeps."""
  return OFF_POLICY.get(name)


def list_off_policy() -> list[str]:
  return OFF_POLICY.names()


def list_policy_losses() -> list[str]:
  return POLICY_LOSSES.names()


def list_advantages() -> list[str]:
  return ADVANTAGES.names()


def list_kl_estimators() -> list[str]:
  return KL_ESTIMATORS.names()


def policy_loss_defaults(name: str) -> dict:
  return POLICY_LOSSES.defaults(name)


def advantage_defaults(name: str) -> dict:
  return ADVANTAGES.defaults(name)
