"""consecutive_branch_share (rollout/policies/_stats.py): branches at tool call k of a path that also branched at
call k-1, on hand-built trees whose answer is counted by hand."""

from aepo_jax.rollout._trajectories import Segment, TrajectoryRecord
from aepo_jax.rollout.policies._stats import consecutive_branches, tree_stats


def _rec(index, prompt, calls, parent=-1, fork_pos=-1, first_call=1):
  """A record whose tool results end at response offsets 10, 20, ... (call c ends at 10 c), from `first_call` on."""
  segs = [Segment(round=c, start=10 * c - 5, end=10 * c - 1, result_end=10 * c, calls_after=c) for c in calls]
  return TrajectoryRecord(
    index=index,
    prompt=prompt,
    kind="global" if parent < 0 else "branch",
    prompt_tokens=[1, 2],
    first_round=0,
    max_response_len=64,
    max_tool_calls=8,
    seed=0,
    parent=parent,
    fork_pos=fork_pos,
    segments=segs,
  )


def test_consecutive_branches_follow_the_path_not_the_prompt():
  records = [
    _rec(0, 0, [1, 2, 3]),  # root of prompt 0
    _rec(1, 0, [2, 3], parent=0, fork_pos=10),  # branch at call 1: nothing at call 0 -> not consecutive
    _rec(2, 0, [3], parent=0, fork_pos=20),  # call 2 of a path that branched at 1 (record 1) -> consecutive
    _rec(3, 0, [3], parent=1, fork_pos=20),  # call 2 of record 1, which was made at call 1 -> consecutive
    _rec(4, 0, [], parent=0, fork_pos=30),  # call 3 of record 0, branched at 2 (record 2) -> consecutive
    _rec(5, 0, [], parent=1, fork_pos=30),  # call 3 of record 1: its path branched at 1 and 2 (record 3) -> yes
    _rec(6, 1, [1, 2]),  # prompt 1
    _rec(7, 1, [], parent=6, fork_pos=20),  # call 2, no branch at call 1 -> not consecutive
  ]
  assert consecutive_branches(records) == (4, 6)
  assert tree_stats(records)["rollout/consecutive_branch_share"] == 4 / 6


def test_a_branch_of_another_path_at_the_previous_call_does_not_count():
  # Record 1 forks from 0 at call 1; record 0 branches again at call 2 (record 2), after the fork: not on 1's path.
  records = [
    _rec(0, 0, [1, 2, 3]),
    _rec(1, 0, [2, 3], parent=0, fork_pos=10),
    _rec(2, 0, [3], parent=0, fork_pos=20),
    _rec(3, 0, [], parent=1, fork_pos=30),  # call 3 of record 1: its path has no branch at call 2
  ]
  hits, total = consecutive_branches(records)
  assert (hits, total) == (1, 3)  # only record 2 (call 2 of a path made/branched at call 1)


def test_no_branches_is_zero():
  records = [_rec(0, 0, [1, 2]), _rec(1, 0, [1])]
  assert consecutive_branches(records) == (0, 0)
  assert tree_stats(records)["rollout/consecutive_branch_share"] == 0.0
