"""Pictures for notebooks and reports: gradient weights of the policy losses, rollout trees, run curves.

  token_gradient_weights(loss, ratio, advantage, entropy=None, **hp) -> w    w = −∂ℓ/∂logπ per token
  plot_gradient_weights(weights, ratios_r, advantages=(1.0, -1.0), clip_lines=None, title=None) -> Figure
  plot_gradient_heatmaps(weights, ratios_r, advantages_a, title=None) -> Figure
  plot_rollout_tree(trajectories, group=None, rewards=None, title=None) -> Figure
  most_branched_group(trajectories) -> group id
  read_curves(path) -> records;  plot_curves(metrics_jsonl_path_or_workdir, keys, title=None) -> Figure

Figures are `matplotlib.figure.Figure` objects built without pyplot, so nothing global is left behind;
a notebook displays the one it returns. jax is imported only by `token_gradient_weights`.
"""

from __future__ import annotations

import json
import math
from typing import Mapping, Optional, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

_KIND_COLORS = {"global": "tab:blue", "branch": "tab:orange", "refill": "tab:green", "probe": "tab:gray"}


# ---------------------------------------------------------------------------------------------------------
# Gradient weights of a registered policy loss.
# ---------------------------------------------------------------------------------------------------------
def token_gradient_weights(loss: str, ratio, advantage, entropy=None, **hp) -> np.ndarray:
  """w = −∂ℓ_t/∂logπ_t of the registered policy loss `loss`, for every token of a broadcast grid.

  ratio, advantage (and entropy) broadcast to one shape; each element is one token with π_old = 1 and
  logπ = log r, so r is exactly the importance ratio. The tokens are laid out as one [1, N] batch and
  the loss is summed (token-mean with normalizer 1), so w_t is the token's own gradient weight: the
  coefficient of ∇logπ_t in the descent direction (docs/objectives.md: ∂ℓ/∂logπ = −F·A, so w = F·A).
  `hp` are the loss's keyword hyperparameters (clip_low, clip_high, clip_c, entropy_advantage_coef, ...).
  For `aepo` with an entropy, Ĥ is standardised over the whole grid unless entropy_mean/entropy_std are given.
  """
  import jax
  import jax.numpy as jnp

  from aepo_jax import objectives

  fn = objectives.policy_loss(loss)
  arrays = [np.asarray(ratio, np.float64), np.asarray(advantage, np.float64)]
  if entropy is not None:
    arrays.append(np.asarray(entropy, np.float64))
  arrays = np.broadcast_arrays(*arrays)
  shape = arrays[0].shape
  r = arrays[0].reshape(1, -1)
  if not np.all(r > 0):
    raise ValueError(
      f"token_gradient_weights: every ratio must be > 0 (got min {r.min()}); the ratio is exp(logπ − logπ_old)"
    )
  log_prob_bt = jnp.asarray(np.log(r), jnp.float32)
  adv_bt = jnp.asarray(arrays[1].reshape(1, -1), jnp.float32)
  ent_bt = None if entropy is None else jnp.asarray(arrays[2].reshape(1, -1), jnp.float32)
  mask_bt = jnp.ones_like(log_prob_bt)
  old_bt = jnp.zeros_like(log_prob_bt)

  def total_loss(logp_bt):
    value, _ = fn(logp_bt, old_bt, adv_bt, mask_bt, entropy=ent_bt, agg="token-mean", normalizer=1.0, **hp)
    return value

  grad_bt = jax.grad(total_loss)(log_prob_bt)
  return -np.asarray(grad_bt, np.float64).reshape(shape)


