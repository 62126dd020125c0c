"""Metric writers (JSONL, TensorBoard), the reader used by plots, and launch/plot.py."""

import functools
import glob
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from aepo_jax.train import JsonlWriter, Timer, create_writer, read_metrics
from aepo_jax.train._metrics import histogram

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_jsonl_scalars_histograms_and_nonfinite(tmp_path):
  w = JsonlWriter(str(tmp_path))
  w.scalars(1, {"actor/entropy_mean": np.float32(1.5), "train/loss": float("nan"), "perf/tokens_per_s": 10})
  w.histograms(1, {"actor/entropy": np.array([0.0, 1.0, 1.0, 2.0, np.inf])}, bins=2)
  w.flush()
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  rec = json.loads(lines[0])
  assert rec["step"] == 1 and rec["actor/entropy_mean"] == 1.5 and rec["train/loss"] is None
  assert rec["perf/tokens_per_s"] == 10.0
  h = json.loads((tmp_path / "histograms.jsonl").read_text())
  assert h["name"] == "actor/entropy" and h["count"] == 4 and h["counts"] == [1, 3]  # inf dropped
  assert h["edges"] == [0.0, 1.0, 2.0] and math.isclose(h["mean"], 1.0)


def test_histogram_matches_numpy():
  x = np.random.default_rng(0).standard_normal(1000)
  h = histogram(x, bins=7)
  counts, edges = np.histogram(x, bins=7)
  assert h["counts"] == counts.tolist() and np.allclose(h["edges"], edges)
  assert math.isclose(h["std"], float(x.std())) and histogram([]) == {"count": 0}


def test_read_metrics_keeps_the_last_record_of_a_resumed_step(tmp_path):
  w = JsonlWriter(str(tmp_path))
  for step, loss in [(1, 3.0), (2, 2.0), (3, 1.0), (2, 2.5), (3, 1.5), (4, 1.2)]:  # resumed after step 1
    w.scalars(step, {"train/loss": loss})
  w.scalars(4, {"eval/accuracy": 0.5})  # another record at the same step is kept
  w.flush()
  recs = read_metrics(str(tmp_path))
  assert [(r["step"], r.get("train/loss")) for r in recs] == [(1, 3.0), (2, 2.5), (3, 1.5), (4, 1.2), (4, None)]
  with pytest.raises(FileNotFoundError, match="workdir of a run"):
    read_metrics(str(tmp_path / "nope"))


def test_tensorboard_and_non_chief(tmp_path):
  from tensorboardX.event_file_writer import EventFileWriter  # noqa: F401  (the optional dependency)

  w = create_writer(str(tmp_path / "run"), {"jsonl": True, "tensorboard": True})
  w.scalars(3, {"reward/mean": 0.25})
  w.histograms(3, {"actor/entropy": np.linspace(0, 1, 50)})
  w.close()
  events = glob.glob(str(tmp_path / "run" / "tb" / "events.out.tfevents.*"))
  assert events and os.path.getsize(events[0]) > 100
  other = create_writer(str(tmp_path / "other"), {"jsonl": True, "tensorboard": True}, process_index=1)
  other.scalars(1, {"x": 1.0})
  other.close()
  assert not (tmp_path / "other").exists()  # only process 0 writes


def test_timer():
  t = Timer()
  with t("rollout"):
    sum(range(1000))
  with t("rollout"):
    pass
  out = t.pop()
  assert set(out) == {"perf/rollout_s", "perf/rollout_compile_s"} and out["perf/rollout_s"] >= 0 and t.pop() == {}
  assert out["perf/rollout_compile_s"] == 0.0  # nothing compiled in there


