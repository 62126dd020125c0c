"""Log levels for the command lines: this project's INFO lines, other libraries' warnings only.

  from aepo_jax import logs
  logs.setup(verbose=False)   # in a launcher's main(), before anything logs

Orbax logs ~30 INFO lines at every save and load, bm25s one per index, optax one for a constant schedule; they
bury the lines that matter (phase, step, result). `verbose=True` (each launcher's `--verbose`) shows everything.
Standard library only: every launcher can call it before importing jax.
"""

from __future__ import annotations

import logging
import os

_OWN = (os.sep + "aepo_jax" + os.sep, os.sep + "launch" + os.sep, os.sep + "bench" + os.sep)

# Third-party warnings that say nothing to act on in this project's use of the library.
_EXPECTED_WARNINGS = (
  # Orbax: a step saved without an evaluation carries no metric; the keep policy keeps such steps by design.
  "Requested `tracked_metric`; did not provide metrics.",
)


class _OwnInfoOnly(logging.Filter):
  """INFO and below from this project's files; WARNING and above from everyone, less the expected ones."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= logging.WARNING:
      return not any(text in record.getMessage() for text in _EXPECTED_WARNINGS)
    return any(part in (record.pathname or "") for part in _OWN)


_FILTER = _OwnInfoOnly()


def setup(verbose: bool = False) -> None:
  """Root logger at INFO; unless `verbose`, every handler drops other libraries' INFO/DEBUG records."""
  root = logging.getLogger()
  root.setLevel(logging.INFO)
  for handler in root.handlers:
    if verbose:
      handler.removeFilter(_FILTER)
    else:
      handler.addFilter(_FILTER)
