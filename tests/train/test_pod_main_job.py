"""The whole main job on several JAX processes standing in for the hosts of a pod (gloo collectives, fake CPU
devices): `launch/tpu_pod.py --config=configs/testing/tiny_rl.py` runs SFT, evaluation and agentic RL with
real tools (sandboxed Python, local search) and checkpoints; every host rolls out its own prompts on its own
devices, and the trajectories of all hosts make one global batch. Here 4 hosts in v6e:4x4's device order with
unequal shares of prompts; 2 hosts of v5p:2x2x2 with resume are tests/parallel/test_slice_order.py's.
"""

import json
import os
import sys

import pytest

from aepo_jax.testing import free_port, run_processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  from aepo_jax.testing import tiny_tokenizer

  return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _launch(num_hosts, workdir, tok_dir, *overrides, timeout=900, topology=None):
  """Runs the main job as `num_hosts` processes; returns their logs (each asserted to have exited 0). topology: the
  TPU slice whose device order the processes stand in for (`--emulate_topology`, its chips per host each); else 2
  CPU devices per process, in process order."""
  port = free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
  if topology:
    env.pop("XLA_FLAGS")  # the launcher gives each process the slice's devices per host
    overrides += (f"--emulate_topology={topology}",)
  cmd = [
    sys.executable,
    os.path.join(ROOT, "launch", "tpu_pod.py"),
    "--config=configs/testing/tiny_rl.py",
    f"--config.workdir={workdir}",
    f"--config.model.tokenizer={tok_dir}",
    "--config.checkpoint.shared_workdir=True",
    *overrides,
    f"--coordinator_address=127.0.0.1:{port}",
    f"--num_processes={num_hosts}",
  ]
  results = run_processes([cmd + [f"--process_id={i}"] for i in range(num_hosts)], cwd=ROOT, env=env, timeout=timeout)
  logs = [out for _, out, _ in results]
  return logs


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _steps(workdir, phase):
  return sorted(int(p) for p in os.listdir(os.path.join(workdir, "checkpoints", phase)) if p.isdigit())


@pytest.mark.slow
def test_four_hosts_with_unequal_prompt_counts(tmp_path, tok_dir):
  """6 prompts per step over the 4 hosts of an emulated v6e:4x4 slice (4 devices each, in the slice's device order;
  training mesh fsdp 8 x tensor 2 over all 16) with 2, 2, 1, 1 prompts: hosts finish their rollouts at different
  times and hold different numbers of trajectories; the update still sees all 24, in mini-batches of 8 sequences,
  with ARPO's hard advantage attribution over every host's branching trees. (A restart on a slice-ordered mesh
  spanning the hosts is tests/parallel/test_slice_order.py's; bit-identical resumes on two processes are
  tests/train/test_resume_multiprocess.py's.)"""
  workdir = str(tmp_path / "run")
  flags = [
    "--config.mesh.data=1",
    "--config.mesh.fsdp=8",
    "--config.mesh.tensor=2",
    "--config.data.prompts_per_step=6",
    "--config.sft.steps=1",
    "--config.eval.before_rl=False",
    "--config.eval.batch_size=3",
    "--config.algo.attribution=hard",
  ]
  # the branching trees of all hosts, renumbered, reach the advantages
  logs = _launch(4, workdir, tok_dir, *flags, "--config.train.steps=1", topology="v6e:4x4")
  assert "meshes in the order of the TPU slice v6e:4x4: 4 hosts x 4 devices" in logs[0], logs[0][-3000:]
  records = _metrics(workdir)
  rl = [r for r in records if "reward/mean" in r]
  assert len(rl) == 1 and rl[0]["rollout/trajectories"] == 24, rl
  # the rollout tree statistics are those of all four hosts' rollouts, not host 0's 8 trajectories
  assert rl[0]["rollout/num_trajectories"] == 24, rl
  assert rl[0]["train/sequences"] == 8.0  # ppo_mini_batch_size 2 prompts x n 4, as on one host
  assert [r["step"] for r in records if "eval/suite/accuracy" in r] == [1]
  assert _steps(workdir, "rl") == [1]


def test_merge_hosts_renumbers_groups_and_parents():
  """Every host's trajectories in process order: group ids and parent rows offset by the earlier hosts', columns
  padded to the widest host (what gather_trajectories builds from the hosts' gathered arrays)."""
  import numpy as np

  from aepo_jax.train import _batch
  from test_rl_loop import _traj

  host0, host1 = _traj([2, 1], width=6), _traj([1, 2], width=8, offset=10)  # host 1: its row 2 branched from row 1
  traj = _batch.merge_hosts([host0, host1], pad_id=0)
  assert traj.tokens_bt.shape == (6, 8)
  np.testing.assert_array_equal(traj.tokens_bt[:3, :6], host0.tokens_bt)
  np.testing.assert_array_equal(traj.tokens_bt[:3, 6:], 0)  # host 0's rows padded with pad_id
  np.testing.assert_array_equal(traj.tokens_bt[3:], host1.tokens_bt)
  np.testing.assert_array_equal(traj.loss_mask_bt[:3, 6:], 0)
  assert traj.group_id_b.tolist() == [0, 0, 1, 2, 3, 3]  # host 1's groups after host 0's two
  assert traj.parent_b.tolist() == [-1, 0, -1, -1, -1, 4]  # host 1's row 2 branched from its row 1 = global row 4
  assert traj.fork_pos_b.tolist() == host0.fork_pos_b.tolist() + host1.fork_pos_b.tolist()


def test_merged_rollout_statistics_are_those_of_every_host():
  """Counts add up, maxima take the max, means are weighted by each host's trajectories."""
  from aepo_jax.train import _batch
  from test_rl_loop import _traj

  a = _traj([2, 1], width=6)
  b = _traj([1, 2], width=8, offset=10)
  a.stats = {
    "rollout/num_trajectories": 3.0,
    "rollout/forks_on_device": 1.0,
    "rollout/tree_depth_max": 1.0,
    "rollout/tree_depth_mean": 0.5,
    "rollout/rounds": 2.0,
  }
  b.stats = {
    "rollout/num_trajectories": 1.0,
    "rollout/forks_on_device": 0.0,
    "rollout/tree_depth_max": 3.0,
    "rollout/tree_depth_mean": 2.5,
    "rollout/rounds": 4.0,
    "rollout/probe_h_root": 1.5,
  }
  stats = _batch.merge_hosts([a, b], pad_id=0).stats
  assert stats == {
    "rollout/num_trajectories": 4.0,
    "rollout/forks_on_device": 1.0,
    "rollout/tree_depth_max": 3.0,
    "rollout/tree_depth_mean": (3 * 0.5 + 1 * 2.5) / 4,
    "rollout/rounds": 4.0,
    "rollout/probe_h_root": 1.5,  # only one host has it
  }
