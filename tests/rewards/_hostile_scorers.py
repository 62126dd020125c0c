"""Scorers that misbehave, for the RewardPool tests (module level so spawn workers can import them)."""

import os
import re
import time


def naive_regex_scorer(text: str) -> float:
  # Catastrophic backtracking: 2^n steps inside the C regex engine, where no signal can stop it.
  return 1.0 if re.fullmatch(r"(a+)+b", text) else 0.0


def slow_scorer(seconds: float) -> float:
  time.sleep(seconds)
  return 1.0


def crashing_scorer() -> float:
  os._exit(3)


def raising_scorer() -> float:
  raise ValueError("bad ground truth")


def memory_bomb_scorer() -> float:
  return float(len(bytearray(64 * 2**30)))  # 64 GiB: above the worker's address-space limit


def pid_scorer() -> int:
  return os.getpid()


def interval_scorer(seconds: float) -> list:
  """(pid, start, end) of a sleep, on the machine's monotonic clock (shared by every process)."""
  start = time.monotonic()
  time.sleep(seconds)
  return [os.getpid(), start, time.monotonic()]


def heavy_modules_loaded() -> list:
  import sys

  return sorted(m for m in ("jax", "torch", "tensorflow", "grain") if m in sys.modules)


def echo(x):
  return x


class Unpicklable:
  """An argument whose pickling raises `error` (an interruption arriving in the middle of a map)."""

  def __init__(self, error: BaseException):
    self.error = error

  def __reduce__(self):
    raise self.error
