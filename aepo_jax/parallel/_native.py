"""Building and registering this package's C++ XLA FFI kernels for CPU (`model/csrc`: decode matmul and
attention, training attention).

A kernel is compiled on first use with the system C++ compiler (`$CXX`, default g++; a few seconds) into
`~/.cache/aepo_jax/kernels` (`$AEPO_JAX_KERNEL_CACHE`), keyed by its source, the flags and the jaxlib version, and
its handlers are registered as XLA FFI targets for the CPU platform. The kernels need x86-64 with AVX2 and FMA;
`AEPO_JAX_CPU_KERNELS=0` turns all of them off. `$AEPO_JAX_KERNEL_CXXFLAGS` adds compiler flags, for example to check
the kernels' memory accesses with AddressSanitizer (a separate kernel cache keeps the normal builds):

  AEPO_JAX_KERNEL_CACHE=/tmp/kasan AEPO_JAX_KERNEL_CXXFLAGS="-fsanitize=address -fno-omit-frame-pointer -g -O1" \
  LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)" \
  ASAN_OPTIONS=detect_leaks=0 python -m pytest tests/model/test_cpu_decode.py

(libstdc++ preloaded too: without it ASan aborts in jaxlib's first C++ exception.) Any failure is reported as a
reason string, never raised: callers fall back to XLA's own ops and log why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

FLAGS = ("-O3", "-mavx2", "-mfma", "-std=c++17", "-shared", "-fPIC", "-w")
SHARED_INCLUDE = Path(__file__).parent / "csrc"  # aepo_cpu.h: helpers every kernel includes
log = logging.getLogger(__name__)


def kernel_cache_dir() -> Path:
  return Path(os.environ.get("AEPO_JAX_KERNEL_CACHE") or Path.home() / ".cache" / "aepo_jax" / "kernels")


def cpu_flags() -> set:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("flags"):
        return set(line.split(":", 1)[1].split())
  except OSError:
    pass
  return set()


def flags() -> tuple:
  """The compiler flags: FLAGS, then any in $AEPO_JAX_KERNEL_CXXFLAGS (later flags win, so `-O1` there lowers -O3)."""
  return FLAGS + tuple(os.environ.get("AEPO_JAX_KERNEL_CXXFLAGS", "").split())


def build(src: Path) -> Path:
  """Compiles `src` into the kernel cache (once per source, flags and jaxlib version) and returns the .so path."""
  import jax

  include = jax.ffi.include_dir()
  cxx = os.environ.get("CXX", "g++")
  headers = [h.read_bytes() for h in sorted(SHARED_INCLUDE.glob("*.h"))]
  key = hashlib.sha256(
    b"\0".join(
      [src.read_bytes(), *headers, " ".join((cxx,) + flags()).encode(), jax.__version__.encode(), str(include).encode()]
    )
  ).hexdigest()[:16]
  out_dir = kernel_cache_dir()
  so = out_dir / f"{src.stem}-{key}.so"
  if so.exists():
    return so
  out_dir.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
  os.close(fd)
  try:
    cmd = [cxx, *flags(), f"-I{include}", f"-I{SHARED_INCLUDE}", str(src), "-o", tmp]
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
      raise RuntimeError(f"no C++ compiler {cxx!r} on PATH (install g++ or set $CXX)") from None
    if proc.returncode != 0:
      raise RuntimeError(f"compiling {src.name} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
    os.replace(tmp, so)  # atomic: concurrent builders (test workers) never load a half-written file
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return so


def load(src: Path, targets: dict) -> dict:
  """Builds `src` and registers `targets` ({FFI target name: exported handler symbol}) for the CPU platform.
  Returns {"ok": bool, "reason": str, "path": str}."""
  if os.environ.get("AEPO_JAX_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
    return {"ok": False, "reason": "turned off by AEPO_JAX_CPU_KERNELS=0"}
  if platform.machine().lower() not in ("x86_64", "amd64"):
    return {"ok": False, "reason": f"needs x86-64 (this machine: {platform.machine()})"}
  missing = {"avx2", "fma"} - cpu_flags()
  if missing:
    return {"ok": False, "reason": f"the CPU lacks {sorted(missing)}"}
  try:
    import ctypes
    import jax

    so = build(src)
    lib = ctypes.cdll.LoadLibrary(str(so))
    for target, symbol in targets.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
  except Exception as e:  # noqa: BLE001 - any failure means: use XLA's ops instead, and say why
    return {"ok": False, "reason": f"{type(e).__name__}: {e}"}
  return {"ok": True, "reason": "", "path": str(so)}


class Library:
  """One kernel source, built and registered on first use (thread-safe); `available()` / `reason()` say whether
  it loaded and why not, and the first failure is logged once with `fallback` (what the caller does instead)."""

  def __init__(self, src: Path, targets: dict, what: str, fallback: str):
    self.src, self.targets, self.what, self.fallback = src, targets, what, fallback
    self._lock = threading.Lock()
    self._status: dict = {}

  def load(self) -> dict:
    return load(self.src, self.targets)

  def available(self) -> bool:
    with self._lock:
      if not self._status:
        self._status.update(self.load())
        if not self._status["ok"]:
          log.warning("%s unavailable (%s); %s.", self.what, self._status["reason"], self.fallback)
    return self._status["ok"]

  def reason(self) -> str:
    """Why the kernel is unavailable ('' when it is available)."""
    self.available()
    return self._status["reason"]
