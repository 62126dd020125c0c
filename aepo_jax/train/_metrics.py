"""Metric writers behind one small interface: JSONL always, TensorBoard (tensorboardX) when enabled.

Names say what they are: `actor/entropy_mean`, `rollout/branches_per_prompt`, `tools/python_timeouts`,
`perf/tokens_per_s`. Distributions (token entropies, advantages) are logged as histograms, not only means.
Only process 0 writes; the other hosts of a pod get a no-op writer.

  writer = create_writer(workdir, config.metrics)
  writer.scalars(step, {"train/loss": 0.3})
  writer.histograms(step, {"actor/entropy": entropy_tokens})
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import shutil
import tempfile
import time
from typing import Iterable, Mapping, Optional

import numpy as np
from etils import epath

METRICS_FILE = "metrics.jsonl"
HISTOGRAMS_FILE = "histograms.jsonl"


class MetricWriter:
  """The interface; each method is a no-op here, so this class is also the writer of non-zero processes."""

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    pass

  def histograms(self, step: int, arrays: Mapping[str, np.ndarray], bins: int = 30) -> None:
    pass

  def flush(self) -> None:
    pass

  def close(self) -> None:
    self.flush()


def _finite_float(v) -> Optional[float]:
  try:
    f = float(np.asarray(v))
  except (TypeError, ValueError):
    return None
  return f if math.isfinite(f) else None


def histogram(values, bins: int = 30) -> dict:
  """Counts and edges of the finite values, plus summary statistics (JSON-ready)."""
  x = np.asarray(values, np.float64).ravel()
  x = x[np.isfinite(x)]
  if x.size == 0:
    return {"count": 0}
  counts, edges = np.histogram(x, bins=bins)
  return {
    "count": int(x.size),
    "mean": float(x.mean()),
    "std": float(x.std()),
    "min": float(x.min()),
    "max": float(x.max()),
    "p50": float(np.median(x)),
    "counts": counts.tolist(),
    "edges": edges.tolist(),
  }


class JsonlWriter(MetricWriter):
  """One JSON object per line: {"step": s, "time": t, name: value, ...}; non-finite values become null.

  Local files are appended to. On gs:// (no append) lines are buffered and the file rewritten on flush.
  """

  def __init__(self, workdir: str):
    self._dir = epath.Path(workdir)
    self._dir.mkdir(parents=True, exist_ok=True)
    self._remote = str(workdir).startswith("gs://")
    self._pending: dict[str, list[str]] = {METRICS_FILE: [], HISTOGRAMS_FILE: []}
    self._written: dict[str, list[str]] = {}

  def _add(self, name: str, record: dict):
    self._pending[name].append(json.dumps(record, sort_keys=True))

  def scalars(self, step, values):
    record = {"step": int(step), "time": time.time()}
    for k, v in values.items():
      record[k] = _finite_float(v)
    self._add(METRICS_FILE, record)

  def histograms(self, step, arrays, bins=30):
    for k, v in arrays.items():
      self._add(HISTOGRAMS_FILE, {"step": int(step), "name": k, **histogram(v, bins)})

  def flush(self):
    for name, lines in self._pending.items():
      if not lines:
        continue
      path = self._dir / name
      if self._remote:
        if name not in self._written:
          self._written[name] = path.read_text().splitlines() if path.exists() else []
        self._written[name] += lines
        path.write_text("\n".join(self._written[name]) + "\n")
      else:
        with open(os.fspath(path), "a") as f:
          f.write("\n".join(lines) + "\n")
      self._pending[name] = []


class TensorboardWriter(MetricWriter):
  """tensorboardX event files under `<logdir>/tb` (imported lazily: choosing JSONL never needs it).

  On a gs:// logdir the events go to a local staging directory and are copied to `<logdir>/tb` on flush (at most
  every `upload_every_s`) and on close. An event file that reaches `rotate_bytes` is closed, copied a last time
  and replaced by a new one, so a copy never re-sends more than that. The staging directory is removed on close,
  or at exit when the run dies before closing (then up to `upload_every_s` of events are lost).
  """

  def __init__(self, logdir: str, *, upload_every_s: float = 60.0, rotate_bytes: int = 16 << 20):
    self._remote = str(logdir).startswith("gs://")
    self._dest = epath.Path(logdir) / "tb"
    if self._remote:
      self._dir = tempfile.mkdtemp(prefix="aepo_jax_tb_")
      atexit.register(self.close)
    else:
      self._dir = os.path.join(logdir, "tb")
    self._upload_every_s, self._rotate_bytes = upload_every_s, rotate_bytes
    self._uploaded: dict[str, int] = {}  # file name -> size last copied
    self._last_upload, self._files, self._tb = time.monotonic(), 0, None
    self._open()

  def _open(self):
    from tensorboardX import SummaryWriter

    # The suffix keeps rotated files of the same second apart (tensorboardX names files by time and host).
    self._tb = SummaryWriter(logdir=self._dir, flush_secs=30, filename_suffix=f".{self._files}")
    self._files += 1

  def scalars(self, step, values):
    for k, v in values.items():
      f = _finite_float(v)
      if f is not None:
        self._tb.add_scalar(k, f, int(step))

  def histograms(self, step, arrays, bins=30):
    for k, v in arrays.items():
      x = np.asarray(v, np.float64).ravel()
      x = x[np.isfinite(x)]
      if x.size:
        self._tb.add_histogram(k, x, int(step), bins=bins)

  def _upload(self) -> None:
    """Copy every new or grown local event file to the bucket; drop closed files once copied."""
    for name in sorted(os.listdir(self._dir)):
      local = os.path.join(self._dir, name)
      size = os.path.getsize(local)
      if self._uploaded.get(name) != size:
        with open(local, "rb") as src, (self._dest / name).open("wb") as dst:
          shutil.copyfileobj(src, dst, 1 << 20)
        self._uploaded[name] = size
    self._last_upload = time.monotonic()

  def flush(self):
    self._tb.flush()
    if not self._remote or time.monotonic() - self._last_upload < self._upload_every_s:
      return
    try:
      # The staging directory holds only the open file: rotated ones are removed once copied.
      if any(os.path.getsize(os.path.join(self._dir, n)) >= self._rotate_bytes for n in os.listdir(self._dir)):
        self._tb.close()
        try:
          self._upload()
          for name in os.listdir(self._dir):
            os.remove(os.path.join(self._dir, name))
        finally:
          self._open()
      else:
        self._upload()
    except OSError as e:  # the bucket may be unreachable for a moment; the next flush copies again
      logging.getLogger("aepo_jax.train").warning("TensorBoard copy to %s failed: %s", self._dest, e)

  def close(self):
    if self._tb is None:
      return
    self._tb.close()
    self._tb = None
    if self._remote:
      atexit.unregister(self.close)
      try:
        self._upload()
      finally:
        shutil.rmtree(self._dir, ignore_errors=True)


class MultiWriter(MetricWriter):
  def __init__(self, writers: Iterable[MetricWriter]):
    self.writers = list(writers)

  def scalars(self, step, values):
    for w in self.writers:
      w.scalars(step, values)

  def histograms(self, step, arrays, bins=30):
    for w in self.writers:
      w.histograms(step, arrays, bins)

  def flush(self):
    for w in self.writers:
      w.flush()

  def close(self):
    for w in self.writers:
      w.close()


def create_writer(workdir: str, metrics_cfg=None, *, process_index: int = 0) -> MetricWriter:
  """JSONL (+ TensorBoard, `<workdir>/tb`, also on gs://) writers for process 0; a no-op MetricWriter elsewhere."""
  if process_index != 0:
    return MetricWriter()
  jsonl = True if metrics_cfg is None else metrics_cfg.get("jsonl", True)
  tb = False if metrics_cfg is None else metrics_cfg.get("tensorboard", False)
  writers: list[MetricWriter] = [JsonlWriter(workdir)] if jsonl else []
  if tb:
    writers.append(TensorboardWriter(workdir))
  return MultiWriter(writers)


def read_metrics(workdir: str, name: str = METRICS_FILE) -> list[dict]:
  """The records of a run's JSONL; of repeated steps (a resumed run) the last record wins."""
  path = epath.Path(workdir) / name
  if not path.exists():
    raise FileNotFoundError(f"{path} does not exist; is {workdir!r} the workdir of a run?")
  records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  if name != METRICS_FILE:
    return records
  by_key: dict[tuple, dict] = {}
  for r in records:  # one record per (step, set of keys): resumed runs re-log the steps after the checkpoint
    by_key[(r["step"], tuple(sorted(k for k in r if k != "time")))] = r
  return sorted(by_key.values(), key=lambda r: r["step"])


def progress(total: int, desc: str, *, initial: int = 0, enabled: bool = True):
  """A tqdm bar over steps (disabled off process 0 or by config.metrics.progress)."""
  from tqdm.auto import tqdm

  return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True)


