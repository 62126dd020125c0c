"""The trainer: cold-start SFT, then RL (GRPO / ARPO / AEPO / baselines), in one readable `run(config)`.

Everything goes to `config.workdir`: `config.json`, `metrics.jsonl`, `histograms.jsonl`, TensorBoard
events, `checkpoints/{sft,rl}/<step>`. Rerunning the same command resumes from the latest committed
checkpoint (params, optimizer state, data-iterator state, RNG), so a killed run continues bit-identically.
SIGTERM (TPU preemption) saves a checkpoint at the end of the current step and exits; during an RL rollout it is
noticed between decode chunks and tool polls, and the state at the start of that step is saved instead.

The phases: `_sft.phase` (cold-start SFT) and `_rl.phase` (the RL step, spec §1.5), each handed the run's fixed
parts as one `_phase.Run`.
"""

from __future__ import annotations

import logging
import signal
from typing import Optional

import jax
from etils import epath

from aepo_jax import checkpoint as _checkpoint
from aepo_jax import parallel
from aepo_jax.parallel import make_mesh
from aepo_jax.train import _config, _fingerprint, _inputs, _metrics, _rl, _sft
from aepo_jax.train._phase import NothingToDo, Run, TrainingError, needs_reference

__all__ = ["NothingToDo", "TrainingError", "run"]

log = logging.getLogger("aepo_jax.train")


class _Preemption:
  """SIGTERM sets a flag; the loop saves at the end of the step (or, in an RL rollout, which asks `is_requested`
  between decode chunks, at the start of the step) and returns (spec: TPU preemption).

  On several hosts the hosts agree (`agreed(step)`, once per step on every host): JAX's preemption sync point
  (the coordination service's notice, when JAX's own handler sees the signal) or-ed with this host's flag
  gathered from every host, so every host saves the same step even when only one of them was signalled."""

  def __init__(self):
    self.requested = False
    self._old = None

  def is_requested(self) -> bool:
    """This host's flag (no collective): the rollout asks it between decode chunks."""
    return self.requested

  def agreed(self, step: int) -> bool:
    if jax.process_count() == 1:
      return self.requested
    from jax.experimental import multihost_utils

    try:
      synced = multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError:  # the preemption service is off (jax_enable_preemption_service)
      synced = False
    self.requested = parallel.any_host(self.requested or synced)
    return self.requested

  def __enter__(self):
    try:
      self._old = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread (e.g. a notebook worker): no handler, no flag
      self._old = None
    return self

  def _handle(self, signum, frame):
    log.warning("SIGTERM: saving a checkpoint (this step's end, or in a rollout its start), then exiting.")
    self.requested = True

  def __exit__(self, *exc):
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)


def run(config, *, mode: Optional[str] = None) -> dict:
  """Train as `config` says (mode: sft | rl | both; default config.mode). Returns summary metrics."""
  with _inputs.run_scope():  # run-scoped state (the generated suite and its corpus) ends with the run
    return _run(config, mode or config.mode)


def _run(config, mode: str) -> dict:
  # ---------------------------------------------------------------------------------------------------
  # Config, work directory, writers.
  # ---------------------------------------------------------------------------------------------------
  _config.validate(config, num_devices=jax.device_count())
  from aepo_jax.train import _preflight

  _preflight.check(config, probe=True)  # files, model, tokenizer, backends, URLs; a retrieval server's /health
  _check_sandbox(config, mode)  # before SFT: a sandbox that cannot start would otherwise fail only at RL
  workdir = config.workdir
  _check_shared_workdir(config)
  _checkpoint.check_writable(workdir)
  try:
    compile_cache = parallel.use_compile_cache(config.train.get("compile_cache", "auto"), workdir)
  except parallel.CompileCacheError as e:
    raise _config.ConfigError(str(e)) from None
  cache_before = parallel.compile_cache_stats()
  _fingerprint.check_resume(config)  # the checkpoints here are this run's (model, data, objective, seeds)
  is_chief = jax.process_index() == 0
  if is_chief:
    (epath.Path(workdir) / "config.json").write_text(_config.to_json(config))
    _fingerprint.record(config)
  writer = _metrics.create_writer(workdir, config.metrics, process_index=jax.process_index())
  progress = bool(config.metrics.progress) and is_chief

  # ---------------------------------------------------------------------------------------------------
  # Mesh, model, tokenizer.
  # ---------------------------------------------------------------------------------------------------
  mesh = make_mesh(_config.mesh_shape(config.mesh, jax.device_count()))
  _check_batch_split(config, mesh)
  model_cfg, params, tokenizer = _inputs.load_model(config, mesh)  # straight onto the mesh, in shards
  _check_expert_split(config, model_cfg, mesh)
  log.info("model %s: %.1fM parameters, mesh %s", config.model.name, model_cfg.num_params / 1e6, dict(mesh.shape))
  summary: dict = {}

  with _Preemption() as preempt:
    run = Run(config, model_cfg, tokenizer, mesh, writer, preempt, progress)
    try:
      params = _phases(run, mode, params, summary)
    except BaseException:
      run.close_after_error()
      raise
  if params is not None:
    summary["params"] = params
  if compile_cache:
    stats = {k: v - cache_before[k] for k, v in parallel.compile_cache_stats().items()}
    summary.update({f"compile_cache/{k}": v for k, v in stats.items()})
    log.info("compilation cache %s: %d of %d programs read from it", compile_cache, stats["hits"], stats["requests"])
  writer.close()
  return summary


