"""bench/pod_pipeline.py's discrete-event model on hand-checkable cases, and its command on the shipped pod config."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _module():
  spec = importlib.util.spec_from_file_location("pod_pipeline_model", os.path.join(ROOT, "bench", "_pipeline_model.py"))
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod  # dataclasses look their module up
  spec.loader.exec_module(mod)
  return mod


MOD = _module()


def test_a_host_decodes_in_lock_step_and_refills_freed_slots():
  c = MOD.Costs(slots=2, per_host=3, weights_s=1.0, kv_s_per_token=0.0, update_s=0.0, weight_bytes=0, prompt_len=0)
  host = MOD.Host(c)
  host.queue = [1, 3, 2]  # slots take 1 and 3; after one step the first frees and takes 2
  t, done = host.run_until(10)
  assert (t, done) == (3.0, 3)  # steps: {1,3} -> {3->2 left, 2} -> {1, 1} -> done
  assert host.busy_slot_s == 6.0 and host.total_slot_s == 6.0  # every slot busy every step


def test_partial_rollouts_remove_the_tail_and_never_lose_throughput():
  """With a long tail (p90 at the cap), the synchronous step waits for its longest trajectory while most slots idle;
  partial rollouts keep the slots busy: more trajectories per second, higher occupancy."""
  c = MOD.Costs(slots=8, per_host=8, weights_s=0.01, kv_s_per_token=0.0, update_s=1.0, weight_bytes=0, prompt_len=0)
  kw = dict(hosts=1, steps=30, cap=512, split_frac=0.5, transfer_gbps=1.0, median=0.1, p90=0.9)
  sync = MOD.simulate("synchronous", c, rng=np.random.default_rng(0), **kw)
  partial = MOD.simulate("partial", c, rng=np.random.default_rng(0), **kw)
  assert partial["trajectories_per_s"] > 1.3 * sync["trajectories_per_s"]
  assert sync["slot_occupancy"] < 0.6 < 0.95 < partial["slot_occupancy"]


def test_the_command_prints_every_mode_for_aepo_gaia():
  out = subprocess.run(
    [sys.executable, os.path.join(ROOT, "bench", "pod_pipeline.py"), "--config=configs/aepo_gaia.py", "--steps=4"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert out.returncode == 0, out.stderr[-2000:]
  rows = json.loads(out.stdout.strip().splitlines()[-1])
  assert [r["mode"] for r in rows] == ["synchronous", "partial", "split 25%", "split 50%"]
  assert all(r["step_s"] > 0 and 0 < r["slot_occupancy"] <= 1 for r in rows)
  assert "(estimates)" in out.stdout
