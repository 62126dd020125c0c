"""The cold-start SFT phase: sft.steps of supervised fine-tuning on the configured demonstrations (resumed from
its newest checkpoint), and the final SFT parameters a resumed RL run starts from."""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from aepo_jax import checkpoint as _checkpoint
from aepo_jax.train import _batch, _config, _inputs, _logprob, _metrics, _optim, _step
from aepo_jax.train._phase import NothingToDo, Run, check_finite, resume, save

log = logging.getLogger("aepo_jax.train")


def final_params(run: Run, params):
  """The parameters of the last SFT checkpoint (a resumed RL run's starting point), or `params` if none."""
  config = run.config
  ckpt = run.checkpointer("sft")
  step = ckpt.latest_step()
  if step is None:
    log.warning(
      "RL resumes with a KL reference but %s holds no SFT checkpoint; the reference is the "
      "model as loaded (model.name), not the SFT result.",
      ckpt.directory,
    )
    return params
  # 'stop': an earlier SFT step as the KL reference would silently change the experiment.
  state, _ = resume(run, ckpt, params, optimizer(config), config.sft.seed, on_corrupt="stop")
  ckpt.close()
  return state.params


def optimizer(config):
  """The SFT phase's optimizer (sft.lr and schedule; optim.* for the rest)."""
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


def make_step(config, model_cfg, opt, mesh):
  """(the SFT phase's jitted step, its micro-batches per step): also what `launch/compile.py` compiles."""
  s = config.sft
  micro = (s.packed_rows or s.batch_size) // s.micro_batch_size
  rows = (s.packed_rows or s.batch_size) // micro
  step = _step.make_sft_step(
    model_cfg,
    optimizer=opt,
    micro_batches=micro,
    mesh=mesh,
    rules=_config.mesh_rules(config),
    logit_capacity=_logprob.logit_capacity(config.train.logit_fraction, rows, s.max_len),
    saved_logits_mb=config.train.saved_logits_mb,
  )
  return step, micro


def phase(run: Run, params):
  """Cold-start SFT to sft.steps (resumed from its newest checkpoint): (params, summary)."""
  config, model_cfg, mesh = run.config, run.model_cfg, run.mesh
  s = config.sft
  ckpt = run.checkpointer("sft")
  opt = optimizer(config)
  state, _ = resume(run, ckpt, params, opt, s.seed)
  start, meta = state.step, state.meta
  if start >= s.steps:
    if config.mode == "sft":
      ckpt.close()
      raise NothingToDo(
        f"nothing to do: SFT in {config.workdir!r} already finished at step {start} (sft.steps={s.steps}); raise "
        "--config.sft.steps to train further, or use a new --config.workdir."
      )
    log.info("SFT already finished (step %d); using its parameters.", start)
    return state.params, {"sft/steps": start}

  examples = _inputs.sft_examples(config, run.tokenizer, model_cfg)
  loader = _inputs.index_loader(len(examples), s.batch_size, seed=s.seed)
  if meta.get("data_state") is not None:
    loader.set_state(_checkpoint.decode_iterator_state(meta["data_state"]))
  pad_id = _inputs.pad_id(model_cfg, run.tokenizer)
  sft_step, _ = make_step(config, model_cfg, opt, mesh)
  nan_count = int(meta.get("nan_count", 0))

  bar = _metrics.progress(s.steps, "sft", initial=start, enabled=run.progress)
  perf = _metrics.Throughput(s.steps, start, meta.get("tokens_total", 0.0), config.train.peak_tflops)
  m = {}
  while state.step < s.steps:
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
        f"SFT step {state.step + 1}: {e}. Raise sft.packed_rows (at most sft.batch_size="
        f"{s.batch_size}) or sft.max_len={s.max_len}, or set sft.packed_rows=0."
      ) from e
    sharded = _batch.shard_batch(_batch.process_rows(batch, mesh), mesh)
    state.params, state.opt_state, m = sft_step(state.params, state.opt_state, sharded)
    state.step += 1
    step = state.step
    m = jax.device_get(m)
    nan_count = check_finite(m, nan_count, config.train.nan_limit, step)
    dt = time.perf_counter() - t0
    tokens = float(np.sum(batch["attention_mask"]))  # every token the step ran, not only the trained ones
    m.update(perf.step(step, dt, tokens, _metrics.model_flops(model_cfg, tokens, s.max_len, forward_passes=3)))
    m.update({"perf/tokens_per_s": float(m["train/tokens"]) / dt, "sft/step": step})
    if step % config.train.log_every == 0 or step == s.steps:
      run.writer.scalars(step, {k.replace("train/", "sft/"): v for k, v in m.items()})
      run.writer.flush()
    bar.update(1)
    bar.set_postfix(nll=f"{float(m.get('sft/nll', float('nan'))):.3f}")
    stop = run.preempt.agreed(step)  # every host sees the same answer at the same step
    if step % config.checkpoint.every_steps == 0 or step == s.steps or stop:
      extra = {"phase": "sft", "nan_count": nan_count, "tokens_total": perf.tokens_total}
      save(run, ckpt, state, loader.get_state(), extra, force=stop)
    if stop:
      break
  bar.close()
  ckpt.close()
  return state.params, {"sft/steps": state.step, "sft/final_nll": float(m.get("sft/nll", float("nan")))}
