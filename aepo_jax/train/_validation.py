"""Validation during training: n = 1 accuracy on each validation source through `aepo_jax.eval`, on this host's
validation rollout, with an optional LLM judge served in this process (`eval.judge_checkpoint`)."""

from __future__ import annotations

import logging
import os
from typing import Optional

import jax

from aepo_jax.train._inputs import _examples, host_share
from aepo_jax.train._wiring import Rollout

log = logging.getLogger("aepo_jax.train")


def serve_judge(config):
  """(config with eval.judge_url / judge_model pointing at it, server): `eval.judge_checkpoint` served by
  `aepo_jax.serve.Server` on 127.0.0.1 (a free port) in this process, for the validation's LLM judge. The caller
  shuts the server down. (None, config) unchanged when no judge checkpoint is set."""
  ckpt = config.eval.judge_checkpoint
  if not ckpt:
    return config, None
  from aepo_jax import eval as eval_lib
  from aepo_jax.serve import Server

  policy = eval_lib.load_policy(ckpt, dtype=config.model.dtype)
  server = Server(
    policy.config,
    policy.params,
    policy.tokenizer,
    model_name=ckpt,
    max_slots=8,
    max_len=min(8192, policy.config.max_position_embeddings or 8192),  # never beyond the judge's context
    port=0,
  ).start()
  server.warmup()
  log.info("judge %s served at %s", ckpt, server.url)
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.eval.judge_url, config.eval.judge_model, config.eval.judge_checkpoint = server.url + "/v1", ckpt, ""
  return config, server


def make_eval_rollout(config, model_cfg, tokenizer, tools, temperature=None) -> Rollout:
  """The validation rollout (policy 'none', n = 1 per prompt; eval.temperature unless given: greedy by default)."""
  e = config.eval
  return Rollout(
    config,
    model_cfg,
    tokenizer,
    tools,
    policy_name="none",
    temperature=e.temperature if temperature is None else temperature,
    n=1,
    prompts_per_call=max(host_share(e.batch_size or config.data.prompts_per_step), 1),
    max_response_len=e.max_response_len or None,
    record_routes=False,  # validation trains on nothing: no routes to replay
  )


def evaluate(config, rollout: Rollout, params, records_path: str = "", samples: int = 1) -> dict:
  """n = 1 accuracy on each validation source (ARPO validation, spec §1.7; greedy unless eval.temperature), by
  `eval.evaluate` on this host's validation rollout: eval/<source>/accuracy (answer correct by `eval.Scorer`: math
  equivalence / EM; with eval.judge_url, the evaluation protocol's LLM judge OR'ed with math equivalence on QA and
  deep-search sets), eval/<source>/reward and eval/<source>/tool_calls (mean calls per answer), eval/accuracy.
  samples = k > 1: k answers per question from `rollout` (sampled), eval/<source>/pass@1 and pass@k instead.

  Every host evaluates its own share of the examples on its own devices; the sums are combined across hosts once
  per source at the end (the only collectives: that and copying the weights)."""
  from aepo_jax import eval as eval_lib
  from aepo_jax import rewards as rewards_lib

  e = config.eval
  policy = eval_lib.Policy(rollout.engine.config, rollout.weights(params), rollout.tokenizer, "in-training")
  protocol = e.get("protocol", "project")
  judge_cls = rewards_lib.OfficialJudge if protocol == "official" else rewards_lib.OpenAICompatibleJudge
  judge = judge_cls(e.judge_url, e.judge_model) if e.judge_url else None
  # The loop brings the engine, tools and result format of training; the settings only batch, template and seed.
  settings = eval_lib.EvalSettings(
    n=samples,
    batch_size=rollout.prompts_per_call,
    max_prompt_len=config.rollout.max_prompt_len,
    template=config.data.template,
    seed=jax.process_index(),
  )
  evaluator = eval_lib.Evaluator(
    policy,
    None,
    eval_lib.Scorer(judge, timeout_s=config.reward.timeout_s, protocol=protocol),
    settings,
    show_progress=False,
    rollouts=rollout.rollouts,
  )
  limit = e.num_prompts or config.data.val_size
  sources = {}
  for source in config.data.val:
    examples = _examples(config, source, "val")
    sources[_short(source)] = examples[:limit] if limit else examples
  return eval_lib.evaluate(evaluator, sources, reward_timeout_s=config.reward.timeout_s, records_path=records_path)


