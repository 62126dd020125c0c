"""Host records of a rollout and the `Trajectories` batch handed to the trainer (docs/rollout_contract.md).

A `TrajectoryRecord` is the host's truth for one trajectory: token ids (never re-encoded), per-token sampler
log-prob / entropy / loss mask, its segments (one per round) and its place in the prompt's tree. `assemble`
turns the records of one rollout into padded numpy arrays, rows of a prompt contiguous and in creation order
(spec §1.2 step 4: `batch.repeat(n, interleave=True)` order).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import numpy as np

KINDS = ("global", "branch", "refill", "probe")


@dataclasses.dataclass
class Segment:
  """Tokens generated from one resume point to the next stop (+ the tool result appended after it).

  start/end: response offsets of the generated tokens [start, end). accum: the engine's window accumulators
  (seg_count, seg_entropy_sum, seg_topk_entropy_sum) at the stop. result_end: response offset after the
  appended tool result (None: no result, e.g. EOS, empty call, call limit, length).
  """

  round: int
  start: int
  end: int = -1
  accum: tuple = (0, 0.0, 0.0)
  result_end: Optional[int] = None
  tool_pending: bool = False  # its tool call is still running
  calls_after: int = 0  # tool calls made up to and including this segment
  call_state: Any = None  # tool bookkeeping after this segment (copied into a child forked here)


@dataclasses.dataclass
class TrajectoryRecord:
  index: int  # creation index within this rollout (the official "copy index")
  prompt: int  # group id
  kind: str  # 'global' | 'branch' | 'refill' | 'probe'
  prompt_tokens: list
  first_round: int
  max_response_len: int  # L (model + tool tokens)
  max_tool_calls: int
  seed: int
  parent: int = -1  # record index of the parent, -1 for a fresh sample
  fork_pos: int = -1  # response offset at which it forked from the parent
  tokens: list = dataclasses.field(default_factory=list)  # response ids
  loss_mask: list = dataclasses.field(default_factory=list)
  logprob: list = dataclasses.field(default_factory=list)
  entropy: list = dataclasses.field(default_factory=list)
  segments: list = dataclasses.field(default_factory=list)
  call_state: Any = None
  num_tool_calls: int = 0
  tool_failures: int = 0
  stop_reason: str = ""
  done: bool = False
  end_round: int = -1  # round in which it ended
  slot: int = -1  # engine slot holding it (-1 none)
  device_len: int = 0  # response tokens present in that slot
  initial_accum: Optional[tuple] = None  # corrected mode: accumulators of the lineage's first segment
  forked_on_device: bool = False
  # (response offset, policy version): the tokens from each offset on were sampled by that version of the weights
  # (one mark per weight update a trajectory lives through; partial rollouts, aepo_jax.rollout.PartialRollouts).
  version_marks: list = dataclasses.field(default_factory=list)
  started: float = 0.0  # time.monotonic() after its first decode chunk (AgentConfig.sample_timeout_s); 0: not yet
  # [len(prompt) + tokens held, L_sparse, k] int32: the experts of prompt + response tokens as its slot held them
  # when last released (`Engine.slot_routes`; -1: not run); None unless the engine records routes.
  routes: Optional[np.ndarray] = None

  @property
  def response_len(self) -> int:
    return len(self.tokens)

  @property
  def room(self) -> int:
    return self.max_response_len - len(self.tokens)

  def rounds_done(self) -> int:
    """Rounds this trajectory has completed (its segment ended and, if any, its tool result is in)."""
    return sum(1 for s in self.segments if s.end >= 0 and not s.tool_pending)

  def append(self, tokens, logprob=None, entropy=None, mask: int = 1) -> None:
    n = len(tokens)
    self.tokens.extend(int(t) for t in tokens)
    self.loss_mask.extend([mask] * n)
    self.logprob.extend([0.0] * n if logprob is None else [float(x) for x in logprob])
    self.entropy.extend([0.0] * n if entropy is None else [float(x) for x in entropy])

  def truncate(self, length: int) -> None:
    """Drops the response from `length` on (a rewind); the tokens sampled again come from the current version."""
    current = self.version_marks[-1][1] if self.version_marks else 0
    del self.tokens[length:], self.loss_mask[length:], self.logprob[length:], self.entropy[length:]
    self.version_marks = [m for m in self.version_marks if m[0] < length] or [(0, current)]
    if self.version_marks[-1][1] != current:
      self.version_marks.append((length, current))

  def token_versions(self) -> np.ndarray:
    """The policy version that sampled each response token (tool-result tokens get the version of their turn)."""
    out = np.zeros((len(self.tokens),), np.int64)
    for offset, version in self.version_marks:
      out[offset:] = version
    return out

  def fork(self, index: int, fork_pos: int, seed: int, first_round: int, copy_state: Callable) -> "TrajectoryRecord":
    """A child sharing this record's prompt and response[:fork_pos] (spec §1.2 2.6: a full copy of the state)."""
    seg = next((s for s in self.segments if s.result_end == fork_pos), None)
    calls = seg.calls_after if seg is not None else 0
    state = seg.call_state if seg is not None else self.call_state
    child = TrajectoryRecord(
      index=index,
      prompt=self.prompt,
      kind="branch",
      prompt_tokens=self.prompt_tokens,
      first_round=first_round,
      max_response_len=self.max_response_len,
      max_tool_calls=self.max_tool_calls,
      seed=seed,
      parent=self.index,
      fork_pos=fork_pos,
      tokens=self.tokens[:fork_pos],
      loss_mask=self.loss_mask[:fork_pos],
      logprob=self.logprob[:fork_pos],
      entropy=self.entropy[:fork_pos],
      call_state=copy_state(state),
      num_tool_calls=calls,
      initial_accum=self.initial_accum,
      version_marks=[m for m in self.version_marks if m[0] < fork_pos],
    )
    return child


