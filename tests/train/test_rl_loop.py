"""The RL phase of the trainer end to end on a tiny random model with the real engine, tools and rewards, plus
the pieces of the RL step that the tiny run cannot exercise on its own (DAPO group selection, group concat).

A random model never answers correctly, so the learning itself is shown by the embedded default
(configs/cpu_default.py); here every branch of the loop has to run and write what it promises.
"""

import json
import os

import jax
import numpy as np
import pytest

from aepo_jax.rollout import Trajectories, concat_groups
from aepo_jax.train import load_config, read_metrics, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "testing", "tiny_rl.py")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  from aepo_jax.testing import tiny_tokenizer

  return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _config(tmp_path, tok_dir, **overrides):
  return load_config(
    CONFIG, overrides={"workdir": str(tmp_path / "run"), "model.tokenizer": tok_dir, **overrides}, num_devices=None
  )


# One uninterrupted run serves two tests: its outputs, and the reference for the resumed run.
RESUME_OVERRIDES = {
  "train.steps": 3,
  "checkpoint.keep": 5,
  "algo.kl.name": "k3",
  "algo.kl.coef": 0.5,
  "eval.pass_k": 2,
}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tok_dir):
  config = _config(tmp_path_factory.mktemp("full"), tok_dir, **RESUME_OVERRIDES)
  return config, run(config)


@pytest.mark.slow
def test_sft_then_aepo_writes_every_metric_and_checkpoint(full_run):
  config, summary = full_run
  workdir = config.workdir
  assert summary["rl/steps"] == 3 and summary["sft/steps"] == 2
  assert "before_rl/eval/accuracy" in summary and "after_rl/eval/accuracy" in summary
  for phase, step in (("before_rl", 0), ("after_rl", 3)):  # eval.pass_k = 2: two sampled answers per question
    p1, p2 = summary[f"{phase}/eval/pass@1"], summary[f"{phase}/eval/pass@2"]
    assert 0.0 <= p1 <= p2 <= 1.0
    answers = [json.loads(line) for line in open(f"{workdir}/eval/{phase}_{step}_pass2.jsonl")]
    assert sorted({a["sample"] for a in answers}) == [0, 1] and len(answers) == 2 * len({a["id"] for a in answers})
  records = read_metrics(workdir)
  rl = [r for r in records if "reward/mean" in r]
  assert [r["step"] for r in rl] == [1, 2, 3]
  for key in (
    "reward/mean",
    "rollout/trajectories",
    "rollout/tool_calls_mean",
    "actor/pg_loss",
    "train/grad_norm",
    "mismatch/logprob_abs_diff_mean",
    "perf/tokens_per_s",
    "perf/rollout_s",
    "perf/update_s",
  ):
    assert all(key in r and np.isfinite(r[key]) for r in rl), (key, sorted(rl[0]))
  assert all(r["rollout/trajectories"] == 2 * 4 for r in rl)  # prompts_per_step x n
  evals = [r for r in records if "eval/suite/accuracy" in r]
  assert len(evals) == 2 and all("eval/suite/tool_calls" in r for r in evals)
  # Every answer of both evaluations kept, to read back: the records the accuracy was computed from.
  for name, ev in zip(("before_rl_0.jsonl", "after_rl_3.jsonl"), evals):
    with open(os.path.join(workdir, "eval", name)) as f:
      answers = [json.loads(line) for line in f]
    assert answers and {"source", "response", "score", "reward"} <= set(answers[0]), sorted(answers[0])
    assert abs(np.mean([a["score"] for a in answers]) - ev["eval/suite/accuracy"]) < 1e-9
  steps = sorted(int(p) for p in os.listdir(os.path.join(workdir, "checkpoints", "rl")) if p.isdigit())
  assert steps == [1, 2, 3]
  jax.tree.map(lambda x: np.testing.assert_(np.all(np.isfinite(np.asarray(x)))), summary["params"])


@pytest.mark.slow
def test_dapo_filter_and_kl_in_reward_run(tmp_path, tok_dir):
  """DAPO dynamic sampling on a random model: every group's reward is the same (format error), so each step
  generates max_num_gen_batches batches and says it is underfilled; REINFORCE++ with the KL penalty in the
  reward: zero at step 1 (the reference is the start), non-zero once the policy moved; verl's dynamic
  micro-batches (rows reordered by `_verl_batching`)."""
  config = _config(
    tmp_path,
    tok_dir,
    **{
      "mode": "rl",
      "sft.enabled": False,
      "eval.before_rl": False,
      "eval.after_rl": False,
      "algo.loss": "dapo",
      "algo.entropy_advantage_coef": 0.0,
      "algo.filter_groups": True,
      "algo.filter_metric": "reward",
      "algo.max_num_gen_batches": 2,
      "algo.advantage": "reinforce_pp",
      "algo.kl.name": "k1",
      "algo.kl.coef": 0.1,
      "algo.kl.use_in_reward": True,
      "rollout.policy": "none",
      # verl's token-balanced micro-batches: the rows reordered, the KL-in-reward advantages with them
      "algo.aggregation": "verl",
      "algo.verl_dynamic_bsz": True,
      "algo.verl_world_size": 2,
    },
  )
  run(config)
  rl = [r for r in read_metrics(config.workdir) if "reward/mean" in r]
  assert [r["rollout/gen_batches"] for r in rl] == [2.0, 2.0]
  assert [r["rollout/filter_underfilled"] for r in rl] == [1.0, 1.0]
  assert [r["rollout/trajectories"] for r in rl] == [8.0, 8.0]
  assert all(r["train/verl_micro_batches"] >= 1 for r in rl)
  assert rl[0]["kl/reward_penalty_mean"] == 0.0
  assert rl[1]["kl/reward_penalty_mean"] != 0.0 and np.isfinite(rl[1]["kl/reward_penalty_mean"])


