"""The trainer: cold-start SFT, then RL (GRPO / ARPO / AEPO / baselines), in one readable `run(config)`.

Everything goes to `config.workdir`: `config.json`, `metrics.jsonl`, `histograms.jsonl`, TensorBoard
events, `checkpoints/{sft,rl}/<step>`. Rerunning the same command resumes from the latest committed
checkpoint (params, optimizer state, data-iterator state, RNG), so a killed run continues bit-identically.
SIGTERM (TPU preemption) saves a checkpoint at the end of the current step and exits.

The RL step (spec §1.5): prompts -> rollouts (policy none|arpo|aepo) -> rewards -> advantages (group ids
from the rollout) -> old (+ ref) log-probs recomputed by the trainer -> ppo_epochs x mini-batches of one
jitted update step with gradient accumulation over micro-batches -> metrics, checkpoint.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from typing import Optional

import jax
import numpy as np

from aepo_jax import parallel
from aepo_jax.parallel import make_mesh
from aepo_jax.train import _batch, _checkpoint, _config, _fingerprint, _metrics, _optim, _step, _wiring

log = logging.getLogger("aepo_jax.train")


class TrainingError(RuntimeError):
  """A run that cannot continue (too many non-finite losses, an exhausted data source, ...)."""


class NothingToDo(_config.ConfigError):
  """A run that would train nothing (already finished, or zero steps): said, and the process exits non-zero."""


class _Preemption:
  """SIGTERM sets a flag; the loop saves at the end of the step and returns (spec: TPU preemption).

  On several hosts the hosts agree (`agreed(step)`, once per step on every host): JAX's preemption sync point
  (the coordination service's notice, when JAX's own handler sees the signal) or-ed with this host's flag
  gathered from every host, so every host saves the same step even when only one of them was signalled."""

  def __init__(self):
    self.requested = False
    self._old = None

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
    log.warning("SIGTERM: saving a checkpoint at the end of this step, then exiting.")
    self.requested = True

  def __exit__(self, *exc):
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)


def run(config, *, mode: Optional[str] = None) -> dict:
  """Train as `config` says (mode: sft | rl | both; default config.mode). Returns summary metrics."""
  with _wiring.run_scope():  # run-scoped state (the generated suite and its corpus) ends with the run
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
  _fingerprint.check_resume(config)  # the checkpoints here are this run's (model, data, objective, seeds)
  is_chief = jax.process_index() == 0
  if is_chief:
    (_checkpoint.epath.Path(workdir) / "config.json").write_text(_config.to_json(config))
    _fingerprint.record(config)
  writer = _metrics.create_writer(workdir, config.metrics, process_index=jax.process_index())
  progress = bool(config.metrics.progress) and is_chief

  # ---------------------------------------------------------------------------------------------------
  # Mesh, model, tokenizer.
  # ---------------------------------------------------------------------------------------------------
  mesh = make_mesh(_config.mesh_shape(config.mesh, jax.device_count()))
  _check_batch_split(config, mesh)
  model_cfg, params, tokenizer = _wiring.load_model(config, mesh)  # straight onto the mesh, in shards
  log.info("model %s: %.1fM parameters, mesh %s", config.model.name, model_cfg.num_params / 1e6, dict(mesh.shape))
  summary: dict = {}

  with _Preemption() as preempt:
    rl_ckpt = _make_checkpointer(config, "rl")
    rl_started = rl_ckpt.latest_step() is not None
    # -------------------------------------------------------------------------------------------------
    # Cold-start SFT (skipped when RL has already checkpointed).
    # -------------------------------------------------------------------------------------------------
    if mode in ("sft", "both") and config.sft.enabled and not rl_started:
      params, sft_summary = _sft_phase(config, model_cfg, params, tokenizer, mesh, writer, preempt, progress)
      summary.update(sft_summary)
      if preempt.requested:
        writer.close()
        return summary
    elif mode == "both" and config.sft.enabled and _needs_reference(config):
      # RL resumes; its KL reference is where RL started: the final SFT parameters.
      params = _sft_final_params(config, model_cfg, params, mesh)
    # -------------------------------------------------------------------------------------------------
    # RL.
    # -------------------------------------------------------------------------------------------------
    if mode in ("rl", "both"):
      params, rl_summary = _rl_phase(config, model_cfg, params, tokenizer, mesh, writer, preempt, progress)
      summary.update(rl_summary)
  summary["params"] = params
  writer.close()
  return summary


def _check_sandbox(config, mode: str) -> None:
  if mode == "sft" or "python" not in tuple(config.tools.names):
    return
  from aepo_jax import tools

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


def _make_checkpointer(config, phase: str) -> _checkpoint.Checkpointer:
  ck = config.checkpoint
  return _checkpoint.Checkpointer(
    f"{config.workdir}/checkpoints/{phase}",
    keep=ck.keep,
    best_metric=ck.best_metric if phase == "rl" else "",
    best_mode=ck.best_mode,
    async_save=ck.async_save,
    ocdbt=ck.ocdbt,
    compression=ck.compression,
  )


def _resume(ckpt, config, model_cfg, params, optimizer, mesh, seed, keep_start=False, on_corrupt=None):
  """(params, opt_state, rng key data, start step, meta, start params) from the newest intact checkpoint, or a
  fresh start. A damaged newer checkpoint is named and moved aside, or stops the run (checkpoint.on_corrupt).

  start params: with keep_start, a copy of the given (sharded) parameters, e.g. the RL start as the KL
  reference (a copy: the update step donates the parameters it is given); else None.
  """
  params, opt_state = _step.init_train_state(model_cfg, params, optimizer, mesh)
  start_params = jax.tree.map(lambda x: x.copy(), params) if keep_start else None
  rng = np.asarray(jax.random.key_data(jax.random.key(seed)))
  step, state, meta = ckpt.restore_newest_intact(
    {"params": params, "opt_state": opt_state, "rng": rng},
    config,
    on_corrupt=on_corrupt or config.checkpoint.on_corrupt,
  )
  if step is None:
    return params, opt_state, rng, 0, {}, start_params
  log.info("resuming from step %d (%s)", step, ckpt.directory)
  return state["params"], state["opt_state"], np.asarray(state["rng"]), step, meta, start_params


def _needs_reference(config) -> bool:
  return config.algo.kl.coef > 0 or config.algo.kl.use_in_reward


def _sft_final_params(config, model_cfg, params, mesh):
  """The parameters of the last SFT checkpoint (a resumed RL run's starting point), or `params` if none."""
  ckpt = _make_checkpointer(config, "sft")
  step = ckpt.latest_step()
  if step is None:
    log.warning(
      "RL resumes with a KL reference but %s holds no SFT checkpoint; the reference is the "
      "model as loaded (model.name), not the SFT result.",
      ckpt.directory,
    )
    return params
  # 'stop': an earlier SFT step as the KL reference would silently change the experiment.
  params, *_ = _resume(
    ckpt, config, model_cfg, params, _sft_optimizer(config), mesh, config.sft.seed, on_corrupt="stop"
  )
  ckpt.close()
  return params


def _save(ckpt, step, params, opt_state, rng, data_state, config, model_cfg, extra=None, metrics=None, force=False):
  meta = {
    "step": step,
    "data_state": _checkpoint.encode_iterator_state(data_state),
    "config": _config.to_json(config),
    "model_config": _checkpoint.model_config_to_json(model_cfg),
    **(extra or {}),
  }
  ckpt.save(
    step, {"params": params, "opt_state": opt_state, "rng": np.asarray(rng)}, meta, metrics=metrics, force=force
  )


def _check_finite(metrics: dict, nan_count: int, limit: int, step: int) -> int:
  skipped = int(round(float(metrics.get("train/nonfinite_skipped", 0.0))))
  nan_count += skipped
  if skipped:
    log.warning("step %d: non-finite loss or gradient, update skipped (%d so far, limit %d)", step, nan_count, limit)
  if nan_count > limit:
    raise TrainingError(
      f"{nan_count} updates had a non-finite loss or gradient norm (train.nan_limit={limit}); "
      "lower optim.lr, check the data for empty loss masks, or raise train.nan_limit."
    )
  return nan_count


# ---------------------------------------------------------------------------------------------------------
# SFT phase.
# ---------------------------------------------------------------------------------------------------------
def _sft_optimizer(config):
  s, o = config.sft, config.optim
  return _optim.make_optimizer(
    s.lr,
    weight_decay=o.weight_decay,
    b1=o.b1,
    b2=o.b2,
    eps=o.eps,
    grad_clip=o.grad_clip,
    schedule=s.schedule,
    warmup_steps=int(s.warmup_frac * s.steps),
    total_steps=s.steps,
  )


def _sft_phase(config, model_cfg, params, tokenizer, mesh, writer, preempt, progress):
  s = config.sft
  ckpt = _make_checkpointer(config, "sft")
  optimizer = _sft_optimizer(config)
  params, opt_state, rng, start, meta, _ = _resume(ckpt, config, model_cfg, params, optimizer, mesh, s.seed)
  if start >= s.steps:
    if config.mode == "sft":
      ckpt.close()
      raise NothingToDo(
        f"nothing to do: SFT in {config.workdir!r} already finished at step {start} (sft.steps={s.steps}); raise "
        "--config.sft.steps to train further, or use a new --config.workdir."
      )
    log.info("SFT already finished (step %d); using its parameters.", start)
    return params, {"sft/steps": start}

  examples = _wiring.sft_examples(config, tokenizer, model_cfg)
  loader = _wiring.index_loader(len(examples), s.batch_size, seed=s.seed)
  if meta.get("data_state") is not None:
    loader.set_state(_checkpoint.decode_iterator_state(meta["data_state"]))
  pad_id = _wiring.pad_id(model_cfg, tokenizer)
  micro = (s.packed_rows or s.batch_size) // s.micro_batch_size
  rows = (s.packed_rows or s.batch_size) // micro
  sft_step = _step.make_sft_step(
    model_cfg,
    optimizer=optimizer,
    micro_batches=micro,
    mesh=mesh,
    logit_capacity=_step.logit_capacity(config.train.logit_fraction, rows, s.max_len),
    saved_logits_mb=config.train.saved_logits_mb,
  )
  nan_count = int(meta.get("nan_count", 0))

  bar = _metrics.progress(s.steps, "sft", initial=start, enabled=progress)
  perf = _metrics.Throughput(s.steps, start, meta.get("tokens_total", 0.0), config.train.peak_tflops)
  step, m = start, {}
  while step < s.steps:
    ckpt.check()  # a failed async save stops the run here, naming its step
    t0 = time.perf_counter()
    idx = next(loader)
    try:
      batch = _batch.sft_batch(
        [examples[i] for i in idx],
        micro_batch_size=s.micro_batch_size,
        pad_id=pad_id,
        seq_len=s.max_len,
        truncate=True,
        packed_rows=s.packed_rows or None,
      )
    except ValueError as e:
      if not s.packed_rows:
        raise
      raise ValueError(
        f"SFT step {step + 1}: {e}. Raise sft.packed_rows (at most sft.batch_size="
        f"{s.batch_size}) or sft.max_len={s.max_len}, or set sft.packed_rows=0."
      ) from e
    params, opt_state, m = sft_step(params, opt_state, _batch.shard_batch(_batch.process_rows(batch, mesh), mesh))
    step += 1
    m = jax.device_get(m)
    nan_count = _check_finite(m, nan_count, config.train.nan_limit, step)
    dt = time.perf_counter() - t0
    tokens = float(np.sum(batch["attention_mask"]))  # every token the step ran, not only the trained ones
    m.update(perf.step(step, dt, tokens, _metrics.model_flops(model_cfg, tokens, s.max_len, forward_passes=3)))
    m.update({"perf/tokens_per_s": float(m["train/tokens"]) / dt, "sft/step": step})
    if step % config.train.log_every == 0 or step == s.steps:
      writer.scalars(step, {k.replace("train/", "sft/"): v for k, v in m.items()})
      writer.flush()
    bar.update(1)
    bar.set_postfix(nll=f"{float(m.get('sft/nll', float('nan'))):.3f}")
    stop = preempt.agreed(step)  # every host sees the same answer at the same step
    if step % config.checkpoint.every_steps == 0 or step == s.steps or stop:
      _save(
        ckpt,
        step,
        params,
        opt_state,
        rng,
        loader.get_state(),
        config,
        model_cfg,
        {"phase": "sft", "nan_count": nan_count, "tokens_total": perf.tokens_total},
        force=stop,
      )
    if stop:
      break
  bar.close()
  ckpt.close()
  return params, {"sft/steps": step, "sft/final_nll": float(m.get("sft/nll", float("nan")))}


# ---------------------------------------------------------------------------------------------------------
# RL phase.
# ---------------------------------------------------------------------------------------------------------
def _rl_phase(config, model_cfg, params, tokenizer, mesh, writer, preempt, progress):
  t, r, a, o = config.train, config.rollout, config.algo, config.optim
  ckpt = _make_checkpointer(config, "rl")
  loader, num_train = _wiring.prompt_loader(config, tokenizer)
  total = t.steps or t.epochs * math.ceil(num_train / config.data.prompts_per_step)
  optimizer = _optim.make_optimizer(
    o.lr,
    weight_decay=o.weight_decay,
    b1=o.b1,
    b2=o.b2,
    eps=o.eps,
    grad_clip=o.grad_clip,
    schedule=o.schedule,
    warmup_steps=o.warmup_steps,
    total_steps=total * _updates_per_step(config),
    min_lr_ratio=o.end_lr_fraction,
  )
  # The KL reference is the RL start (the SFT result or the loaded model), also when the run resumes.
  params, opt_state, rng, start, meta, ref_params = _resume(
    ckpt, config, model_cfg, params, optimizer, mesh, t.seed, keep_start=_needs_reference(config)
  )
  if start >= total:
    ckpt.close()
    raise NothingToDo(
      f"nothing to do: RL in {config.workdir!r} already finished at step {start} (train.steps={t.steps}, "
      f"train.epochs={t.epochs}: {total} steps); raise --config.train.steps to train further, or use a new "
      "--config.workdir."
      if start
      else f"nothing to do: train.epochs={t.epochs} over {num_train} training prompts gives 0 RL steps; check "
      "data.train, or set --config.train.steps."
    )
  if meta.get("data_state") is not None:
    loader.set_state(_checkpoint.decode_iterator_state(meta["data_state"]))
  nan_count = int(meta.get("nan_count", 0))

  tools = _wiring.make_toolset(config)
  rollout = _wiring.make_rollout(config, model_cfg, tokenizer, tools)  # on this host's own devices
  reward_fn = _wiring.make_reward(config)
  adv_fn = _wiring.advantage_fn(config)
  pad_id = _wiring.pad_id(model_cfg, tokenizer)
  seq_len = r.max_prompt_len + r.max_response_len
  mb_per_update = t.ppo_mini_batch_size * r.n // t.micro_batch_size
  update_step = _wiring.make_rl_update_step(config, model_cfg, optimizer, mesh)
  logprob_fn = _step.make_logprob_fn(model_cfg, mesh, temperature=r.temperature)

  eval_rollout, judge = [], []  # built on first use

  def evaluate(step, phase="rl"):
    if not eval_rollout:
      eval_rollout.append(_wiring.make_eval_rollout(config, model_cfg, tokenizer, tools))
      judge.extend(_wiring.serve_judge(config))  # eval.judge_checkpoint: a judge served here for the run
    log.info("evaluating (%s, step %d) on %s", phase, step, ", ".join(map(str, config.data.val)))
    records = f"{str(config.workdir).rstrip('/')}/eval/{phase}_{step}.jsonl"  # every answer, to read back
    ev = _wiring.evaluate(judge[0], eval_rollout[0], params, records)
    if tools:  # the evaluation's own tool calls, kept out of the next RL step's tools/* counters
      ev.update({f"eval/tools/{k.split('/', 1)[-1]}": v for k, v in tools.metrics().items()})
      tools.reset_metrics()
    writer.scalars(step, ev)
    writer.flush()
    return ev

  summary = {}
  if start == 0 and config.eval.before_rl and config.data.val:
    summary.update({f"before_rl/{k}": v for k, v in evaluate(0, "before_rl").items()})

  bar = _metrics.progress(total, "rl", initial=start, enabled=progress)
  timer = _metrics.Timer()
  perf = _metrics.Throughput(total, start, meta.get("tokens_total", 0.0), t.peak_tflops)
  step = start
  while step < total:
    ckpt.check()  # a failed async save stops the run here, naming its step
    # -- rollout ------------------------------------------------------------------------------------------
    key = jax.random.wrap_key_data(rng)
    key, rollout_key = jax.random.split(key)
    rng = np.asarray(jax.random.key_data(key))
    # -- rollouts and rewards (DAPO dynamic sampling may generate several batches) --------------------------
    with timer("rollout"):
      weights = rollout.weights(params)  # the policy on this host's rollout devices (once per step)
    traj, prompts, rewards_b, gen_metrics = _generate(
      config, loader, rollout, reward_fn, weights, rollout_key, pad_id, timer
    )
    del weights  # the rollout copy is not kept through the update
    with timer("reward"):
      # Each host's own rollout time and trajectories (a straggler's wait lands here, in the first gather).
      gen_metrics.update(_host_rollout_metrics(timer.times.get("perf/rollout_s", 0.0), len(traj.group_id_b), step + 1))
      # Every host's trajectories on every host: from here on all hosts build the same global batch.
      traj, rewards_b = _batch.gather_trajectories(traj, rewards_b, pad_id=pad_id)
      adv_bt = np.asarray(
        adv_fn(
          rewards_b, np.asarray(traj.group_id_b), np.asarray(traj.loss_mask_bt), tree=(traj.parent_b, traj.fork_pos_b)
        )
      )
    # -- old / reference log-probs (recomputed by the trainer, spec §1.5) ------------------------------------
    with timer("logprob"):
      # The global batch in micro-batches as one host would build it; this host feeds its share of each.
      rows_multiple = t.micro_batch_size * mb_per_update
      batch_np = _batch.trajectories_batch(
        traj, adv_bt, micro_batch_size=t.micro_batch_size, pad_id=pad_id, seq_len=seq_len, rows_multiple=rows_multiple
      )
      batch = _batch.shard_batch(_batch.process_rows(batch_np, mesh), mesh)
      batch["old_log_prob"], _ = logprob_fn(params, batch["tokens"], batch["attention_mask"])
      if ref_params is not None:
        batch["ref_log_prob"], _ = logprob_fn(ref_params, batch["tokens"], batch["attention_mask"])
      mismatch = _step.logprob_mismatch_metrics(batch["old_log_prob"], batch["sampler_log_prob"], batch["loss_mask"])
    if a.kl.use_in_reward:  # verl apply_kl_penalty: token rewards -coef * KL(old, ref), then the advantages again
      with timer("reward"):
        adv_bt, kl_metrics = _kl_in_reward(config, batch, traj, rewards_b, adv_fn, mesh)
        adv_np = _batch.micro_batches(  # the same row layout as the batch; only the advantages are new
          {"tokens": traj.tokens_bt, "advantages": adv_bt},
          micro_batch_size=t.micro_batch_size,
          pad_id=pad_id,
          seq_len=seq_len,
          rows_multiple=rows_multiple,
        )["advantages"]
        batch["advantages"] = _batch.shard_batch(_batch.process_rows({"advantages": adv_np}, mesh), mesh)["advantages"]
        gen_metrics.update(kl_metrics)
    # -- updates: ppo_epochs x mini-batches --------------------------------------------------------------------
    with timer("update"):
      step_metrics = []
      for _ in range(t.ppo_epochs):
        for mini in _batch.split_updates(batch, mb_per_update):
          params, opt_state, m = update_step(params, opt_state, mini)
          step_metrics.append(m)
      step_metrics = jax.device_get(step_metrics)
    step += 1
    for m in step_metrics:
      nan_count = _check_finite(m, nan_count, t.nan_limit, step)
    # -- metrics --------------------------------------------------------------------------------------------
    scalars = {k: float(np.mean([m[k] for m in step_metrics])) for k in step_metrics[0]}
    scalars.update(jax.device_get(mismatch))
    scalars.update(_wiring.rollout_metrics(traj, rewards_b, adv_bt))
    scalars.update(gen_metrics)
    scalars.update({f"tools/{k.split('/', 1)[-1]}": v for k, v in tools.metrics().items()} if tools else {})
    scalars.update(timer.pop())
    n_tok = float(np.sum(traj.loss_mask_bt))
    step_s = sum(v for k, v in scalars.items() if k.startswith("perf/"))  # rollout + reward + logprob + update
    scalars["perf/tokens_per_s"] = n_tok / max(step_s, 1e-9)
    all_tok = float(np.sum(traj.attention_mask_bt))  # old (+ ref) log-probs: 1 (+ 1) forward; updates: 3 each
    passes = 3 * t.ppo_epochs + 1 + (1 if ref_params is not None else 0)
    scalars.update(
      perf.step(step, step_s, all_tok, _metrics.model_flops(model_cfg, all_tok, seq_len, forward_passes=passes))
    )
    if tools:
      tools.reset_metrics()
    if step % t.log_every == 0 or step == total:
      writer.scalars(step, scalars)
      if config.metrics.histograms:
        writer.histograms(step, _wiring.rollout_histograms(traj, adv_bt))
      writer.flush()
    bar.update(1)
    bar.set_postfix(reward=f"{scalars.get('reward/mean', float('nan')):.3f}")
    # -- evaluation and checkpoint ----------------------------------------------------------------------------
    ev = {}
    if t.eval_every and step % t.eval_every == 0 and config.data.val:
      ev = evaluate(step)
    stop = preempt.agreed(step)  # every host sees the same answer at the same step
    if step % config.checkpoint.every_steps == 0 or step == total or stop or ev:
      _save(
        ckpt,
        step,
        params,
        opt_state,
        rng,
        loader.get_state(),
        config,
        model_cfg,
        {"phase": "rl", "nan_count": nan_count, "tokens_total": perf.tokens_total, "metrics": {**scalars, **ev}},
        metrics=ev or None,
        force=stop,
      )
    if stop:
      break
  bar.close()
  if not preempt.requested and config.eval.after_rl and config.data.val:
    summary.update({f"after_rl/{k}": v for k, v in evaluate(step, "after_rl").items()})
  if judge and judge[1] is not None:
    judge[1].shutdown(drain_s=5.0)
  ckpt.close()
  summary["rl/steps"] = step
  return params, summary


def _host_rollout_metrics(rollout_s: float, trajectories: int, step: int) -> dict:
  """hosts/rollout_s_max|min and hosts/trajectories_max|min over the hosts (this host's own on one); with several
  hosts, process 0 also logs a per-host table, so a straggling host is named. Every host calls it at the same point
  (a small collective)."""
  rows = parallel.allgather_json([float(rollout_s), int(trajectories)])
  if len(rows) > 1 and jax.process_index() == 0:
    slowest = max(range(len(rows)), key=lambda p: rows[p][0])
    log.info(
      "RL step %d, per host (rollout s, trajectories): %s; slowest host %d",
      step,
      ", ".join(f"{p}: {t:.1f} s {n}" for p, (t, n) in enumerate(rows)),
      slowest,
    )
  times, counts = [r[0] for r in rows], [r[1] for r in rows]
  return {
    "hosts/rollout_s_max": max(times),
    "hosts/rollout_s_min": min(times),
    "hosts/trajectories_max": float(max(counts)),
    "hosts/trajectories_min": float(min(counts)),
  }


def _generate(config, loader, rollout, reward_fn, weights, key, pad_id, timer):
  """(trajectories, prompts by group id, rewards [N], metrics) for one RL step.

  Without algo.filter_groups: one batch of prompts, rolled out. With it (DAPO dynamic sampling, spec §3.2):
  groups whose filter metric is equal across the group are dropped and further batches are generated until
  this host has its share of data.prompts_per_step groups (hosts agree on the number of batches, so their data
  iterators stay in step for the checkpoint); after algo.max_num_gen_batches batches the step goes on with dropped groups
  filling the rest (verl raises instead) and says so in `rollout/filter_underfilled`.
  """
  a = config.algo
  if not a.filter_groups:
    prompts = next(loader)
    with timer("rollout"):
      traj = rollout(weights, prompts, key)
    with timer("reward"):
      rewards_b = np.asarray(reward_fn(traj, prompts), np.float32)
    return traj, prompts, rewards_b, {}
  from aepo_jax import objectives
  from aepo_jax.rollout import concat_groups

  want = _wiring.host_share(config.data.prompts_per_step)
  kept, dropped = [], []  # (traj, group id, prompt, rewards of the group's rows)
  gen = 0
  while True:
    prompts = next(loader)
    with timer("rollout"):
      traj = rollout(weights, prompts, jax.random.fold_in(key, gen))
    gen += 1
    with timer("reward"):
      rewards_b = np.asarray(reward_fn(traj, prompts), np.float32)
      metric_b = rewards_b if a.filter_metric == "reward" else _wiring.correct_b(traj, prompts)
      keep_b = np.asarray(objectives.dynamic_sampling_keep(metric_b, np.asarray(traj.group_id_b)))
    g_b = np.asarray(traj.group_id_b)
    for g in dict.fromkeys(g_b.tolist()):
      rows = g_b == g
      (kept if keep_b[rows].all() else dropped).append((traj, g, prompts[g], rewards_b[rows]))
    need_more = parallel.any_host(len(kept) < want)
    if not need_more:
      break
    if a.max_num_gen_batches and gen >= a.max_num_gen_batches:
      log.warning(
        "DAPO dynamic sampling: %d of %d groups with differing %s after %d generation batches "
        "(algo.max_num_gen_batches); filling with zero-variance groups.",
        len(kept),
        want,
        a.filter_metric,
        gen,
      )
      break
  chosen = (kept + dropped)[:want]
  traj = concat_groups([(tr, [g]) for tr, g, _, _ in chosen], pad_id=pad_id)
  metrics = {
    "rollout/gen_batches": float(gen),
    "rollout/kept_group_fraction": len(kept) / max(len(kept) + len(dropped), 1),
    "rollout/filter_underfilled": float(len(kept) < want),
  }
  return traj, [p for _, _, p, _ in chosen], np.concatenate([r for _, _, _, r in chosen]), metrics


def _kl_in_reward(config, batch, traj, rewards_b, adv_fn, mesh):
  """Advantages with the token-level KL penalty −coef·KL(old, ref) in the reward (verl apply_kl_penalty)."""
  from aepo_jax import objectives

  kl = config.algo.kl
  tok = objectives.kl_reward_penalty(
    batch["old_log_prob"], batch["ref_log_prob"], batch["loss_mask"], coef=kl.coef, estimator=kl.name
  )
  n, t = np.asarray(traj.loss_mask_bt).shape
  full = _batch.global_value(tok)  # the global batch's rows, in the layout of `traj` (every host's)
  token_rewards_bt = full.reshape(-1, full.shape[-1])[:n, :t]
  mask = np.asarray(traj.loss_mask_bt) > 0
  adv_bt = np.asarray(
    adv_fn(
      rewards_b,
      np.asarray(traj.group_id_b),
      np.asarray(traj.loss_mask_bt),
      token_rewards_bt=token_rewards_bt,
      tree=(traj.parent_b, traj.fork_pos_b),
    )
  )
  penalty_b = np.sum(np.where(mask, token_rewards_bt, 0.0), axis=1)
  return adv_bt, {
    "kl/reward_penalty_mean": float(np.mean(penalty_b)),
    "kl/reward_kl_token_mean": float(-np.sum(penalty_b) / max(mask.sum(), 1) / kl.coef),
  }


def _updates_per_step(config) -> int:
  return config.train.ppo_epochs * (config.data.prompts_per_step // config.train.ppo_mini_batch_size)