@functools.cache
def _load_plot_module():
  """launch/plot.py as a module, loaded once (its absl flags may be defined only once per process)."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("aepo_plot", os.path.join(ROOT, "launch", "plot.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_plot_renders_pngs(tmp_path):
  w = JsonlWriter(str(tmp_path))
  rng = np.random.default_rng(0)
  for step in range(1, 11):
    w.scalars(
      step,
      {
        "reward/mean": step / 10,
        "actor/entropy_mean": 1 - step / 20,
        "actor/pg_clipfrac": 0.1,
        "actor/ppo_kl": 1e-3,
        "train/grad_norm": 0.5,
        "rollout/branches_per_prompt": 2.0,
        "rollout/tool_calls_mean": 1.5,
        "tools/python_timeouts": 0,
        "rollout/slot_occupancy": 0.3,
        "rollout/occupancy_wall": 0.2,
        **{f"rollout/occupancy_t{10 * i:02d}": 0.5 - 0.05 * i for i in range(10)},
      },
    )
    w.histograms(step, {"actor/entropy": rng.gamma(2.0, 0.5, 200)})
  w.scalars(10, {"eval/accuracy": 0.4})
  w.flush()
  out = subprocess.run(
    [sys.executable, os.path.join(ROOT, "launch/plot.py"), f"--workdir={tmp_path}"],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=180,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  written = {os.path.basename(p) for p in out.stdout.split()}
  for name in (
    "reward.png",
    "accuracy.png",
    "entropy.png",
    "clip_fractions.png",
    "kl.png",
    "grad_norm.png",
    "branches.png",
    "tool_calls.png",
    "entropy_histogram.png",
    "slot_occupancy.png",
    "occupancy_profile.png",
    "overview.png",
  ):
    assert name in written
    with open(tmp_path / "plots" / name, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_puts_sft_then_rl_on_one_increasing_axis():
  """SFT steps 1..3 and RL steps 1..2 both log perf/tokens_per_s: on the plot's axis RL continues after SFT."""
  plot = _load_plot_module()
  records = [{"step": s, "sft/nll": 1.0, "sft/step": s, "perf/tokens_per_s": 10.0 * s} for s in (1, 2, 3)]
  records += [{"step": 0, "eval/accuracy": 0.1}]
  records += [{"step": s, "reward/mean": 0.5, "perf/tokens_per_s": 5.0 * s} for s in (1, 2)]
  xs, ys = plot.series(records, "perf/tokens_per_s")
  assert xs == [1, 2, 3, 4, 5] and ys == [10.0, 20.0, 30.0, 5.0, 10.0]
  assert plot.series(records, "eval/accuracy")[0] == [3]  # the evaluation before RL, at the end of SFT


from test_checkpoint_gcs import BUCKET, gcs_emulator  # noqa: E402,F401  (the emulator fixture)


def _events(data: bytes) -> list:
  """The Event protos of a TFRecord event file (length, crc, payload, crc)."""
  import struct

  from tensorboardX.proto import event_pb2

  out, i = [], 0
  while i < len(data):
    (n,) = struct.unpack("<Q", data[i : i + 8])
    out.append(event_pb2.Event.FromString(data[i + 12 : i + 12 + n]))
    i += 12 + n + 4
  return out


def _scalars(fs, prefix: str) -> dict:
  out = {}
  for path in sorted(fs.ls(prefix, refresh=True)):
    for e in _events(fs.cat(path)):
      for v in e.summary.value:
        if v.HasField("simple_value"):
          out[(v.tag, e.step)] = v.simple_value
  return out


def test_tensorboard_events_of_a_gs_workdir_land_in_the_bucket(gcs_emulator):
  """Events go to <workdir>/tb in the bucket: copied on flush (when upload_every_s has passed), rotated at
  rotate_bytes, and the last ones on close; the local staging directory is gone afterwards."""
  import fsspec

  from aepo_jax.train import TensorboardWriter

  fs = fsspec.filesystem("gs")
  w = create_writer(f"gs://{BUCKET}/tbrun", {"jsonl": True, "tensorboard": True})
  tb = next(x for x in w.writers if isinstance(x, TensorboardWriter))
  staging = tb._dir
  tb._upload_every_s, tb._rotate_bytes = 0.0, 400  # copy on every flush; a new file every few steps
  for step in range(1, 7):
    w.scalars(step, {"reward/mean": step / 10})
    w.histograms(step, {"actor/entropy": np.linspace(0, 1, 20)})
    w.flush()
    if step == 1:  # already in the bucket before close
      assert _scalars(fs, f"{BUCKET}/tbrun/tb")[("reward/mean", 1)] == pytest.approx(0.1)
  w.close()
  files = fs.ls(f"{BUCKET}/tbrun/tb", refresh=True)
  assert len(files) > 1 and all(os.path.basename(f).startswith("events.out.tfevents.") for f in files)
  got = _scalars(fs, f"{BUCKET}/tbrun/tb")
  assert {s: got[("reward/mean", s)] for s in range(1, 7)} == pytest.approx({s: s / 10 for s in range(1, 7)})
  assert not os.path.exists(staging)
  assert read_metrics(f"gs://{BUCKET}/tbrun")[-1]["reward/mean"] == pytest.approx(0.6)


