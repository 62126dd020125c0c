"""aepo_jax.viz: the numbers behind the notebooks' figures (gradient weights, tree layout, curves)."""
import json

import numpy as np
import pytest

from aepo_jax import viz
from aepo_jax.rollout import Trajectories


def test_gradient_weights_match_the_documented_table():
  # docs/objectives.md: ∂ℓ/∂logπ = −F·A; F = r inside the trust region, the clipped values per loss outside.
  r = np.array([0.5, 0.9, 1.1, 1.5, 3.5, 6.0])
  a = np.array([1.0, -1.0])
  w = {n: viz.token_gradient_weights(n, r[None, :], a[:, None], **hp)
       for n, hp in [("ppo", {}), ("gppo", {}), ("cispo", {}), ("aepo", {"entropy_advantage_coef": 0.0})]}
  tol = dict(rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(w["ppo"], [[0.5, 0.9, 1.1, 0, 0, 0], [0, -0.9, -1.1, -1.5, 0, 0]], **tol)
  np.testing.assert_allclose(w["aepo"], [[0.5, 0.9, 1.1, 1.2, 1.2, 1.2], [0, -0.9, -1.1, -1.5, 0, 0]], **tol)
  np.testing.assert_allclose(w["gppo"], [[0.5, 0.9, 1.1, 1.28, 1.28, 1.28], [-0.8, -0.9, -1.1, -1.5, -3.5, -6]],
                             **tol)
  np.testing.assert_allclose(w["cispo"], [[0.5, 0.9, 1.1, 1.5, 3.5, 5.0], [-0.5, -0.9, -1.1, -1.5, -3.5, -5.0]],
                             **tol)


def test_gradient_weights_entropy_advantage_and_bad_ratio():
  h = np.array([0.0, 1.0, 2.5])
  w = viz.token_gradient_weights("aepo", 1.0, 2.0, entropy=h, entropy_mean=1.0, entropy_std=0.5)
  np.testing.assert_allclose(w, 2.0 * (1 + 0.2 * (h - 1.0) / 0.5), rtol=1e-6)  # spec §2.3, a = 0.2
  with pytest.raises(ValueError, match="ratio must be > 0"):
    viz.token_gradient_weights("ppo", np.array([0.0, 1.0]), 1.0)
  with pytest.raises(ValueError, match="unknown policy loss"):
    viz.token_gradient_weights("nope", 1.0, 1.0)


def test_gradient_figures_have_one_panel_per_loss_and_advantage():
  r = np.linspace(0.1, 4, 9)
  w = {n: viz.token_gradient_weights(n, r[None, :], np.array([1.0, -1.0])[:, None]) for n in ("ppo", "gppo")}
  fig = viz.plot_gradient_weights(w, r, clip_lines={"ppo": [0.8, 1.2, 3.0]})
  assert len(fig.axes) == 4 and [ax.get_title() for ax in fig.axes[:2]] == ["ppo", "gppo"]
  with pytest.raises(ValueError, match="expected"):
    viz.plot_gradient_weights({"ppo": w["ppo"][:1]}, r)
  assert len(viz.plot_gradient_heatmaps(w, r, [1.0, -1.0]).axes) == 3  # two panels and the colour bar


def _tree():
  """Prompt 0: a global row, a branch of it forked after a tool result, a refill; prompt 1: one global row."""
  p = 3
  rows = [  # response loss masks (0 = tool result)
      [1, 1, 1, 0, 0, 1, 1],
      [1, 1, 1, 0, 0, 1, 1, 1, 1],
      [1, 1],
      [1, 1, 1],
  ]
  t = p + max(map(len, rows))
  loss = np.zeros((4, t), np.int32)
  for b, m in enumerate(rows):
    loss[b, p:p + len(m)] = m
  return Trajectories(
      tokens_bt=np.zeros((4, t), np.int32), prompt_len_b=np.full(4, p, np.int32),
      response_len_b=np.array([len(m) for m in rows], np.int32), loss_mask_bt=loss,
      attention_mask_bt=(loss > 0).astype(np.int32), sampler_logprob_bt=np.zeros((4, t), np.float32),
      sampler_entropy_bt=np.zeros((4, t), np.float32), group_id_b=np.array([0, 0, 0, 1], np.int32),
      parent_b=np.array([-1, 0, -1, -1], np.int32), fork_pos_b=np.array([-1, p + 5, -1, -1], np.int32),
      num_tool_calls_b=np.array([1, 1, 0, 0], np.int32), stop_reason_b=["eos"] * 4, response_text=[""] * 4,
      kind_b=["global", "branch", "refill", "global"], stats={})


def test_rollout_tree_draws_segments_and_fork_links():
  traj = _tree()
  assert viz.most_branched_group(traj) == 0
  fig = viz.plot_rollout_tree(traj, rewards=np.array([1.0, 0.0, -1.0, 0.5]))
  ax = fig.axes[0]
  segments = [(tuple(l.get_xdata()), tuple(l.get_ydata()), l.get_linewidth()) for l in ax.lines if len(l.get_xdata())]
  # Row 0: model [0,3), tool [3,5), model [5,7); the branch (y=1) starts at response offset 5, linked to row 0.
  assert ((0, 3), (0, 0), 5) in segments and ((3, 5), (0, 0), 2) in segments and ((5, 7), (0, 0), 5) in segments
  assert ((5, 9), (1, 1), 5) in segments
  assert ((5, 5), (0, 1), 1.2) in segments
  assert not any(x[0] < 5 and y == (1, 1) for x, y, _ in segments), "a branch must not redraw its parent's prefix"
  assert [t.get_text() for t in ax.texts] == ["eos r=1.00", "eos r=0.00", "eos r=-1.00"]
  with pytest.raises(ValueError, match="group 7 is not in this batch"):
    viz.plot_rollout_tree(traj, 7)


def test_curves_last_record_of_a_step_wins_and_missing_keys_are_named(tmp_path):
  lines = [{"step": 1, "time": 0, "sft/nll": 2.0}, {"step": 1, "time": 0, "reward/mean": 0.1},
           {"step": 2, "time": 0, "reward/mean": 0.2}, {"step": 2, "time": 1, "reward/mean": 0.3}]
  (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
  fig = viz.plot_curves(tmp_path, ["reward/mean", "sft/nll"])
  reward = fig.axes[0].lines[0]
  assert list(reward.get_xdata()) == [1, 2] and list(reward.get_ydata()) == [0.1, 0.3]
  with pytest.raises(KeyError, match="actor/entropy_mean"):
    viz.plot_curves(tmp_path / "metrics.jsonl", ["actor/entropy_mean"])
  with pytest.raises(FileNotFoundError, match="workdir"):
    viz.plot_curves(tmp_path / "nowhere", ["reward/mean"])
