"""XLA:CPU settings this code is tuned for, applied through XLA_FLAGS before JAX creates its CPU backend.

`--xla_cpu_experimental_ynn_fusion_type=individual_dot`: XLA:CPU hands single dots to YNNPACK (as by default) but
keeps element-wise and reduction fusions in its own emitters. YNNPACK's reduce fusions were the slow part of the
log-softmax over the vocabulary (one [8, 256] reduce of exp(z) took 0.7 s of a 5.4 s LM-head forward + backward;
4.3 s with this flag) and of the update step as a whole (SmolLM2-135M SFT step 8 x 256: 27.4 -> 25.5 s, same
losses). Flags only change XLA:CPU compilation; TPU and GPU programs are unaffected. A flag the user already
set in XLA_FLAGS is left as it is.

`AEPO_JAX_CPU_FAST_COMPILE=1` adds `--xla_backend_optimization_level=0`: XLA:CPU compiles without LLVM's
optimisations, so compiles are faster and the programs slower. For work where compiling dominates (the test suite's
tiny models; docs/performance.md, "Compile time against run time"), never for a run whose speed matters.
"""

from __future__ import annotations

import logging
import os
from typing import MutableMapping, Optional

CPU_XLA_FLAGS = (("xla_cpu_experimental_ynn_fusion_type", "individual_dot"),)
FAST_COMPILE_ENV = "AEPO_JAX_CPU_FAST_COMPILE"
_FAST_COMPILE_FLAGS = (("xla_backend_optimization_level", "0"),)


def cpu_fast_compile(env: Optional[MutableMapping[str, str]] = None) -> bool:
  """Whether env (default os.environ) asks for fast XLA:CPU compiles (AEPO_JAX_CPU_FAST_COMPILE)."""
  raw = (os.environ if env is None else env).get(FAST_COMPILE_ENV, "").strip().lower()
  if raw in ("", "0", "false", "no", "off"):
    return False
  if raw in ("1", "true", "yes", "on"):
    return True
  raise ValueError(
    f"{FAST_COMPILE_ENV}={raw!r} is not a switch: set it to 1 (XLA:CPU compiles without LLVM optimisation: faster "
    "compiles, slower programs) or 0 / unset (the default)"
  )


def without_cpu_fast_compile(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
  """env with fast compiles off: AEPO_JAX_CPU_FAST_COMPILE=0 and its flag taken out of XLA_FLAGS (for a child
  process that should compile as users run, in a test session that compiles fast)."""
  env[FAST_COMPILE_ENV] = "0"
  drop = {f"--{name}={value}" for name, value in _FAST_COMPILE_FLAGS}
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f not in drop)
  return env


def use_cpu_xla_flags(env: Optional[MutableMapping[str, str]] = None) -> str:
  """Appends CPU_XLA_FLAGS (and, with AEPO_JAX_CPU_FAST_COMPILE=1, `--xla_backend_optimization_level=0`) to
  env['XLA_FLAGS'] (default os.environ) where the user has not set them; returns the new value. Takes effect only
  if called before JAX's CPU backend starts (before the first array or jit call); later it logs a warning and
  changes nothing that is already compiled.

  Only when JAX will run on the CPU (`platform_is_cpu`: JAX_PLATFORMS says cpu, or no TPU or GPU is visible): the
  flags are unknown to XLA:TPU and XLA:GPU. On the CPU it also sets JAX_PLATFORMS=cpu unless set, so an installed
  libtpu (the [tpu] extra, for launch/compile.py) does not make JAX probe for a TPU first."""
  env = os.environ if env is None else env
  from aepo_jax.parallel._distributed import platform_is_cpu

  if env is os.environ and not platform_is_cpu():
    return env.get("XLA_FLAGS", "")
  if env is os.environ:
    env.setdefault("JAX_PLATFORMS", "cpu")
  flags = env.get("XLA_FLAGS", "")
  for name, value in CPU_XLA_FLAGS + (_FAST_COMPILE_FLAGS if cpu_fast_compile(env) else ()):
    if f"--{name}=" not in flags and f"--{name} " not in f"{flags} ":
      flags = f"{flags} --{name}={value}".strip()
  env["XLA_FLAGS"] = flags
  if env is os.environ and _backend_started():
    logging.warning(
      "aepo_jax: JAX's backend is already running; XLA_FLAGS=%r applies to new processes only. "
      "Call use_cpu_xla_flags() before the first JAX computation.",
      flags,
    )
  return flags


def _backend_started() -> bool:
  try:
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())
  except Exception:  # noqa: BLE001 - a private helper; when it moves, skip the warning
    return False