def test_plot_lines_never_run_back_in_x_and_every_panel_numbers_steps_alike(tmp_path, monkeypatch):
  """A run as the trainer writes it: SFT steps 1..6 and RL steps 1..3 both log perf/* (and the RL records come
  after an evaluation at RL step 0), so sorting by the raw step interleaves the phases. Every drawn series must be
  strictly increasing in x, on one global step axis (RL step r at 6 + r) in every panel and in the histogram's
  legend; fractions get their own axis; evaluations are markers."""
  import matplotlib
  import matplotlib.axes

  matplotlib.use("Agg")
  w = JsonlWriter(str(tmp_path))
  for step in range(1, 7):
    w.scalars(step, {"sft/step": step, "sft/nll": 2.0 - step / 10, "perf/tokens_per_s": 100.0 + step})
  w.scalars(0, {"eval/accuracy": 0.1})
  rng = np.random.default_rng(0)
  for step in range(1, 4):
    w.scalars(
      step,
      {
        "reward/mean": step / 3,
        "reward/format_errors": 0.5 / step,
        "actor/entropy_mean": 1.0,
        "perf/tokens_per_s": 50.0 + step,
        "perf/rollout_s": 3.0,
      },
    )
    w.histograms(step, {"actor/entropy": rng.gamma(2.0, 0.5, 100)})
  w.scalars(3, {"eval/accuracy": 0.4})
  w.flush()

  drawn = []  # (label, xs, linestyle)
  real_plot = matplotlib.axes.Axes.plot

  def plot(self, *args, **kwargs):
    lines = real_plot(self, *args, **kwargs)
    for line in lines:
      drawn.append((line.get_label(), list(line.get_xdata()), line.get_linestyle(), self))
    return lines

  monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
  written = _load_plot_module().plot_run(str(tmp_path), str(tmp_path / "plots"))
  drawn = [(label, xs, ls, ax.get_title()) for label, xs, ls, ax in drawn]  # titles are set after the lines
  assert any(p.endswith("throughput.png") for p in written)
  curves = [(label, xs, ls, title) for label, xs, ls, title in drawn if title != "token entropy distribution"]
  assert curves
  for label, xs, _, _ in curves:
    assert all(b > a for a, b in zip(xs, xs[1:])), f"{label}: x runs back: {xs}"
  by_label = {}
  for label, xs, ls, title in curves:
    by_label.setdefault(label, []).append((xs, ls, title))
  assert by_label["perf/tokens_per_s"][0][0] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
  assert by_label["reward/mean"][0][0] == [7, 8, 9]
  assert all(ls == "None" for _, ls, _ in by_label["eval/accuracy"])  # markers only
  assert by_label["eval/accuracy"][0][0] == [6, 9]
  titles = {title for _, _, title in by_label["reward/format_errors"]}
  assert titles == {"format errors"}  # a fraction never shares the reward axis
  legend = [label for label, _, _, title in drawn if title == "token entropy distribution"]
  assert legend == ["step 7 (RL 1)", "step 8 (RL 2)", "step 9 (RL 3)"]


def test_timer_splits_out_the_compile_time_of_a_phase():
  """perf/NAME_compile_s: the part of a phase spent tracing and compiling (a program's first call with new shapes);
  the same call again compiles nothing."""
  import jax
  import jax.numpy as jnp

  timer = Timer()
  f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
  with timer("rollout"):
    f(jnp.ones((37, 5))).block_until_ready()
  first = timer.pop()
  with timer("rollout"):
    f(jnp.ones((37, 5))).block_until_ready()
  again = timer.pop()
  assert 0 < first["perf/rollout_compile_s"] <= first["perf/rollout_s"]
  assert again["perf/rollout_compile_s"] == 0.0 and again["perf/rollout_s"] > 0
