"""ARPO's hard advantage attribution (spec §1.4): shared prefix tokens get the mean advantage of their sharers."""

import numpy as np
import pytest

from aepo_jax import objectives as obj


def _reference(adv_bt, mask_bt, parent_b, fork_b):
  """Direct definition: rows b, c share token t when both reach the same (row, t) by walking up the tree."""
  b_, t_ = adv_bt.shape

  def owner(b, t):
    while parent_b[b] >= 0 and t < fork_b[b]:
      b = parent_b[b]
    return b

  out = np.zeros_like(adv_bt)
  for t in range(t_):
    own = [owner(b, t) for b in range(b_)]
    for b in range(b_):
      if mask_bt[b, t]:
        sharers = [c for c in range(b_) if own[c] == own[b] and mask_bt[c, t]]
        out[b, t] = np.mean([adv_bt[c, t] for c in sharers])
  return out


def test_hand_made_tree():
  # rows: 0 root; 1 forked from 0 at 5; 2 forked from 1 at 8; 3 forked from 0 at 3; 4 another root
  parent = np.array([-1, 0, 1, 0, -1], np.int32)
  fork = np.array([-1, 5, 8, 3, -1], np.int32)
  a_b = np.array([1.0, -1.0, 2.0, 0.5, 3.0], np.float32)
  mask = np.ones((5, 12), np.int32)
  mask[:, :2] = 0  # the prompt
  mask[:3, 6] = 0  # a tool result inside the prefix rows 0-2 share
  adv = a_b[:, None] * mask
  out = np.asarray(obj.hard_attribution(adv, mask, parent, fork))
  np.testing.assert_allclose(out[:, :2], 0.0)
  np.testing.assert_allclose(out[:4, 2], 0.625)  # shared by 0, 1, 2, 3
  np.testing.assert_allclose(out[:3, 3:5], 2 / 3, rtol=1e-6)  # 3 left at 3: shared by 0, 1, 2
  np.testing.assert_allclose(out[3, 3:], 0.5)  # row 3's own tokens
  np.testing.assert_allclose(out[0, 5:], np.where(mask[0, 5:], 1.0, 0.0))  # row 0 alone from 5
  np.testing.assert_allclose(out[1:3, 5], 0.5)  # 1 and 2 share 5..7
  np.testing.assert_allclose(out[1:3, 6], 0.0)  # the tool result stays out of the loss
  np.testing.assert_allclose(out[1, 8:], -1.0)
  np.testing.assert_allclose(out[2, 8:], 2.0)
  np.testing.assert_allclose(out[4], adv[4])  # a tree of one: soft = hard


@pytest.mark.parametrize("seed", range(3))
def test_random_forest_matches_definition_and_keeps_the_sum(seed):
  rng = np.random.default_rng(seed)
  b_, t_ = 14, 20
  parent, fork = np.full(b_, -1, np.int32), np.full(b_, -1, np.int32)
  length = rng.integers(8, t_ + 1, b_)
  for b in range(1, b_):
    if rng.random() < 0.7:  # a branch of an earlier row, forked inside the parent's tokens
      p = int(rng.integers(0, b))
      parent[b], fork[b] = p, int(rng.integers(3, length[p] + 1))
      length[b] = max(length[b], fork[b])
  mask = (np.arange(t_)[None, :] < length[:, None]).astype(np.int32)
  mask[:, :3] = 0
  adv = rng.normal(size=(b_, t_)).astype(np.float32) * mask
  out = np.asarray(obj.hard_attribution(adv, mask, parent, fork))
  np.testing.assert_allclose(out, _reference(adv, mask, parent, fork), rtol=1e-5, atol=1e-6)
  # The copies of a shared token carry d·Â_shared in both forms: the unclipped surrogate is unchanged.
  owner = np.asarray(obj.shared_prefix_owner(parent, fork, t_))
  for key in set(zip(owner.ravel().tolist(), np.tile(np.arange(t_), b_).tolist())):
    sel = (owner == key[0]) & (np.arange(t_)[None, :] == key[1])
    np.testing.assert_allclose(out[sel].sum(), adv[sel].sum(), rtol=1e-5, atol=1e-5)


def test_shape_errors_name_the_inputs():
  with pytest.raises(ValueError, match="parent_b"):
    obj.hard_attribution(np.zeros((2, 4)), np.ones((2, 4)), np.array([-1]), np.array([-1]))
  assert obj.ATTRIBUTIONS == ("soft", "hard")


def test_config_key_selects_hard_attribution():
  from aepo_jax.train import _objective, base_config

  parent = np.array([-1, 0, -1, -1], np.int32)
  fork = np.array([-1, 4, -1, -1], np.int32)
  rewards, groups = np.array([1.0, 0.0, 0.5, 0.2], np.float32), np.array([0, 0, 1, 1], np.int32)
  mask = np.ones((4, 8), np.int32)
  c = base_config()
  soft = np.asarray(_objective.advantage_fn(c)(rewards, groups, mask))
  np.testing.assert_allclose(soft, np.asarray(obj.grpo_advantage(rewards, groups, mask)))
  c.algo.attribution = "hard"
  hard_fn = _objective.advantage_fn(c)
  with pytest.raises(ValueError, match=r"tree=\(traj.parent_b, traj.fork_pos_b\)"):
    hard_fn(rewards, groups, mask)
  hard = np.asarray(hard_fn(rewards, groups, mask, tree=(parent, fork)))
  np.testing.assert_allclose(hard[:2, :4], 0.0, atol=1e-6)  # rows 0 and 1 share 4 tokens: (Â + (-Â)) / 2
  np.testing.assert_allclose(hard[:, 4:], soft[:, 4:])
  np.testing.assert_allclose(hard[2:], soft[2:])
