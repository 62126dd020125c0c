"""Statistics of the rollout trees of one step (`rollout/*` metrics).

top3_branch_share is the concentration AEPO's consecutive-branch penalty targets (spec §2.1: 93.4% of ARPO's
branches sit on 1-3 trajectories): per prompt with at least one branch, the share of its branches whose parent
is one of the 3 trajectories with most children, averaged over those prompts. consecutive_branch_share is the
chain the penalty stops: the share of branches made at tool call k of a path that had also branched at call k-1
(the path: the parent's calls up to the fork, its own lineage's branches included), over all branches.

token_entropy_after_tool / token_entropy_elsewhere split the sampler's per-token entropy (the records' `entropy`)
of every generated token (loss mask 1; a branch counts only the tokens after its fork, so shared prefixes count
once): the first `window` generated tokens after each tool result, against all other generated tokens. ARPO's
claim (entropy rises right after tool results) is about the first; entropy_after_tool / entropy_initial are the
branching rule's own window statistic at the two kinds of resume point.
"""

from __future__ import annotations

import collections

import numpy as np

from aepo_jax.rollout.policies._entropy import window_statistic


def _stat(accums, estimator, window, vocab_size) -> np.ndarray:
  if not accums:
    return np.zeros((0,), np.float32)
  a = np.asarray(accums, np.float64)
  return np.asarray(
    window_statistic(
      a[:, 0].astype(np.int32), a[:, 1], a[:, 2], estimator=estimator, window=window, vocab_size=vocab_size
    )
  )


def _fork_step(record, by_index) -> int:
  """The tool call (count along the path) after whose result `record` forked from its parent."""
  parent = by_index.get(record.parent)
  seg = next((s for s in parent.segments if s.result_end == record.fork_pos), None) if parent else None
  return seg.calls_after if seg is not None else 0


def consecutive_branches(records) -> tuple[int, int]:
  """(branches made at tool call k of a path that also branched at call k-1, all branches)."""
  by_index = {r.index: r for r in records}
  step = {r.index: _fork_step(r, by_index) for r in records if r.kind == "branch" and r.parent in by_index}
  made = collections.defaultdict(set)  # parent index -> tool calls at which it was branched
  for i, k in step.items():
    made[by_index[i].parent].add(k)

  def branched_at(index: int, k: int, upto: int) -> bool:
    """Whether the path of `index`, up to its tool call `upto`, branched at call k."""
    while index in by_index:
      if k <= upto and k in made[index]:
        return True
      if index not in step:
        return False
      if step[index] == k:  # this path itself was made by a branch at call k
        return True
      upto = min(upto, step[index])
      index = by_index[index].parent
    return False

  hits = sum(1 for i, k in step.items() if k > 0 and branched_at(by_index[i].parent, k - 1, k - 1))
  return hits, len(step)


def _mean(x) -> float:
  return float(np.mean(x)) if len(x) else 0.0


def token_entropy_split(records, window: int = 20) -> tuple:
  """(sum, count) of the per-token entropy of generated tokens within `window` tokens after a tool result, and
  (sum, count) of all other generated tokens; each token counted once (a branch from its fork on)."""
  after, other = [0.0, 0], [0.0, 0]
  for r in records:
    start = max(r.fork_pos, 0) if r.parent >= 0 else 0
    ent = np.asarray(r.entropy[start:], np.float64)
    gen = np.asarray(r.loss_mask[start:], bool)[: len(ent)]
    ends = [s.result_end - start for s in r.segments if s.result_end is not None and s.result_end >= start]
    if r.parent >= 0 and r.fork_pos > 0:  # a branch starts right after its parent's tool result
      ends.append(0)
    near = _first_generated(gen, ends, window)
    for acc, sel in ((after, gen & near), (other, gen & ~near)):
      acc[0] += float(ent[sel].sum())
      acc[1] += int(sel.sum())
  return tuple(after), tuple(other)


def _first_generated(gen: np.ndarray, offsets, window: int) -> np.ndarray:
  """Mask of the first `window` generated tokens (gen True) from each offset on (tool-result tokens in between
  are skipped: they are never generated)."""
  out = np.zeros(len(gen), bool)
  idx = np.flatnonzero(gen)
  for o in offsets:
    first = np.searchsorted(idx, o)
    out[idx[first : first + window]] = True
  return out