def _short(source: str) -> str:
  return os.path.splitext(os.path.basename(str(source)))[0] or "val"


def _copy_records(src: str, dst: str) -> None:
  """Every process's answers file of one evaluation (`evaluate`'s records_path, '.p<N>' per process with several)
  copied under another phase's name."""
  from etils import epath

  n, p = jax.process_count(), jax.process_index()
  src, dst = (src, dst) if n == 1 else (f"{src}.p{p}", f"{dst}.p{p}")
  if epath.Path(src).exists():
    epath.Path(dst).write_bytes(epath.Path(src).read_bytes())


class Validation:
  """The run's validation: `validation(params, step, phase)` evaluates every validation source, writes the metrics
  at `step` and every answer to workdir/eval/<phase>_<step>.jsonl, and returns the metrics; with eval.pass_k = k
  the evaluations before and after RL (phase 'before_rl' / 'after_rl') also sample k answers per question
  (eval/pass@1, eval/pass@k; answers in <phase>_<step>_pass<k>.jsonl). Its rollout and the
  judge served for it (eval.judge_checkpoint) are built at the first call; `close()` shuts that judge down."""

  def __init__(self, run, tools):
    self.run, self.tools = run, tools
    self._rollout = None
    self._config = run.config  # with eval.judge_url pointing at a served judge, once there is one
    self._judge = None
    self._sampled = None  # the pass@k rollout (eval.pass_k), built at its first use

  def __call__(self, params, step: int, phase: str = "rl", *, same_as: Optional[tuple] = None) -> dict:
    """same_as: (phase, metrics) of an evaluation of these same parameters at this step (the periodic one at the
    last step, before the after-RL one): its greedy answers and metrics are taken over (its records copied to this
    phase's file, the metrics not logged again) instead of evaluated twice; pass@k is still sampled."""
    run, tools = self.run, self.tools
    config = run.config
    if self._rollout is None:
      self._rollout = make_eval_rollout(config, run.model_cfg, run.tokenizer, tools)
      self._config, self._judge = serve_judge(config)
    records = f"{str(config.workdir).rstrip('/')}/eval/{phase}_{step}.jsonl"  # every answer, to read back
    logged = {}
    if same_as is not None:
      log.info("%s at step %d: the greedy answers of the %s evaluation of the same parameters", phase, step, same_as[0])
      ev = {k: v for k, v in same_as[1].items() if not k.startswith("eval/tools/")}
      _copy_records(f"{str(config.workdir).rstrip('/')}/eval/{same_as[0]}_{step}.jsonl", records)
    else:
      log.info("evaluating (%s, step %d) on %s", phase, step, ", ".join(map(str, config.data.val)))
      ev = logged = evaluate(self._config, self._rollout, params, records)
    k = config.eval.get("pass_k", 0)
    if k and phase != "rl":  # pass@k before and after RL only: k sampled answers per question cost k evaluations
      if self._sampled is None:
        t = config.eval.get("pass_k_temperature", 0.0) or config.rollout.temperature
        self._sampled = make_eval_rollout(config, run.model_cfg, run.tokenizer, tools, temperature=t)
      sampled = evaluate(self._config, self._sampled, params, records[: -len(".jsonl")] + f"_pass{k}.jsonl", k)
      ev, logged = {**ev, **sampled}, {**logged, **sampled}
    if tools:  # the evaluation's own tool calls, kept out of the next RL step's tools/* counters
      own = {f"eval/tools/{k.split('/', 1)[-1]}": v for k, v in tools.metrics().items()}
      ev, logged = {**ev, **own}, {**logged, **own}
      tools.reset_metrics()
    if logged:
      run.writer.scalars(step, logged)
      run.writer.flush()
    return ev

  def close(self) -> None:
    if self._judge is not None:
      self._judge.shutdown(drain_s=5.0)
      self._judge = None
