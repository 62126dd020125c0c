"""The agentic RL phase. One step (spec §1.5): prompts -> rollouts (policy none|arpo|aepo) on each host's own
devices -> rewards -> advantages (group ids from the rollout) -> old (+ ref) log-probs recomputed by the trainer ->
ppo_epochs x mini-batches of one jitted update step with gradient accumulation over micro-batches -> metrics,
validation, checkpoint."""

from __future__ import annotations

import logging
import math

import jax
import numpy as np

from aepo_jax import checkpoint as _checkpoint
from aepo_jax import parallel
from aepo_jax.rollout import RolloutInterrupted
from aepo_jax.train import _batch, _inputs, _logprob, _metrics, _objective, _optim, _validation, _wiring
from aepo_jax.train._config_checks import ConfigError, routing_replay_error
from aepo_jax.train._phase import NothingToDo, Run, TrainState, check_finite, needs_reference, resume, save

log = logging.getLogger("aepo_jax.train")


def phase(run: Run, params):
  """Agentic RL to train.steps (or train.epochs), resumed from its newest checkpoint, with validation before,
  during and after as eval.* says: (params, summary)."""
  config, model_cfg, tokenizer, mesh, writer = run.config, run.model_cfg, run.tokenizer, run.mesh, run.writer
  t, r, a = config.train, config.rollout, config.algo
  if a.routing_replay != "none" and not model_cfg.has_experts:  # validate() cannot tell for every model.name
    raise ConfigError(routing_replay_error(config.model.name))
  ckpt = run.checkpointer("rl")
  loader, num_train = _inputs.prompt_loader(config, tokenizer)
  total = t.steps or t.epochs * math.ceil(num_train / config.data.prompts_per_step)
  optimizer = make_optimizer(config, total)
  # The KL reference is the RL start (the SFT result or the loaded model), also when the run resumes.
  state, ref_params = resume(run, ckpt, params, optimizer, t.seed, keep_start=needs_reference(config))
  start, meta = state.step, state.meta
  if start >= total and start and _after_rl_pending(config, start):
    # Stopped after its last step was saved but before the after-RL evaluation finished (a kill or preemption
    # inside it): finish that evaluation, nothing else.
    log.info("RL finished at step %d; its after-RL evaluation did not: evaluating", start)
    validation = _validation.Validation(run, _wiring.make_toolset(config))
    try:
      summary = _after_rl(validation, config, state.params, start)
    finally:
      validation.close()
      ckpt.close()
    return state.params, {**summary, "rl/steps": start}
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
  if start and t.max_staleness:
    log.info(
      "partial rollouts (train.max_staleness=%d): the groups carried over at step %d were dropped at the restart "
      "(they are not checkpointed); this run starts with none carried.",
      t.max_staleness,
      start,
    )

  tools = _wiring.make_toolset(config)
  rollout = _wiring.make_rollout(config, model_cfg, tokenizer, tools)  # on this host's own devices
  reward_fn = _objective.make_reward(config)
  adv_fn = _objective.advantage_fn(config)
  pad_id = _inputs.pad_id(model_cfg, tokenizer)
  seq_len = r.max_prompt_len + r.max_response_len
  mb_per_update = t.ppo_mini_batch_size * r.n // t.micro_batch_size
  update_step = _objective.make_rl_update_step(config, model_cfg, optimizer, mesh)
  replay = a.routing_replay == "rollout"
  logprob_fn = _logprob.make_logprob_fn(model_cfg, mesh, run.rules, temperature=r.temperature, with_routes=replay)
  disagreement_fn = (
    _logprob.make_routing_disagreement_fn(model_cfg, mesh, run.rules) if a.routing_replay == "measure" else None
  )

  validation = _validation.Validation(run, tools)  # its rollout and judge are built on first use
  params, opt_state, rng = state.params, state.opt_state, state.rng

  summary = {}
  if start == 0 and config.eval.before_rl and config.data.val:
    summary.update({f"before_rl/{k}": v for k, v in validation(params, 0, "before_rl").items()})

  bar = _metrics.progress(total, "rl", initial=start, enabled=run.progress)
  timer = _metrics.Timer()
  perf = _metrics.Throughput(total, start, meta.get("tokens_total", 0.0), t.peak_tflops)
  step, ev = start, {}
  while step < total:
    ckpt.check()  # a failed async save stops the run here, naming its step
    # -- rollout ------------------------------------------------------------------------------------------
    at_start = (rng, loader.get_state())  # what a checkpoint of this step's start holds (preemption mid-rollout)
    key = jax.random.wrap_key_data(rng)
    key, rollout_key = jax.random.split(key)
    rng = np.asarray(jax.random.key_data(key))
    # -- rollouts and rewards (DAPO dynamic sampling may generate several batches) --------------------------
    with timer("rollout"):
      weights = rollout.weights(params)  # the policy on this host's rollout devices (once per step)
    try:  # SIGTERM is noticed between decode chunks and tool polls, not only at the end of the step
      traj, prompts, rewards_b, gen_metrics = generate(
        config,
        loader,
        rollout,
        reward_fn,
        weights,
        rollout_key,
        pad_id,
        timer,
        should_stop=run.preempt.is_requested,
        version=step,
      )
      interrupted = False
    except RolloutInterrupted as e:
      log.warning("RL step %d: %s", step + 1, e)
      interrupted = True
    del weights  # the rollout copy is not kept through the update
    if parallel.any_host(interrupted):  # every host here once per step: a host that finished its rollout stops too
      run.preempt.requested = True
      _save_step_start(run, ckpt, TrainState(params, opt_state, at_start[0], step), at_start[1], nan_count, perf)
      break
    with timer("reward"):
      # Each host's own rollout time and trajectories (a straggler's wait lands here, in the first gather).
      gen_metrics.update(host_rollout_metrics(timer.times.get("perf/rollout_s", 0.0), len(traj.group_id_b), step + 1))
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
      layout = _objective.verl_layout(config, traj, seq_len)  # None unless algo.verl_dynamic_bsz
      if layout is not None:
        gen_metrics["train/verl_micro_batches"] = float(np.mean(layout.micro_batches))
      batch_np = _batch.trajectories_batch(
        traj,
        adv_bt,
        micro_batch_size=t.micro_batch_size,
        pad_id=pad_id,
        seq_len=seq_len,
        rows_multiple=rows_multiple,
        layout=layout,
      )
      if a.routing_replay != "none":
        gen_metrics.update(routing_replay_metrics(traj))
      batch = _batch.shard_batch(_batch.process_rows(batch_np, mesh), mesh)
      if disagreement_fn is not None:  # measured, not replayed: the update routes every token itself
        rollout_routes = batch.pop("routes")
        gen_metrics.update(_logprob.routing_disagreement(disagreement_fn, params, batch, rollout_routes))
      # Routing replay: pi_old through the rollout's experts too; the reference keeps its own routing (None).
      routes, own = ((batch["routes"],), (None,)) if replay else ((), ())
      batch["old_log_prob"], _ = logprob_fn(params, batch["tokens"], batch["attention_mask"], *routes)
      if ref_params is not None:
        batch["ref_log_prob"], _ = logprob_fn(ref_params, batch["tokens"], batch["attention_mask"], *own)
      batch["sampler_log_prob"] = _logprob.behaviour_log_prob(
        batch["old_log_prob"], batch["sampler_log_prob"], batch["loss_mask"]
      )  # the call-limit EOS was never sampled: its behaviour log-prob is the old one
      mismatch = _logprob.logprob_mismatch_metrics(batch["old_log_prob"], batch["sampler_log_prob"], batch["loss_mask"])
    if a.kl.use_in_reward:  # verl apply_kl_penalty: token rewards -coef * KL(old, ref), then the advantages again
      with timer("reward"):
        adv_bt, kl_metrics = _kl_in_reward(config, batch, traj, rewards_b, adv_fn, mesh)
        order = slice(None) if layout is None else layout.order
        adv_np = _batch.micro_batches(  # the same row layout as the batch; only the advantages are new
          {"tokens": np.asarray(traj.tokens_bt)[order], "advantages": np.asarray(adv_bt)[order]},
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
      nan_count = check_finite(m, nan_count, t.nan_limit, step)
    # -- metrics --------------------------------------------------------------------------------------------
    scalars = {k: float(np.mean([m[k] for m in step_metrics])) for k in step_metrics[0]}
    scalars.update(jax.device_get(mismatch))
    scalars.update(_objective.rollout_metrics(traj, rewards_b, adv_bt))
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
        writer.histograms(step, _objective.rollout_histograms(traj, adv_bt))
      writer.flush()
    bar.update(1)
    bar.set_postfix(reward=f"{scalars.get('reward/mean', float('nan')):.3f}")
    # -- evaluation and checkpoint ----------------------------------------------------------------------------
    ev = {}
    if t.eval_every and step % t.eval_every == 0 and config.data.val:
      ev = validation(params, step)
    stop = run.preempt.agreed(step)  # every host sees the same answer at the same step
    if step % config.checkpoint.every_steps == 0 or step == total or stop or ev:
      extra = {"phase": "rl", "nan_count": nan_count, "tokens_total": perf.tokens_total, "metrics": {**scalars, **ev}}
      save(
        run, ckpt, TrainState(params, opt_state, rng, step), loader.get_state(), extra, metrics=ev or None, force=stop
      )
    if stop:
      break
  bar.close()
  if not run.preempt.requested and config.eval.after_rl and config.data.val:
    # The periodic evaluation of the last step (eval_every dividing the steps) evaluated these same parameters.
    same = ("rl", ev) if ev and step == total else None
    summary.update(_after_rl(validation, config, params, step, same_as=same))
  validation.close()
  ckpt.close()
  summary["rl/steps"] = step
  return params, summary


def _after_rl_marker(config, step: int):
  from etils import epath

  return epath.Path(f"{str(config.workdir).rstrip('/')}/eval/after_rl_{step}.done")


def _after_rl(validation, config, params, step: int, same_as=None) -> dict:
  """The after-RL evaluation, then its marker (workdir/eval/after_rl_<step>.done, process 0): a run stopped inside
  the evaluation finishes it when resumed. same_as: `Validation`'s, an evaluation of these parameters to reuse."""
  summary = {f"after_rl/{k}": v for k, v in validation(params, step, "after_rl", same_as=same_as).items()}
  if jax.process_index() == 0:
    marker = _after_rl_marker(config, step)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("finished\n")
  return summary


def _after_rl_pending(config, step: int) -> bool:
  """Whether a run that finished its steps still owes its after-RL evaluation (eval.after_rl with validation data,
  and no marker), as process 0 sees it: every host takes the same branch."""
  if not (config.eval.after_rl and config.data.val):
    return False
  pending = not _after_rl_marker(config, step).exists() if jax.process_index() == 0 else False
  return bool(parallel.allgather_json(pending)[0])


def _stop_kw(should_stop) -> dict:
  """The rollout's keyword for `should_stop`, none without one (a caller's rollout function need not take it)."""
  return {} if should_stop is None else {"should_stop": should_stop}


def _save_step_start(run: Run, ckpt, state: TrainState, data_state, nan_count: int, perf) -> None:
  """The state at the start of the interrupted step (its rng and data position: a resume redoes the step exactly),
  unless that step is already saved or is the start of RL (nothing to keep)."""
  if state.step == 0 or ckpt.latest_step() == state.step:
    log.warning("preempted during the rollout of RL step %d; step %d is already saved.", state.step + 1, state.step)
    return
  log.warning("preempted during the rollout of RL step %d: saving step %d.", state.step + 1, state.step)
  extra = {"phase": "rl", "nan_count": nan_count, "tokens_total": perf.tokens_total}
  save(run, ckpt, state, data_state, extra, force=True)


def routing_replay_metrics(traj) -> dict:
  """train/routing_replay_token_fraction: the share of the step's tokens (prompt and response) whose rollout experts
  were recorded, which the update replays ('rollout') or compares with its own ('measure'; the rest, each row's last
  token and tool results appended after its slot was released, route themselves). Raises when the rollout recorded
  no routes."""
  if traj.routes_btsk is None:
    raise RuntimeError(
      "algo.routing_replay is on but the rollout returned no routes (Trajectories.routes_btsk is None): its "
      "engine does not record them (Engine(record_routes=True), rollout_settings(record_routes=))."
    )
  attended = np.asarray(traj.attention_mask_bt) > 0
  replayed = attended & (np.asarray(traj.routes_btsk)[..., 0, 0] >= 0)
  return {"train/routing_replay_token_fraction": float(replayed.sum() / max(attended.sum(), 1))}


def host_rollout_metrics(rollout_s: float, trajectories: int, step: int) -> dict:
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


def generate(config, loader, rollout, reward_fn, weights, key, pad_id, timer, should_stop=None, version=0):
  """(trajectories, prompts by group id, rewards [N], metrics) for one RL step.

  With train.max_staleness > 0 (partial rollouts): the step's prompts join the groups carried over from earlier
  steps (`version` = the step, the policy version of `weights`) and as many complete groups come back, the oldest
  first; the rest carry over.

  Without algo.filter_groups: one batch of prompts, rolled out. With it (DAPO dynamic sampling, spec §3.2):
  groups whose filter metric is equal across the group are dropped and further batches are generated until
  this host has its share of data.prompts_per_step groups (hosts agree on the number of batches, so their data
  iterators stay in step for the checkpoint); after algo.max_num_gen_batches batches the step goes on with dropped groups
  filling the rest (verl raises instead) and says so in `rollout/filter_underfilled`.
  """
  a = config.algo
  if config.train.max_staleness:
    with timer("rollout"):
      traj, prompts, _ = rollout.carry_over(weights, loader, key, version=version, should_stop=should_stop)
    with timer("reward"):
      rewards_b = np.asarray(reward_fn(traj, prompts), np.float32)
    return traj, prompts, rewards_b, {}
  if not a.filter_groups:
    prompts = next(loader)
    with timer("rollout"):
      traj = rollout(weights, prompts, key, **_stop_kw(should_stop))
    with timer("reward"):
      rewards_b = np.asarray(reward_fn(traj, prompts), np.float32)
    return traj, prompts, rewards_b, {}
  from aepo_jax import objectives
  from aepo_jax.rollout import concat_groups

  want = _inputs.host_share(config.data.prompts_per_step)
  kept, dropped = [], []  # (traj, group id, prompt, rewards of the group's rows)
  gen = 0
  while True:
    prompts = next(loader)
    with timer("rollout"):  # hosts agree on more batches below: only one host may leave the loop early
      stop = should_stop if jax.process_count() == 1 else None
      traj = rollout(weights, prompts, jax.random.fold_in(key, gen), **_stop_kw(stop))
    gen += 1
    with timer("reward"):
      rewards_b = np.asarray(reward_fn(traj, prompts), np.float32)
      metric_b = rewards_b if a.filter_metric == "reward" else _objective.correct_b(traj, prompts)
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


def make_optimizer(config, total_steps: int):
  """The RL phase's optimizer: optim.* with its schedule over `total_steps` RL steps' updates (also what
  `launch/compile.py` compiles)."""
  o = config.optim
  return _optim.make_optimizer(
    o.lr,
    weight_decay=o.weight_decay,
    b1=o.b1,
    b2=o.b2,
    eps=o.eps,
    grad_clip=o.grad_clip,
    schedule=o.schedule,
    warmup_steps=o.warmup_steps,
    total_steps=total_steps * updates_per_step(config),
    min_lr_ratio=o.end_lr_fraction,
  )


def updates_per_step(config) -> int:
  return config.train.ppo_epochs * (config.data.prompts_per_step // config.train.ppo_mini_batch_size)