def plot_gradient_weights(
  weights: Mapping[str, np.ndarray],
  ratios_r,
  advantages: Sequence[float] = (1.0, -1.0),
  *,
  clip_lines: Optional[Mapping[str, Sequence[float]]] = None,
  title: Optional[str] = None,
) -> Figure:
  """Line plots of w(r) for each loss (columns) at each advantage (rows), one shared scale per row.

  weights: name -> [len(advantages), R] arrays from `token_gradient_weights(name, ratios_r[None], A[:, None])`.
  clip_lines: name -> ratio values to mark (e.g. 1 − ε_l, 1 + ε_h, c) as dotted verticals.
  Dashed grey: the unclipped policy gradient w = A·r, so what each loss removes or keeps is visible.
  """
  r = np.asarray(ratios_r, np.float64)
  names = list(weights)
  if not names:
    raise ValueError("plot_gradient_weights: `weights` is empty; pass {loss name: [A, R] array}")
  for name, w in weights.items():
    if np.shape(w) != (len(advantages), r.size):
      raise ValueError(
        f"plot_gradient_weights: weights[{name!r}] has shape {np.shape(w)}, expected "
        f"(len(advantages), len(ratios_r)) = {(len(advantages), r.size)}"
      )
  fig = Figure(figsize=(3.0 * len(names), 2.6 * len(advantages)), layout="constrained")
  axes = fig.subplots(len(advantages), len(names), sharex=True, sharey="row", squeeze=False)
  for i, a in enumerate(advantages):
    for j, name in enumerate(names):
      ax = axes[i, j]
      ax.plot(r, a * r, color="0.6", ls="--", lw=1, label="A·r (no clip)")
      ax.plot(r, np.asarray(weights[name])[i], color="tab:red" if a < 0 else "tab:blue", lw=2, label="w of the loss")
      for x in (clip_lines or {}).get(name, ()):
        if r.min() < x < r.max():  # e.g. CISPO's lower bound 0 lies off the grid
          ax.axvline(x, color="0.3", ls=":", lw=1)
      ax.axhline(0.0, color="0.8", lw=0.8)
      ax.grid(alpha=0.3)
      if i == 0:
        ax.set_title(name)
      if j == 0:
        ax.set_ylabel(f"A = {a:+g}\nw = −∂ℓ/∂logπ")
      if i == len(advantages) - 1:
        ax.set_xlabel("ratio r = π/π_old")
  axes[0, 0].legend(fontsize=7, loc="upper left")
  if title:
    fig.suptitle(title)
  return fig


def plot_gradient_heatmaps(
  weights: Mapping[str, np.ndarray], ratios_r, advantages_a, title: Optional[str] = None
) -> Figure:
  """w(r, A) as heatmaps side by side (rows of each array: advantages_a, columns: ratios_r), shared colours."""
  r, a = np.asarray(ratios_r), np.asarray(advantages_a)
  vmax = max(float(np.max(np.abs(w))) for w in weights.values()) or 1.0
  fig = Figure(figsize=(3.0 * len(weights) + 1.0, 3.0), layout="constrained")
  axes = fig.subplots(1, len(weights), sharey=True, squeeze=False)[0]
  im = None
  for ax, (name, w) in zip(axes, weights.items()):
    im = ax.pcolormesh(r, a, np.asarray(w), cmap="RdBu", vmin=-vmax, vmax=vmax, shading="auto")
    ax.set_title(name)
    ax.set_xlabel("ratio r")
  axes[0].set_ylabel("advantage A")
  fig.colorbar(im, ax=list(axes), label="w = −∂ℓ/∂logπ")
  if title:
    fig.suptitle(title)
  return fig


# ---------------------------------------------------------------------------------------------------------
# Rollout trees.
# ---------------------------------------------------------------------------------------------------------
def _runs(mask_t):
  """[(start, end, value)] runs of equal values in a 1-D array."""
  mask_t = np.asarray(mask_t)
  if mask_t.size == 0:
    return []
  edges = np.flatnonzero(np.diff(mask_t)) + 1
  starts = np.r_[0, edges]
  ends = np.r_[edges, mask_t.size]
  return [(int(s), int(e), int(mask_t[s])) for s, e in zip(starts, ends)]


def most_branched_group(trajectories) -> int:
  """The group id with the most branch rows (the first such group on ties): the tree worth drawing."""
  group_ids = np.asarray(trajectories.group_id_b)
  forked = np.asarray(trajectories.parent_b) >= 0
  groups = list(dict.fromkeys(group_ids.tolist()))
  return max(groups, key=lambda g: (int(np.sum(forked & (group_ids == g))), -groups.index(g)))


