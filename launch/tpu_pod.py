r"""Train on a TPU pod, a single accelerator host, or CPU processes: cold-start SFT, RL, or both.

  # every host of a TPU pod (jax.distributed discovers the pod by itself):
  python launch/tpu_pod.py --config=configs/aepo_gaia.py --config.workdir=gs://BUCKET/aepo_gaia
  # one machine, CPU (the embedded default):
  python launch/tpu_pod.py --config=configs/cpu_default.py --config.workdir=/tmp/aepo_cpu
  # two CPU processes on one machine with gloo collectives, standing in for two hosts (run both lines):
  python launch/tpu_pod.py --config=... --config.checkpoint.shared_workdir=True \
      --coordinator_address=127.0.0.1:12355 --num_processes=2 --process_id=0
  python launch/tpu_pod.py --config=... --config.checkpoint.shared_workdir=True \
      --coordinator_address=127.0.0.1:12355 --num_processes=2 --process_id=1
  # the same two processes as the hosts of a v5p:2x2x2 slice, every mesh in its device order: add to both lines
      --emulate_topology=v5p:2x2x2

Any config key can be overridden: `--config.rollout.n=8 --config.train.steps=100`. The config is validated
before any device is claimed; rerunning the same command resumes from the latest checkpoint in the workdir.
"""

import logging
import os
import sys

from absl import app, flags
from ml_collections import config_flags

if not __package__:  # run as a script from a checkout (not as `python -m aepo_jax.launch.NAME`)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Experiment config file (configs/*.py[:arg]).", lock_config=True
)
_MODE = flags.DEFINE_enum("mode", None, ["sft", "rl", "both"], "Override config.mode.")
_COORD = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process CPU/GPU).")
_NPROC = flags.DEFINE_integer("num_processes", None, "Number of processes (multi-process CPU/GPU).")
_PID = flags.DEFINE_integer("process_id", None, "This process's index (multi-process CPU/GPU).")
_CPU_COLLECTIVES = flags.DEFINE_string("cpu_collectives", "gloo", "CPU collectives for multi-process CPU runs.")
_PLATFORM = flags.DEFINE_string("platform", None, "Force a JAX platform (cpu, tpu, gpu).")
_EMULATE_TOPOLOGY = flags.DEFINE_string(
  "emulate_topology",
  None,
  "CPU only: these processes stand in for the hosts of this TPU slice (e.g. v5p:2x2x2, v6e:4x4) and every mesh is "
  "built in the slice's device order (needs libtpu; one process per host of the slice).",
)
_TOPOLOGY = flags.DEFINE_string(
  "topology",
  None,
  "With --dry_run: also compile the RL step for this TPU slice "
  "(e.g. v5p:4x4x2) and check it fits (launch/compile.py; needs libtpu).",
)
_VERBOSE = flags.DEFINE_bool("verbose", False, "Also show other libraries' INFO lines (Orbax, bm25s, optax).")
_DRY_RUN = flags.DEFINE_bool(
  "dry_run",
  False,
  "Validate the config and check its files, model, tokenizer, backends "
  "and URLs (no device), print it as JSON and exit.",
)