# Dense bfloat16 peak FLOP/s per chip by device kind (vendor documentation), for MFU.
_PEAK_FLOPS = (
  ("v6", 918e12),
  ("v5p", 459e12),
  ("v5 lite", 197e12),
  ("v5e", 197e12),
  ("v4", 275e12),
  ("h200", 989e12),
  ("h100", 989e12),
  ("a100", 312e12),
)


def chip_peak_flops(device_kind: str) -> Optional[float]:
  """Peak dense bf16 FLOP/s of one chip of this kind (jax.devices()[0].device_kind), or None when unknown (CPU)."""
  kind = device_kind.lower()
  return next((f for k, f in _PEAK_FLOPS if k in kind), None)


def model_flops(model_cfg, tokens: float, seq_len: float, *, forward_passes: float) -> float:
  """Model FLOPs of `forward_passes` forward-equivalents over `tokens` tokens of rows of about `seq_len`: 2 FLOPs
  per matmul parameter and token (the input embedding is a lookup) plus causal attention (QK and PV over half the
  row on average). An update is 3 forward-equivalents (remat's recompute is not counted, as MFU conventions go)."""
  embed = model_cfg.vocab_size * model_cfg.hidden_size
  matmul = model_cfg.num_params - (0 if model_cfg.tie_word_embeddings else embed)
  attention = 4 * model_cfg.num_layers * model_cfg.num_heads * model_cfg.head_dim * seq_len / 2
  return forward_passes * tokens * (2 * matmul + attention)


