r"""The RL step of a pod config as a discrete-event model: synchronous, partial rollouts with bounded staleness
(colocated), and split placement, with a long-tailed trajectory length. Estimates, not measurements (no TPU here).

  python bench/pod_pipeline.py --config=configs/aepo_gaia.py --chip=v5p --chips=32 --host_chips=4
  python bench/pod_pipeline.py --config=configs/aepo_gaia.py --lengths=/tmp/run/eval/after_rl_5.jsonl   # measured

Per host, `slots` trajectories decode together; a decode step costs the host's reads (the bf16 weights plus the KV
of the active slots, at the chips' HBM bandwidth: bench/pod_estimate.py's roofline); a finished trajectory's slot
takes the next one at once (continuous batching); tool time is not modelled. The update (and old log-probs) costs
the step's training FLOPs at --mfu on the chips that train. Lengths: lognormal with --median_frac and --p90_frac of
max_response_len (capped there: answers that run to the cap), or the `response_len` of a run's records.

  synchronous   each step rolls out its prompts until the last trajectory ends, then updates (today's step)
  partial       a step's rollout ends once its quota of trajectories is complete; the unfinished stay in their
                slots and continue after the update with the new weights (train.max_staleness >= 1)
  split         R hosts roll out without pause while the others train on the previous batch; the weights are
                streamed to the rollout hosts after every update (--transfer_gbps per host)

Printed per mode: seconds per RL step, trajectories per second, decode-slot occupancy (the tail made visible) and
the chips' time split.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np
from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _pipeline_model import costs, simulate  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (configs/*.py[:arg]).")
_CHIP = flags.DEFINE_enum("chip", "v5p", ["v4", "v5e", "v5p", "v6e"], "TPU generation.")
_CHIPS = flags.DEFINE_integer("chips", 32, "Chips in the slice.")
_HOST_CHIPS = flags.DEFINE_integer("host_chips", 4, "Chips per host.")
_MFU = flags.DEFINE_float("mfu", 0.4, "MFU of the update and log-prob passes.")
_MEDIAN = flags.DEFINE_float("median_frac", 0.25, "Median trajectory length, as a fraction of max_response_len.")
_P90 = flags.DEFINE_float("p90_frac", 0.8, "90th-percentile length, as a fraction of max_response_len.")
_LENGTHS = flags.DEFINE_string("lengths", "", "A JSONL of records with response_len (a run's eval records).")
_SPLIT = flags.DEFINE_list("split_rollout_frac", ["0.25", "0.5"], "Split placement: shares of hosts that roll out.")
_DECODE_EFF = flags.DEFINE_float("decode_eff", 1.0, "Decode at this fraction of the HBM-bandwidth roofline.")
_TRANSFER = flags.DEFINE_float("transfer_gbps", 25.0, "Split placement: weight streaming GB/s into each host.")
_STEPS = flags.DEFINE_integer("steps", 20, "Steps simulated (the first is discarded: the pipeline fills).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the sampled lengths.")


def main(argv):
  del argv
  config = _CONFIG.value
  c = costs(config, _CHIP.value, _CHIPS.value, _HOST_CHIPS.value, _MFU.value)
  c = dataclasses.replace(
    c, weights_s=c.weights_s / _DECODE_EFF.value, kv_s_per_token=c.kv_s_per_token / _DECODE_EFF.value
  )
  hosts = _CHIPS.value // _HOST_CHIPS.value
  cap = config.rollout.max_response_len
  measured = None
  if _LENGTHS.value:
    with open(_LENGTHS.value) as f:
      measured = [json.loads(line)["response_len"] for line in f if line.strip()]
  print(
    f"{_CHIPS.value} x {_CHIP.value} ({hosts} hosts), {c.slots} slots and {c.per_host} trajectories per host per "
    f"step; decode step {c.weights_s * 1e3:.1f} ms + {c.kv_s_per_token * 1e6:.3f} us per token of context; update "
    f"{c.update_s:.0f} s at MFU {_MFU.value:.0%}; lengths "
    + (
      f"resampled from {len(measured)} records"
      if measured
      else f"lognormal, median {_MEDIAN.value:.0%} and p90 {_P90.value:.0%} of {cap}"
    )
    + " (estimates)"
  )
  rows = []
  for mode, frac in [("synchronous", 0.0), ("partial", 0.0)] + [("split", float(f)) for f in _SPLIT.value]:
    rng = np.random.default_rng(_SEED.value)
    row = simulate(mode, c, hosts, _STEPS.value, rng, cap, frac, _TRANSFER.value, _MEDIAN.value, _P90.value, measured)
    row["mode"] = f"split {frac:.0%}" if mode == "split" else mode
    rows.append(row)
  base = rows[0]["trajectories_per_s"]
  print(f"{'mode':<12}{'s / step':>10}{'traj / s':>10}{'vs sync':>9}{'slot occupancy':>16}{'update share':>14}")
  for r in rows:
    print(
      f"{r['mode']:<12}{r['step_s']:>10.0f}{r['trajectories_per_s']:>10.2f}{r['trajectories_per_s'] / base:>8.2f}x"
      f"{r['slot_occupancy']:>16.0%}{r['update_share']:>14.0%}"
    )
  print(json.dumps(rows))


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