def _phases(run: Run, mode: str, params, summary: dict):
  """SFT then RL as `mode` says, each resumed from its checkpoints, filling `summary`: the parameters at the end,
  or None when a preemption stopped SFT."""
  config = run.config
  rl_ckpt = run.checkpointer("rl")
  rl_started = rl_ckpt.latest_step() is not None
  rl_ckpt.close()
  # ---------------------------------------------------------------------------------------------------
  # Cold-start SFT (skipped when RL has already checkpointed).
  # ---------------------------------------------------------------------------------------------------
  if mode in ("sft", "both") and config.sft.enabled and not rl_started:
    params, sft_summary = _sft.phase(run, params)
    summary.update(sft_summary)
    if run.preempt.requested:
      return None
  elif mode == "both" and config.sft.enabled and needs_reference(config):
    # RL resumes; its KL reference is where RL started: the final SFT parameters.
    params = _sft.final_params(run, params)
  # ---------------------------------------------------------------------------------------------------
  # RL.
  # ---------------------------------------------------------------------------------------------------
  if mode in ("rl", "both"):
    params, rl_summary = _rl.phase(run, params)
    summary.update(rl_summary)
  return params


def _check_sandbox(config, mode: str) -> None:
  from aepo_jax import tools

  if mode == "sft" or not tools.needs_sandbox(config.tools.names, plugins=tuple(config.tools.get("plugins", ()))):
    return
  isolation = tools.check_sandbox(allow_unsandboxed=config.tools.allow_unsandboxed)
  log.info("python tool sandbox: %s", isolation)


def _check_shared_workdir(config) -> None:
  """Every host writes checkpoints (and reads them back) in the workdir: a host-local path would split them."""
  if jax.process_count() > 1 and not str(config.workdir).startswith("gs://") and not config.checkpoint.shared_workdir:
    raise _config.ConfigError(
      f"workdir={config.workdir!r} is a local path but this run has {jax.process_count()} hosts, which must all "
      "see the same checkpoints: use gs://BUCKET/path, or set --config.checkpoint.shared_workdir=True if the path "
      "is storage mounted on every host (NFS, Filestore; or processes on one machine)."
    )


def _check_expert_split(config, model_cfg, mesh) -> None:
  """mesh.expert_axis splits the experts whole: their count must divide evenly over those devices (else the
  rules table would quietly keep every expert on every device)."""
  axis = str(config.mesh.expert_axis or "")
  if not axis or not model_cfg.has_experts:
    return
  size = 1
  for a in axis.split(","):
    size *= mesh.shape[a]
  if model_cfg.num_experts % size:
    raise _config.ConfigError(
      f"mesh.expert_axis={axis!r} splits {model_cfg.num_experts} experts over {size} devices, which does not divide "
      f"them: make the product of mesh.{' x mesh.'.join(axis.split(','))} divide {model_cfg.num_experts}, or set "
      "mesh.expert_axis=''."
    )


def _check_batch_split(config, mesh) -> None:
  """Every host rolls out at least one prompt; every micro-batch splits evenly over the mesh's data x fsdp devices
  (each host then takes the rows its devices hold, `_batch.process_rows`, whatever the mesh's device order)."""
  n = jax.process_count()
  rows = mesh.shape["data"] * mesh.shape["fsdp"]
  if n > 1 and config.mode != "sft" and config.data.prompts_per_step < n:
    raise _config.ConfigError(
      f"data.prompts_per_step={config.data.prompts_per_step} is smaller than the {n} hosts; "
      f"every host rolls out at least one prompt per step: use at least {n}."
    )
  checks = []
  if config.mode != "sft":
    checks.append(("train.micro_batch_size", config.train.micro_batch_size))
  if config.sft.enabled or config.mode == "sft":
    checks.append(("sft.micro_batch_size", config.sft.packed_rows or config.sft.micro_batch_size))
  for key, mb in checks:
    if n > 1 and mb % rows:
      raise _config.ConfigError(
        f"{key}={mb} rows must split evenly over the mesh's data x fsdp = {rows} devices; use a multiple of {rows}."
      )
