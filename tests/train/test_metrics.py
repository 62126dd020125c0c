"""Metric writers (JSONL, TensorBoard), the reader used by plots, and launch/plot.py."""

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
  assert set(out) == {"perf/rollout_s"} and out["perf/rollout_s"] >= 0 and t.pop() == {}


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
    "overview.png",
  ):
    assert name in written
    with open(tmp_path / "plots" / name, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_puts_sft_then_rl_on_one_increasing_axis():
  """SFT steps 1..3 and RL steps 1..2 both log perf/tokens_per_s: on the plot's axis RL continues after SFT."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("plot", os.path.join(ROOT, "launch", "plot.py"))
  plot = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(plot)
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