def main(argv):
  del argv
  from aepo_jax import logs

  logs.setup(verbose=_VERBOSE.value)  # other libraries' INFO lines off unless --verbose
  from aepo_jax import train

  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config=configs/<experiment>.py is required.")
  train.apply_model_overrides(config, _MODEL_OVERRIDES)
  if _MODE.value:
    config.mode = _MODE.value
  try:
    train.validate(config)  # before any device is claimed; the mesh is checked once devices are known
  except train.ConfigError as e:  # the key and the fix, no traceback
    sys.exit(f"error: {e}")
  if _DRY_RUN.value:  # also check files, names, backends and URLs; still claim no device
    rows = train.preflight_checklist(config)
    print(train.format_checklist(rows, flags.FLAGS["config"].serialize().split("=", 1)[-1]), flush=True)
    problems = [m for _, _, found in rows for m in found]
    if problems:
      sys.exit("error: the config cannot run here:\n  " + "\n  ".join(problems))
    print("the resolved config (JSON):")
    print(train.to_json(config))
    if _TOPOLOGY.value:
      os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the slice; claim no local device
      sys.exit(train.compile_check(config, _TOPOLOGY.value))
    return

  if _PLATFORM.value:
    os.environ["JAX_PLATFORMS"] = _PLATFORM.value
  from aepo_jax import parallel

  if _EMULATE_TOPOLOGY.value:
    _emulated_devices(parallel, _EMULATE_TOPOLOGY.value)  # before JAX starts its backend
  parallel.use_cpu_xla_flags()  # XLA:CPU flags on the CPU only, before JAX starts its backend
  import jax

  # Every Cloud TPU VM / GKE TPU host joins jax.distributed by itself (coordinator from the TPU metadata); CPU and
  # GPU processes need --coordinator_address/--num_processes/--process_id (or JAX_COORDINATOR_ADDRESS, ...).
  parallel.initialize_distributed(_COORD.value, _NPROC.value, _PID.value, cpu_collectives=_CPU_COLLECTIVES.value)
  if _EMULATE_TOPOLOGY.value:
    try:  # refuses a process / device count that is not the slice's
      parallel.emulate_topology(_EMULATE_TOPOLOGY.value)
    except ValueError as e:
      sys.exit(f"error: {e}")
  logging.info(
    "process %d/%d, %d devices (%d local)",
    jax.process_index(),
    jax.process_count(),
    jax.device_count(),
    jax.local_device_count(),
  )

  from aepo_jax.tools import SandboxUnavailableError
  from aepo_jax.train import CheckpointError, ConfigError, PreflightError, run

  try:
    summary = run(config)
  except (
    CheckpointError,
    ConfigError,
    PreflightError,
    SandboxUnavailableError,
  ) as e:  # one paragraph that names the input and the fix; no traceback
    logging.error("%s", e)
    sys.exit(f"error: {e}")
  if jax.process_index() == 0:
    logging.info("done: %s", {k: v for k, v in summary.items() if k != "params"})


def _emulated_devices(parallel, name: str) -> None:
  """CPU processes as the hosts of the TPU slice `name`: each gets the slice's chips per host as CPU devices."""
  if not parallel.platform_is_cpu():
    sys.exit(
      f"error: --emulate_topology={name} is for CPU processes; on a TPU slice the meshes already have its order."
    )
  os.environ["JAX_PLATFORMS"] = "cpu"
  try:
    hosts, per_host = parallel.slice_hosts(name)
  except ValueError as e:
    sys.exit(f"error: {e}")
  xla = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in xla:
    os.environ["XLA_FLAGS"] = f"{xla} --xla_force_host_platform_device_count={per_host}".strip()
  logging.info("emulating %s: %d processes of %d CPU devices each", name, hosts, per_host)


def _check_override_keys(argv) -> None:
  """absl reports an unknown `--config.a.b` as a bare KeyError; name the key and the closest one instead."""
  from aepo_jax.train import unknown_key_hint

  for arg in argv[1:]:
    if not arg.startswith("--config.") or arg.startswith("--config.model.overrides."):
      continue
    key = arg[len("--config.") :].split("=", 1)[0]
    hint = unknown_key_hint(key)
    if hint is not None:
      sys.exit(f"error: config key {key!r} (from {arg!r}) does not exist{hint}")


_MODEL_OVERRIDES: dict = {}

if __name__ == "__main__":
  from aepo_jax.train import ConfigError, resolve_config_flag, split_model_overrides

  sys.argv, _MODEL_OVERRIDES = split_model_overrides(sys.argv)  # absl cannot add keys to model.overrides
  try:  # configs/X.py not in this directory: the config the package ships
    sys.argv = resolve_config_flag(sys.argv)
  except ConfigError as e:
    sys.exit(f"error: {e}")
  flags.mark_flag_as_required("config")
  _check_override_keys(sys.argv)
  app.run(main)
