"""Loads a script of bench/ as a module for its tests (the scripts are not a package)."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load(name: str):
  """bench/NAME.py as module NAME (registered in sys.modules: dataclasses look their module up)."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  sys.modules[name] = mod
  spec.loader.exec_module(mod)
  return mod
