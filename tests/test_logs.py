"""The command lines' log filter: this project's INFO lines, other libraries' warnings only (--verbose: all)."""

import logging
import os

from aepo_jax import logs


def _record(path, level, msg="m"):
  return logging.LogRecord("x", level, path, 1, msg, None, None)


def test_other_libraries_info_is_dropped_and_warnings_kept_unless_verbose():
  site = os.path.join("usr", "lib", "python3.11", "site-packages", "orbax", "checkpoint", "checkpoint_manager.py")
  own = os.path.join("work", "aepo_jax", "train", "_trainer.py")
  handler = logging.Handler()
  root = logging.getLogger()
  root.addHandler(handler)
  try:
    logs.setup()
    assert not handler.filter(_record(site, logging.INFO))
    assert handler.filter(_record(site, logging.WARNING))
    assert handler.filter(_record(own, logging.INFO))
    assert not handler.filter(_record(site, logging.WARNING, "Requested `tracked_metric`; did not provide metrics."))
    logs.setup(verbose=True)
    assert handler.filter(_record(site, logging.INFO))
  finally:
    root.removeHandler(handler)