@dataclasses.dataclass
class Trajectories:
  """One row per trajectory; rows of a prompt contiguous, in creation order (contract)."""

  tokens_bt: np.ndarray
  prompt_len_b: np.ndarray
  response_len_b: np.ndarray
  loss_mask_bt: np.ndarray
  attention_mask_bt: np.ndarray
  sampler_logprob_bt: np.ndarray
  sampler_entropy_bt: np.ndarray
  group_id_b: np.ndarray
  parent_b: np.ndarray
  fork_pos_b: np.ndarray
  num_tool_calls_b: np.ndarray
  stop_reason_b: list
  response_text: list
  kind_b: list
  stats: dict
  # [N, T, L_sparse, k] int32: the experts each token went to in each sparse layer in the rollout (routing replay,
  # `Engine(record_routes=True)`), -1 on padding and where none was recorded (the update routes those itself);
  # None when the engine does not record routes.
  routes_btsk: Optional[np.ndarray] = None

  def __len__(self) -> int:
    return int(self.tokens_bt.shape[0])


def assemble(
  records: list,
  *,
  pad_id: int,
  decode: Optional[Callable] = None,
  stats: Optional[dict] = None,
  pad_to: Optional[int] = None,
) -> Trajectories:
  """Padded host arrays from finished records (already ordered prompt-major, creation order within a prompt).

  fork_pos_b is the index in tokens_bt of the first token the child did not share with its parent.
  """
  row_of = {r.index: i for i, r in enumerate(records)}
  total = [len(r.prompt_tokens) + len(r.tokens) for r in records]
  t = max(total, default=1)
  if pad_to is not None:
    if pad_to < t:
      raise ValueError(f"assemble(pad_to={pad_to}) is shorter than the longest trajectory ({t} tokens).")
    t = pad_to
  n = len(records)
  tokens = np.full((n, t), pad_id, np.int32)
  loss = np.zeros((n, t), np.int32)
  attn = np.zeros((n, t), np.int32)
  lp = np.zeros((n, t), np.float32)
  ent = np.zeros((n, t), np.float32)
  for i, r in enumerate(records):
    p = len(r.prompt_tokens)
    tokens[i, :p] = r.prompt_tokens
    tokens[i, p : total[i]] = r.tokens
    loss[i, p : total[i]] = r.loss_mask
    attn[i, : total[i]] = 1
    lp[i, p : total[i]] = r.logprob
    ent[i, p : total[i]] = r.entropy
  return Trajectories(
    tokens_bt=tokens,
    prompt_len_b=np.asarray([len(r.prompt_tokens) for r in records], np.int32),
    response_len_b=np.asarray([len(r.tokens) for r in records], np.int32),
    loss_mask_bt=loss,
    attention_mask_bt=attn,
    sampler_logprob_bt=lp,
    sampler_entropy_bt=ent,
    group_id_b=np.asarray([r.prompt for r in records], np.int32),
    parent_b=np.asarray([row_of.get(r.parent, -1) for r in records], np.int32),
    fork_pos_b=np.asarray([len(r.prompt_tokens) + r.fork_pos if r.parent >= 0 else -1 for r in records], np.int32),
    num_tool_calls_b=np.asarray([r.num_tool_calls for r in records], np.int32),
    stop_reason_b=[r.stop_reason for r in records],
    response_text=[decode(r.tokens) if decode is not None else "" for r in records],
    kind_b=[r.kind for r in records],
    stats=dict(stats or {}),
    routes_btsk=_routes(records, t, total),
  )