# ----------------------------------------------------------------------------------------------- pieces
def _traj(groups, width=6, offset=0):
  """Trajectories with `groups[g]` rows in group g; tokens encode (offset + row) so rows are traceable."""
  n = sum(groups)
  gid = np.repeat(np.arange(len(groups)), groups).astype(np.int32)
  tokens = np.tile(np.arange(width, dtype=np.int32), (n, 1)) + 100 * (offset + np.arange(n))[:, None]
  parent = np.full(n, -1, np.int32)
  start = np.cumsum([0] + list(groups))[:-1]
  for s, k in zip(start, groups):
    if k > 1:
      parent[s + 1] = s  # second row of each group branched from the first
  ones = np.ones((n, width), np.int32)
  return Trajectories(
    tokens_bt=tokens,
    prompt_len_b=np.full(n, 2, np.int32),
    response_len_b=np.full(n, width - 2, np.int32),
    loss_mask_bt=ones,
    attention_mask_bt=ones,
    sampler_logprob_bt=np.zeros((n, width), np.float32),
    sampler_entropy_bt=np.zeros((n, width), np.float32),
    group_id_b=gid,
    parent_b=parent,
    fork_pos_b=np.where(parent >= 0, 3, -1).astype(np.int32),
    num_tool_calls_b=np.zeros(n, np.int32),
    stop_reason_b=["eos"] * n,
    response_text=[f"row{offset + i}" for i in range(n)],
    kind_b=["global"] * n,
    stats={"first": 1.0},
  )


def test_concat_groups_renumbers_groups_and_remaps_parents():
  a, b = _traj([2, 2], width=5), _traj([3, 2], width=7, offset=10)
  out = concat_groups([(a, [1]), (b, [0, 1])], pad_id=-7)
  assert out.group_id_b.tolist() == [0, 0, 1, 1, 1, 2, 2]
  assert out.response_text == ["row2", "row3", "row10", "row11", "row12", "row13", "row14"]
  assert out.parent_b.tolist() == [-1, 0, -1, 2, -1, -1, 5]
  assert out.tokens_bt.shape == (7, 7)
  np.testing.assert_array_equal(out.tokens_bt[0], [200, 201, 202, 203, 204, -7, -7])  # right-padded
  assert out.loss_mask_bt[0].tolist() == [1] * 5 + [0, 0]
  with pytest.raises(ValueError, match="group 5"):
    concat_groups([(a, [5])], pad_id=0)


def test_dapo_generation_keeps_differing_groups_until_the_batch_is_full():
  """_generate with algo.filter_groups: batch 1 has one usable group of 2, batch 2 has both usable; the step
  takes the first 2 usable groups in order, with their own rewards. The rollout and reward are stand-ins:
  the test is about the selection."""
  from aepo_jax.train import _metrics
  from aepo_jax.train._rl import generate as _generate
  from aepo_jax.data._records import Example

  config = load_config(
    CONFIG,
    overrides={"algo.filter_groups": True, "algo.filter_metric": "reward", "algo.max_num_gen_batches": 5},
    num_devices=None,
  )
  batches = [[Example(f"q{i}", f"question {i}", ["1"], "test", "qa", {}) for i in (2 * k, 2 * k + 1)] for k in range(3)]
  loader = iter(batches)
  rewards = {0: [1, 1, 1, 1, 0, 1, 0, 0], 1: [0, 1, 1, 1, 1, 1, 0, 1]}
  calls = []

  def rollout(params, prompts, key):
    calls.append(prompts[0].id)
    return _traj([4, 4], offset=10 * len(calls))

  def reward_fn(traj, prompts):
    return np.asarray(rewards[len(calls) - 1], np.float32)

  traj, prompts, rewards_b, metrics = _generate(
    config, loader, rollout, reward_fn, None, jax.random.key(0), 0, _metrics.Timer()
  )
  assert calls == ["q0", "q2"]
  assert [p.id for p in prompts] == ["q1", "q2"]
  assert traj.group_id_b.tolist() == [0] * 4 + [1] * 4
  assert traj.response_text[:4] == ["row14", "row15", "row16", "row17"]
  np.testing.assert_array_equal(rewards_b, [0, 1, 0, 0, 0, 1, 1, 1])
  assert metrics["rollout/gen_batches"] == 2.0 and metrics["rollout/filter_underfilled"] == 0.0


@pytest.mark.slow
def test_rl_resume_with_kl_is_bit_identical(tmp_path, tok_dir, full_run):
  """SFT then RL with a KL loss; the RL checkpoints after step 1 are removed (a run killed after its first RL
  checkpoint) and the same command resumes: the final parameters equal the uninterrupted run's bit for bit,
  which needs the rollout RNG, the data iterator, the optimizer state and the KL reference (the SFT result,
  not the loaded model) all restored. The killed run is a copy of the uninterrupted run's work directory
  without its last two RL checkpoints (the same files a run killed after step 1 leaves)."""
  import shutil

  config = _config(tmp_path / "b", tok_dir, **RESUME_OVERRIDES, **{"eval.before_rl": False, "eval.after_rl": False})
  shutil.copytree(full_run[0].workdir, config.workdir)
  for step in ("2", "3"):
    shutil.rmtree(os.path.join(config.workdir, "checkpoints", "rl", step))
  resumed = run(config)
  assert resumed["rl/steps"] == 3 and "sft/final_nll" not in resumed  # SFT was not run again
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(full_run[1]["params"]), jax.device_get(resumed["params"]))