def tree_stats(records, *, estimator: str = "exact", window: int = 20, vocab_size: int = 2) -> dict:
  """rollout/* metrics over finished records (all prompts of one rollout call)."""
  depth = {}
  for r in sorted(records, key=lambda r: r.index):
    depth[r.index] = 0 if r.parent < 0 else depth.get(r.parent, 0) + 1
  prompts = sorted({r.prompt for r in records})
  branches_p, shares, global_p, refill_p = [], [], [], []
  for p in prompts:
    rs = [r for r in records if r.prompt == p]
    kids = collections.Counter(r.parent for r in rs if r.kind == "branch")
    nb = sum(kids.values())
    branches_p.append(nb)
    global_p.append(sum(r.kind == "global" for r in rs))
    refill_p.append(sum(r.kind == "refill" for r in rs))
    if nb:
      shares.append(sum(sorted(kids.values(), reverse=True)[:3]) / nb)
  first, after_tool = [], []
  for r in records:
    result_ends = {s.result_end for s in r.segments if s.result_end is not None}
    for i, s in enumerate(r.segments):
      if s.end < 0:
        continue
      if s.start == 0 and r.parent < 0:
        first.append(s.accum)
      elif s.start in result_ends or (i == 0 and r.parent >= 0 and r.fork_pos > 0):
        after_tool.append(s.accum)
  h_first = _stat(first, estimator, window, vocab_size)
  h_after = _stat(after_tool, estimator, window, vocab_size)
  # Branches forked on device save their prompt and prefix; fresh samples forked from a slot holding their prompt
  # (refills) the prompt.
  saved = sum(len(r.prompt_tokens) + max(r.fork_pos, 0) for r in records if r.forked_on_device)
  depths = [depth[r.index] for r in records]
  stops = collections.Counter(r.stop_reason for r in records)
  n = max(len(records), 1)
  consecutive, branches = consecutive_branches(records)
  (after_sum, after_n), (other_sum, other_n) = token_entropy_split(records, window)
  out = {
    "rollout/num_trajectories": float(len(records)),
    "rollout/branches_per_prompt": _mean(branches_p),
    "rollout/branches_per_prompt_max": float(max(branches_p, default=0)),
    "rollout/tree_depth_max": float(max(depths, default=0)),
    "rollout/tree_depth_mean": _mean(depths),
    "rollout/top3_branch_share": _mean(shares),
    "rollout/consecutive_branch_share": consecutive / branches if branches else 0.0,
    "rollout/tool_calls_per_traj": _mean([r.num_tool_calls for r in records]),
    "rollout/tool_failures": float(sum(r.tool_failures for r in records)),
    "rollout/entropy_initial": _mean(h_first),
    "rollout/entropy_after_tool": _mean(h_after),
    "rollout/token_entropy_after_tool": after_sum / after_n if after_n else 0.0,
    "rollout/token_entropy_elsewhere": other_sum / other_n if other_n else 0.0,
    "rollout/tokens_after_tool": float(after_n),
    "rollout/prefill_tokens_saved_by_fork": float(saved),
    "rollout/forks_on_device": float(sum(r.kind == "branch" and r.forked_on_device for r in records)),
    "rollout/global_samples": _mean(global_p),
    "rollout/refills": _mean(refill_p),
    "rollout/response_len_mean": _mean([r.response_len for r in records]),
  }
  for reason, k in stops.items():
    out[f"rollout/stop_{reason}"] = k / n
  return out


# How each statistic of several hosts' rollouts combines into the statistic of all of them (`combine_stats`):
# counts add up, maxima take the max, everything else is a mean weighted by each host's trajectories.
_SUMMED = (
  "rollout/tokens_after_tool",
  "rollout/num_trajectories",
  "rollout/tool_failures",
  "rollout/prefill_tokens_saved_by_fork",
  "rollout/forks_on_device",
  "rollout/decode_tokens",
  "rollout/carried_groups",  # partial rollouts (rollout/_partial.py): every host carries its own
  "rollout/carried_trajectories",
  "rollout/dropped_stale",
)
_MAXED = ("rollout/rounds",)


def combine_stats(stats: list) -> dict:
  """The statistics of several rollouts (one per host, each from `tree_stats` plus the agent's) as those of their
  union: counts summed, maxima (`*_max`, rounds) maxed, the rest averaged with each rollout's trajectories as weights
  (per-prompt means are trajectory-weighted: equal where every prompt has n trajectories). A key missing from a
  rollout is left out of its mean."""
  stats = [dict(s) for s in stats]
  if len(stats) == 1:
    return stats[0]
  weights = [max(float(s.get("rollout/num_trajectories", 1.0)), 0.0) for s in stats]
  out = {}
  for key in sorted(set().union(*stats)):
    have = [(s[key], w) for s, w in zip(stats, weights) if key in s]
    values = [float(v) for v, _ in have]
    if key in _SUMMED:
      out[key] = float(sum(values))
    elif key in _MAXED or key.endswith("_max"):
      out[key] = float(max(values))
    else:
      total = sum(w for _, w in have)
      out[key] = float(sum(v * w for v, (_, w) in zip(values, have)) / total) if total > 0 else float(np.mean(values))
  return out