def _routes(records, t: int, total: list) -> Optional[np.ndarray]:
  """[N, T, L_sparse, k] int32 of the records' routes (-1 where none), or None when no record has any."""
  held = [r.routes for r in records if r.routes is not None]
  if not held:
    return None
  out = np.full((len(records), t) + held[0].shape[1:], -1, np.int32)
  for i, r in enumerate(records):
    if r.routes is not None:
      n = min(len(r.routes), total[i])
      out[i, :n] = r.routes[:n]
  return out


def concat_groups(parts: list, *, pad_id: int) -> Trajectories:
  """One `Trajectories` from chosen groups of several rollouts (DAPO dynamic sampling keeps generating until
  enough groups have differing rewards).

  parts: [(trajectories, group ids to keep, in the order wanted)]. Groups are renumbered 0, 1, ... in the
  order given; rows of a group stay contiguous and in creation order; `parent_b` is remapped to the new
  rows (a parent is always in its child's group); arrays are right-padded to the widest part. `stats` are
  those of the first part (rollout statistics of one generation batch; the trainer adds its own).
  """
  if not parts:
    raise ValueError("concat_groups got no parts")
  width = max(int(tr.tokens_bt.shape[1]) for tr, _ in parts)
  rows, gid, parent = [], [], []
  new_g = 0
  for tr, keep in parts:
    g_b = np.asarray(tr.group_id_b)
    for g in keep:
      idx = np.flatnonzero(g_b == g)
      if idx.size == 0:
        raise ValueError(f"concat_groups: group {g} is not in the trajectories (ids {sorted(set(g_b.tolist()))})")
      new_of = {int(old): len(rows) + k for k, old in enumerate(idx)}
      for old in idx:
        p = int(tr.parent_b[old])
        parent.append(new_of[p] if p >= 0 else -1)
        rows.append((tr, int(old)))
        gid.append(new_g)
      new_g += 1

  def stack(name, fill, dtype, trailing=()):
    out = np.full((len(rows), width) + tuple(trailing), fill, dtype)
    for i, (tr, r) in enumerate(rows):
      x = getattr(tr, name)
      if x is not None:  # routes: -1 for a part that has none
        x = np.asarray(x)[r]
        out[i, : x.shape[0]] = x
    return out

  with_routes = [tr.routes_btsk for tr, _ in parts if tr.routes_btsk is not None]

  def pick(name, dtype=None):
    vals = [getattr(tr, name)[r] for tr, r in rows]
    return np.asarray(vals, dtype) if dtype is not None else list(vals)

  return Trajectories(
    tokens_bt=stack("tokens_bt", pad_id, np.int32),
    prompt_len_b=pick("prompt_len_b", np.int32),
    response_len_b=pick("response_len_b", np.int32),
    loss_mask_bt=stack("loss_mask_bt", 0, np.int32),
    attention_mask_bt=stack("attention_mask_bt", 0, np.int32),
    sampler_logprob_bt=stack("sampler_logprob_bt", 0.0, np.float32),
    sampler_entropy_bt=stack("sampler_entropy_bt", 0.0, np.float32),
    group_id_b=np.asarray(gid, np.int32),
    parent_b=np.asarray(parent, np.int32),
    fork_pos_b=pick("fork_pos_b", np.int32),
    num_tool_calls_b=pick("num_tool_calls_b", np.int32),
    stop_reason_b=pick("stop_reason_b"),
    response_text=pick("response_text"),
    kind_b=pick("kind_b"),
    stats=dict(parts[0][0].stats),
    routes_btsk=stack("routes_btsk", -1, np.int32, with_routes[0].shape[2:]) if with_routes else None,
  )