def plot_rollout_tree(trajectories, group: Optional[int] = None, rewards=None, title: Optional[str] = None) -> Figure:
  """The rollout tree of one prompt: one line per trajectory over its response tokens, forks as links.

  group: the prompt's group id; None draws `most_branched_group(trajectories)`.
  trajectories: a `aepo_jax.rollout.Trajectories` (uses tokens/prompt_len/response_len/loss_mask, parent_b,
  fork_pos_b, kind_b, group_id_b, stop_reason_b). x is the response token offset; model tokens are drawn
  thick in the colour of the row's kind (global / branch / refill), tool results thin grey. A branch starts
  at its fork position with a link from its parent's line. rewards: optional [B] values printed at the end.
  """
  if group is None:
    group = most_branched_group(trajectories)
  group_ids = np.asarray(trajectories.group_id_b)
  rows = np.flatnonzero(group_ids == group)
  if rows.size == 0:
    raise ValueError(
      f"plot_rollout_tree: group {group} is not in this batch; its groups are {sorted(set(group_ids.tolist()))}"
    )
  y_of = {int(b): k for k, b in enumerate(rows)}
  fig = Figure(figsize=(9, 0.45 * rows.size + 1.2), layout="constrained")
  ax = fig.subplots()
  prompt_len = np.asarray(trajectories.prompt_len_b)
  resp_len = np.asarray(trajectories.response_len_b)
  parent = np.asarray(trajectories.parent_b)
  fork_pos = np.asarray(trajectories.fork_pos_b)
  for b in rows:
    y = y_of[int(b)]
    p, n = int(prompt_len[b]), int(resp_len[b])
    kind = trajectories.kind_b[b] if trajectories.kind_b else "global"
    color = _KIND_COLORS.get(kind, "tab:purple")
    start = int(fork_pos[b]) - p if parent[b] >= 0 else 0
    mask = np.asarray(trajectories.loss_mask_bt[b, p + start : p + n])
    for s, e, m in _runs(mask):
      ax.plot([start + s, start + e], [y, y], color=color if m else "0.6", lw=5 if m else 2, solid_capstyle="butt")
    if parent[b] >= 0 and int(parent[b]) in y_of:
      ax.plot([start, start], [y_of[int(parent[b])], y], color=color, lw=1.2)
      ax.plot([start], [y_of[int(parent[b])]], "o", color=color, ms=5)
    label = trajectories.stop_reason_b[b] if trajectories.stop_reason_b else ""
    if rewards is not None:
      label = f"{label} r={float(np.asarray(rewards)[b]):.2f}"
    ax.annotate(label, (n, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=7)
  handles = [
    ax.plot([], [], color=c, lw=5, label=k)[0]
    for k, c in _KIND_COLORS.items()
    if k in set(trajectories.kind_b[b] for b in rows)
  ]
  handles.append(ax.plot([], [], color="0.6", lw=2, label="tool result (mask 0)")[0])
  ax.legend(handles=handles, fontsize=7, loc="lower right")
  ax.set_yticks(range(rows.size), [f"row {b}" for b in rows])
  ax.invert_yaxis()
  ax.set_xlabel("response token")
  ax.set_xlim(0, max(int(resp_len[rows].max()), 1) * 1.15)
  ax.set_title(title or f"rollout tree of prompt {group} ({rows.size} trajectories)")
  ax.grid(axis="x", alpha=0.3)
  return fig


# ---------------------------------------------------------------------------------------------------------
# Run curves.
# ---------------------------------------------------------------------------------------------------------
def read_curves(path: str) -> list[dict]:
  """Records of a metrics JSONL (a file, or a run's workdir holding metrics.jsonl; local or gs://), in order."""
  from etils import epath  # orbax's path library: the same local / gs:// handling as the trainer's writers

  p = epath.Path(path)
  if p.is_dir():
    p = p / "metrics.jsonl"
  if not p.exists():
    raise FileNotFoundError(f"{p} does not exist; pass a run's workdir or its metrics.jsonl")
  return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def plot_curves(metrics_jsonl_path: str, keys: Sequence[str], title: Optional[str] = None) -> Figure:
  """One panel per key: value against step, from the records that hold the key (SFT and RL both log `step`).

  A resumed run logs some steps twice; the last record of a step wins. A key the run never logged raises,
  listing the keys it did log.
  """
  records = read_curves(metrics_jsonl_path)
  logged = sorted({k for r in records for k in r if k not in ("step", "time")})
  missing = [k for k in keys if k not in logged]
  if missing:
    raise KeyError(f"plot_curves: {missing} not in {metrics_jsonl_path}; logged keys: {logged}")
  cols = min(len(keys), 3)
  rows = math.ceil(len(keys) / cols)
  fig = Figure(figsize=(4.0 * cols, 2.8 * rows), layout="constrained")
  axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
  for ax, key in zip(axes, keys):
    by_step = {int(r["step"]): r[key] for r in records if r.get(key) is not None}
    steps = sorted(by_step)
    ax.plot(steps, [by_step[s] for s in steps], marker="o", ms=3)
    ax.set_title(key, fontsize=9)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
  for ax in axes[len(keys) :]:
    ax.set_visible(False)
  if title:
    fig.suptitle(title)
  return fig
