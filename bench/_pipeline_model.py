"""The discrete-event model behind bench/pod_pipeline.py (no flags: importable by tests): per-host decode slots
with continuous batching, a bandwidth-bound decode step, and the three placements of the RL step."""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass
class Costs:
  """What one host and the slice cost: decode step time per token of context, the update time, the weights."""

  slots: int  # decode slots per host
  per_host: int  # trajectories per step per host
  weights_s: float  # reading the bf16 weights once (one decode step with an empty cache)
  kv_s_per_token: float  # reading one token of KV of one slot
  update_s: float  # update + old log-probs of one step's batch on the whole slice
  weight_bytes: float
  prompt_len: int


def costs(config, chip: str, chips: int, host_chips: int, mfu: float) -> Costs:
  from aepo_jax.train import _compile
  from aepo_jax.train._compile import PEAKS

  cfg = _compile.model_config(config)
  r, d = config.rollout, config.data
  flops_peak, hbm_bw = PEAKS[chip]
  hosts = chips // host_chips
  per_host = -(-d.prompts_per_step // hosts) * r.n
  slots = r.max_slots or per_host
  n = cfg.num_params
  embed = cfg.vocab_size * cfg.hidden_size
  n_matmul = n - (0 if cfg.tie_word_embeddings else embed)
  seq = r.max_prompt_len + r.max_response_len
  fwd_per_token = 2 * n_matmul + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (seq / 2)
  passes = 3 + 1 + (1 if (config.algo.kl.coef > 0 or config.algo.kl.use_in_reward) else 0)
  train_flops = d.prompts_per_step * r.n * seq * fwd_per_token * passes
  kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
  return Costs(
    slots=slots,
    per_host=per_host,
    weights_s=2 * n / (host_chips * hbm_bw),
    kv_s_per_token=kv_per_token / (host_chips * hbm_bw),
    update_s=train_flops / (chips * flops_peak * mfu),
    weight_bytes=2 * n,
    prompt_len=r.max_prompt_len,
  )


def lengths(rng, count: int, cap: int, median_frac: float, p90_frac: float, measured=None) -> np.ndarray:
  """Response lengths in tokens, capped at `cap`: resampled from `measured` or lognormal (median, p90)."""
  if measured is not None and len(measured):
    return np.minimum(rng.choice(np.asarray(measured), count), cap).astype(int)
  mu = math.log(median_frac * cap)
  sigma = max((math.log(p90_frac * cap) - mu) / 1.2816, 1e-3)  # z(0.9)
  return np.clip(rng.lognormal(mu, sigma, count), 1, cap).astype(int)


class Host:
  """One host's decode slots: trajectories (remaining tokens, context) advance one token per decode step."""

  def __init__(self, c: Costs):
    self.c = c
    self.active: list = []  # [remaining, context] per busy slot
    self.queue: list = []  # lengths waiting for a slot
    self.busy_slot_s = 0.0
    self.total_slot_s = 0.0

  def run_until(self, done_target: int) -> tuple[float, int]:
    """Decode until `done_target` trajectories finished (or nothing is left); returns (seconds, finished)."""
    t, done = 0.0, 0
    while done < done_target and (self.active or self.queue):
      while len(self.active) < self.c.slots and self.queue:
        self.active.append([self.queue.pop(0), self.c.prompt_len])
      step = self.c.weights_s + self.c.kv_s_per_token * sum(ctx for _, ctx in self.active)
      t += step
      self.busy_slot_s += step * len(self.active)
      self.total_slot_s += step * self.c.slots
      for a in self.active:
        a[0] -= 1
        a[1] += 1
      finished = sum(1 for a in self.active if a[0] <= 0)
      done += finished
      self.active = [a for a in self.active if a[0] > 0]
    return t, done


def simulate(
  mode: str,
  c: Costs,
  hosts: int,
  steps: int,
  rng,
  cap: int,
  split_frac: float,
  transfer_gbps: float,
  median: float,
  p90: float,
  measured=None,
) -> dict:
  """Seconds per step, trajectories per second, decode-slot occupancy and the share of time the chips train."""
  if mode == "split":
    roll_hosts = max(1, int(round(hosts * split_frac)))
    train_share = (hosts - roll_hosts) / hosts
    host = Host(dataclasses.replace(c, per_host=-(-c.per_host * hosts // roll_hosts)))
    update_s = c.update_s / max(train_share, 1e-9)
    transfer_s = c.weight_bytes / (transfer_gbps * 1e9)
  else:
    host = Host(c)
    update_s, transfer_s = c.update_s, 0.0
  per_host = host.c.per_host
  times = []
  for s in range(steps):
    host.queue.extend(lengths(rng, per_host, cap, median, p90, measured).tolist())
    if mode == "synchronous":
      roll, _ = host.run_until(10**9)  # every trajectory of the step ends
      times.append(roll + update_s)
    elif mode == "partial":
      # max_staleness 1: the next step's trajectories take slots as soon as they free up, so the queue never runs
      # dry; the step's rollout ends at its quota of finished trajectories, the unfinished carry over.
      host.queue.extend(lengths(rng, per_host, cap, median, p90, measured).tolist() if s == 0 else [])
      roll, _ = host.run_until(per_host)
      times.append(roll + update_s)
    else:  # split: rollouts of step s overlap the update of step s - 1; weights streamed after each update
      host.queue.extend(lengths(rng, per_host, cap, median, p90, measured).tolist() if s == 0 else [])
      roll, _ = host.run_until(per_host)
      times.append(max(roll, update_s) + transfer_s)
  t = float(np.mean(times[1:])) if steps > 1 else times[0]
  return {
    "mode": mode,
    "step_s": t,
    "trajectories_per_s": per_host * (hosts if mode != "split" else max(1, int(round(hosts * split_frac)))) / t,
    "slot_occupancy": host.busy_slot_s / max(host.total_slot_s, 1e-9),
    "update_share": update_s / t if mode != "split" else min(update_s / t, 1.0),
  }
