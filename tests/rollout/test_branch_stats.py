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


def _tokens(rec, entropy, mask):
  rec.tokens, rec.entropy, rec.loss_mask = [7] * len(entropy), list(entropy), list(mask)
  rec.logprob = [0.0] * len(entropy)
  return rec


def test_token_entropy_after_tool_results_against_elsewhere_counted_by_hand():
  # Root: 4 generated tokens (entropy 1), a 3-token tool result (mask 0, entropy 0), 4 generated tokens (entropy 3).
  root = TrajectoryRecord(
    index=0, prompt=0, kind="global", prompt_tokens=[1], first_round=0, max_response_len=64, max_tool_calls=4, seed=0
  )
  root.segments = [Segment(round=0, start=0, end=4, result_end=7, calls_after=1), Segment(round=1, start=7, end=11)]
  _tokens(root, [1, 1, 1, 1, 0, 0, 0, 3, 3, 3, 3], [1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1])
  # A branch forked after the tool result (offset 7): shares 7 tokens, then 3 of its own (entropy 5).
  child = TrajectoryRecord(
    index=1,
    prompt=0,
    kind="branch",
    prompt_tokens=[1],
    first_round=1,
    max_response_len=64,
    max_tool_calls=4,
    seed=1,
    parent=0,
    fork_pos=7,
  )
  child.segments = [Segment(round=1, start=7, end=10)]
  _tokens(child, [1, 1, 1, 1, 0, 0, 0, 5, 5, 5], [1, 1, 1, 1, 0, 0, 0, 1, 1, 1])
  # window 2: after tool = root's first 2 after the result (3, 3) + the branch's first 2 (5, 5); elsewhere = root's
  # 4 ones, its last 2 threes, and the branch's third token (5); the shared prefix counts once.
  stats = tree_stats([root, child], window=2)
  assert stats["rollout/token_entropy_after_tool"] == (3 + 3 + 5 + 5) / 4
  assert stats["rollout/token_entropy_elsewhere"] == (4 * 1 + 2 * 3 + 5) / 7
  assert stats["rollout/tokens_after_tool"] == 4
  # No tool results at all: nothing after them, everything elsewhere.
  root.segments = [Segment(round=0, start=0, end=11)]
  stats = tree_stats([root], window=2)
  assert stats["rollout/tokens_after_tool"] == 0 and stats["rollout/token_entropy_after_tool"] == 0.0
  assert stats["rollout/token_entropy_elsewhere"] == (4 * 1 + 4 * 3) / 8
