"""use_cpu_xla_flags: adds the XLA:CPU defaults, never overrides the user's own setting, and XLA accepts them."""

import os
import subprocess
import sys

import pytest

from aepo_jax.parallel import CPU_XLA_FLAGS, use_cpu_xla_flags


def test_adds_missing_flags_and_keeps_the_users():
  env = {}
  assert use_cpu_xla_flags(env) == " ".join(f"--{k}={v}" for k, v in CPU_XLA_FLAGS) == env["XLA_FLAGS"]
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  use_cpu_xla_flags(env)
  assert env["XLA_FLAGS"].startswith("--xla_force_host_platform_device_count=8 --xla_cpu_")
  for name, _ in CPU_XLA_FLAGS:
    mine = {"XLA_FLAGS": f"--{name}="}  # e.g. the user switched YNNPACK off entirely
    assert use_cpu_xla_flags(mine) == f"--{name}="
  assert use_cpu_xla_flags(dict(env)) == env["XLA_FLAGS"]  # idempotent


def test_xla_accepts_the_flags():
  """XLA aborts the process on an unknown flag: a fresh interpreter compiles and runs a dot with them."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  code = (
    "from aepo_jax.parallel import use_cpu_xla_flags; use_cpu_xla_flags(); import jax, jax.numpy as jnp; "
    "x = jnp.ones((64, 64)); print(float(jax.jit(lambda a: jax.nn.logsumexp(a @ a, -1).sum())(x)))"
  )
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert abs(float(out.stdout.split()[-1]) - 64 * (64 + 4.1588830833596715)) < 1e-2


def test_cpu_flags_stay_off_other_platforms(monkeypatch):
  """XLA:TPU and XLA:GPU reject unknown flags: on them the CPU flags are not set (and JAX_PLATFORMS is left)."""
  from aepo_jax.parallel import platform_is_cpu, use_cpu_xla_flags

  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  monkeypatch.setenv("JAX_PLATFORMS", "tpu")
  assert not platform_is_cpu()
  assert use_cpu_xla_flags() == "--xla_force_host_platform_device_count=8"
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert platform_is_cpu() and "xla_cpu_experimental_ynn_fusion_type" in use_cpu_xla_flags()
  monkeypatch.delenv("JAX_PLATFORMS")
  monkeypatch.setenv("TPU_WORKER_ID", "0")  # a Cloud TPU VM's marker, before JAX starts
  assert not platform_is_cpu()


def test_fast_compile_switch():
  """AEPO_JAX_CPU_FAST_COMPILE=1 adds LLVM optimisation level 0 (a value the user set stays), 0 or unset adds
  nothing, anything else is an error naming the variable; without_cpu_fast_compile takes it back out."""
  from aepo_jax.parallel._xla_flags import FAST_COMPILE_ENV, without_cpu_fast_compile

  off = use_cpu_xla_flags({FAST_COMPILE_ENV: "0"})
  assert "xla_backend_optimization_level" not in off and use_cpu_xla_flags({}) == off
  env = {FAST_COMPILE_ENV: "1", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  on = use_cpu_xla_flags(env)
  assert on.split() == ["--xla_force_host_platform_device_count=8", *off.split(), "--xla_backend_optimization_level=0"]
  assert use_cpu_xla_flags({FAST_COMPILE_ENV: "1", "XLA_FLAGS": "--xla_backend_optimization_level=2"}).startswith(
    "--xla_backend_optimization_level=2 "
  ) and "level=0" not in use_cpu_xla_flags({FAST_COMPILE_ENV: "1", "XLA_FLAGS": "--xla_backend_optimization_level=2"})
  assert without_cpu_fast_compile(env)["XLA_FLAGS"].split() == [
    "--xla_force_host_platform_device_count=8",
    *off.split(),
  ]
  assert env[FAST_COMPILE_ENV] == "0" and use_cpu_xla_flags(env) == env["XLA_FLAGS"]
  with pytest.raises(ValueError, match="AEPO_JAX_CPU_FAST_COMPILE='fast' is not a switch: set it to 1"):
    use_cpu_xla_flags({FAST_COMPILE_ENV: "fast"})
