r"""Compile a config's programs for a TPU slice on any host and say whether they fit the chips' memory.

  pip install -e ".[tpu]"        # libtpu: XLA:TPU then compiles here, ahead of time; no TPU needed
  python launch/compile.py --config=configs/aepo_gaia.py --topology=v5p:4x4x2
  python launch/compile.py --config=configs/aepo_gaia.py --topology=v6e:8x8 --config.rollout.max_slots=32
  python launch/compile.py --config=configs/aepo_gaia.py --topology=v5p:4x4x2 --programs=update,weight_copy,decode
  python launch/tpu_pod.py --config=configs/aepo_gaia.py --dry_run --topology=v5p:4x4x2   # the same check

Per program the table and the JSON also give the bytes one call moves per chip, loop trip counts included: in HBM
(`hbm`, `hbm_gb`: an estimate read from the compiled text, aepo_jax/train/_hlo.py) and in collectives (`coll`,
`collective_gb`, by kind in `collectives_gb`), and the bytes of any copy of a buffer of 64 MB or more
(`large_copy_gb`: a relayout of a KV pool shows here). `--hlo_dir=DIR` writes each compiled program's text;
"fits" leaves `--headroom` (5%) of HBM free.

Builds the config's model, training mesh, batch and KV-cache shapes abstractly (no checkpoint is read: a gs://
model takes its shape from `model.shape`) and compiles, with XLA:TPU and through the run's own constructors, the
programs the run runs (`--programs` selects; see aepo_jax/train/_compile.py): the SFT step (where config.mode runs
SFT), the RL update with the trainer's optimizer and the log-prob pass on the whole slice, the cast and copy of the
policy onto every host's rollout devices, and the engine's prefill and both decode variants on one host's chips.
Prints a table of per-chip memory (peak = arguments + outputs - aliased + temporaries + what stays resident on the
chip while the program runs), the shardings, compile times, and as its last line one JSON object:
  {"topology": ..., "chips": N, "hbm_gb": X, "programs": {"update": {"peak_gb": ...}, ...}, "fits": true|false}
Exits with status 1 when a program does not fit, naming the config keys that would help.
"""

import os
import sys

from absl import app, flags
from ml_collections import config_flags

if not __package__:  # run as a script from a checkout (not as `python -m aepo_jax.launch.NAME`)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Experiment config file (configs/*.py[:arg]).", lock_config=True
)
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU slice, e.g. v5p:4x4x2 (v5p-64), v6e:8x8, v5e:4x4, v4:2x2x2.")
_PROGRAMS = flags.DEFINE_list(
  "programs",
  [],
  "Programs to compile (default: those the config's run runs): sft, update, logprob, weight_cast, weight_copy, "
  "prefill, decode, decode_compact.",
)
_HLO_DIR = flags.DEFINE_string("hlo_dir", "", "Write each compiled program's text to DIR/<program>.txt.")
_HEADROOM = flags.DEFINE_float("headroom", 0.05, "Fraction of HBM left free in 'fits' (runtime, fragmentation).")


def run(config, topology: str, programs=None, hlo_dir="", headroom=0.05) -> int:
  """Compiles, prints the table and the JSON line; returns the exit status (0 fits, 1 does not)."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for TPU; run nothing on a local TPU, if any
  from aepo_jax.train import compile_check, validate

  validate(config)
  return compile_check(config, topology, programs, hlo_dir=hlo_dir, headroom=headroom)


def main(argv):
  del argv
  if not _TOPOLOGY.value:
    raise app.UsageError("--topology is required, e.g. --topology=v5p:4x4x2")
  from aepo_jax.train import apply_model_overrides

  config = apply_model_overrides(_CONFIG.value, _MODEL_OVERRIDES)
  sys.exit(run(config, _TOPOLOGY.value, _PROGRAMS.value or None, _HLO_DIR.value, _HEADROOM.value))


_MODEL_OVERRIDES: dict = {}

if __name__ == "__main__":
  from aepo_jax.train import ConfigError, resolve_config_flag, split_model_overrides

  sys.argv, _MODEL_OVERRIDES = split_model_overrides(sys.argv)
  try:  # configs/X.py not in this directory: the config the package ships
    sys.argv = resolve_config_flag(sys.argv)
  except ConfigError as e:
    sys.exit(f"error: {e}")
  flags.mark_flag_as_required("config")
  app.run(main)