class Throughput:
  """perf/ metrics of a phase: step time, model TFLOP/s, MFU (when the chip's peak is known), cumulative tokens
  and the estimated time to the end of the phase."""

  def __init__(self, total_steps: int, start_step: int, tokens_total: float = 0.0, peak_tflops: float = 0.0):
    import jax

    self.total, self.tokens_total = total_steps, float(tokens_total)
    self.peak = peak_tflops * 1e12 if peak_tflops else chip_peak_flops(jax.devices()[0].device_kind)
    self.chips = jax.device_count()
    self.start_step, self.started = start_step, time.perf_counter()

  def step(self, step: int, step_s: float, tokens: float, flops: float) -> dict:
    self.tokens_total += tokens
    out = {
      "perf/step_s": step_s,
      "perf/model_tflops": flops / max(step_s, 1e-9) / 1e12,
      "perf/tokens_total": self.tokens_total,
    }
    if self.peak:
      out["perf/mfu"] = flops / max(step_s, 1e-9) / (self.peak * self.chips)
    done = step - self.start_step
    if done > 0:
      out["perf/eta_s"] = (time.perf_counter() - self.started) / done * max(self.total - step, 0)
    return out


_COMPILE_EVENTS = (
  "/jax/core/compile/jaxpr_trace_duration",
  "/jax/core/compile/jaxpr_to_mlir_module_duration",
  "/jax/core/compile/backend_compile_duration",
)
_compile_clock = {"s": 0.0, "listening": False}


def compile_seconds() -> float:
  """Seconds this process has spent tracing, lowering and compiling JAX programs since the first call (a
  jax.monitoring listener, registered on that call)."""
  if not _compile_clock["listening"]:
    import jax.monitoring

    def on_duration(event, duration, **_):
      if event in _COMPILE_EVENTS:
        _compile_clock["s"] += duration

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    _compile_clock["listening"] = True
  return _compile_clock["s"]


class Timer:
  """Wall time of named phases within a step: `with timer("rollout"): ...` -> perf/rollout_s, and the part of it
  spent compiling (a program's first call with new shapes) -> perf/rollout_compile_s."""

  def __init__(self):
    self.times: dict[str, float] = {}
    compile_seconds()

  def __call__(self, name: str):
    timer = self

    class _Ctx:
      def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), compile_seconds()

      def __exit__(self, *exc):
        for key, spent in (
          (f"perf/{name}_s", time.perf_counter() - self.t0),
          (f"perf/{name}_compile_s", compile_seconds() - self.c0),
        ):
          timer.times[key] = timer.times.get(key, 0.0) + spent

    return _Ctx()

  def pop(self) -> dict[str, float]:
    out, self.times = self.times, {}
    return out
