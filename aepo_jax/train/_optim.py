"""The Optax optimizer of the trainer, built from plain arguments (spec §1.5).

verl's actor defaults, which ARPO and AEPO run: AdamW, lr 1e-6, betas (0.9, 0.999), eps 1e-8, weight decay
0.01 on every parameter (torch AdamW over `model.parameters()`), gradient clipping at global norm 1.0, a
constant learning rate and no warm-up. The learning rate lives in the optimizer state
(`optax.inject_hyperparams`), so `current_lr(opt_state)` can report the value that was used.
"""

from __future__ import annotations

from typing import Optional

import optax

SCHEDULES = ("constant", "cosine", "linear")


def lr_schedule(
  learning_rate: float,
  *,
  schedule: str = "constant",
  warmup_steps: int = 0,
  total_steps: Optional[int] = None,
  min_lr_ratio: float = 0.0,
) -> optax.Schedule:
  """Linear warm-up from 0 over `warmup_steps` (torch/verl: step 0 has lr 0), then constant, cosine or
  linear decay to `min_lr_ratio * learning_rate` at `total_steps`."""
  if schedule not in SCHEDULES:
    raise ValueError(f"optimizer schedule={schedule!r} is unknown; choose one of {SCHEDULES}.")
  if learning_rate < 0:
    raise ValueError(f"optimizer learning_rate={learning_rate} must be >= 0.")
  if warmup_steps < 0:
    raise ValueError(f"optimizer warmup_steps={warmup_steps} must be >= 0.")
  if not 0.0 <= min_lr_ratio <= 1.0:
    raise ValueError(f"optimizer min_lr_ratio={min_lr_ratio} must lie in [0, 1].")
  if schedule == "constant":
    if warmup_steps == 0:
      return optax.constant_schedule(learning_rate)
    return optax.join_schedules(
      [optax.linear_schedule(0.0, learning_rate, warmup_steps), optax.constant_schedule(learning_rate)], [warmup_steps]
    )
  if total_steps is None or total_steps <= warmup_steps:
    raise ValueError(
      f"optimizer schedule={schedule!r} needs total_steps > warmup_steps; got "
      f"total_steps={total_steps}, warmup_steps={warmup_steps}."
    )
  end = learning_rate * min_lr_ratio
  if schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup_steps, total_steps, end)
  decay = optax.linear_schedule(learning_rate, end, total_steps - warmup_steps)
  if warmup_steps == 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup_steps), decay], [warmup_steps])


def make_optimizer(
  learning_rate: float = 1e-6,
  *,
  weight_decay: float = 0.01,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  grad_clip: Optional[float] = 1.0,
  schedule: str = "constant",
  warmup_steps: int = 0,
  total_steps: Optional[int] = None,
  min_lr_ratio: float = 0.0,
) -> optax.GradientTransformation:
  """clip_by_global_norm(grad_clip) -> AdamW(schedule). `grad_clip=None` or 0 turns clipping off."""
  if grad_clip is not None and grad_clip < 0:
    raise ValueError(f"optimizer grad_clip={grad_clip} must be > 0 (or None to disable clipping).")
  if weight_decay < 0:
    raise ValueError(f"optimizer weight_decay={weight_decay} must be >= 0.")
  sched = lr_schedule(
    learning_rate, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio
  )
  adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
  clip = optax.clip_by_global_norm(grad_clip) if grad_clip else optax.identity()
  return optax.chain(clip, adamw)


def current_lr(opt_state):
  """The learning rate of the last update (inject_hyperparams state), or None for other optimizers."""
  hyper = optax.tree_utils.tree_get(opt_state, "hyperparams")
  if isinstance(hyper, dict) and "learning_rate" in hyper:
    return hyper["learning_rate"]
  return None
