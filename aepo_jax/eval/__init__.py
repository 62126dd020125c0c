"""eval: Pass@1 / Pass@k of a checkpoint on the papers' 14 benchmarks with the official protocol (spec §2.5, §4).

Command line: `python launch/evaluate.py --checkpoint PATH --benchmarks gsm8k,math500 --k 5` (docs/evaluation.md).

Whole runs
  check_inputs(checkpoint, benchmarks, *, search_backend, search_options, judge_url, judge_model) -> EvalPlan
  run_evaluation(plan, output, *, settings=EvalSettings(), ks=(1, 5), limit=None) -> summary dict
  evaluate(evaluator, {name: examples}, reward_timeout_s=) -> {'eval/<name>/accuracy', ...}  (the trainer's)
  EvalInputError                                   bad input, raised before any compute
  RemoteRollouts(url, model, tokenizer, tools, rollout_settings, api_key=)   the agent loop against a served policy
                                                   (OpenAI-compatible; Evaluator(..., rollouts=)); PolicyServerError,
                                                   probe_policy_server(url, model)
Pieces
  select_benchmarks(spec), requirements_error(names, search_backend=, judge=), load_examples(name, limit)
  resolve_checkpoint(path) -> CheckpointRef; load_policy(ref, tokenizer=None) -> Policy(config, params, tokenizer)
  load_tokenizer, training_config, CheckpointNotFoundError, CheckpointDamagedError   (from aepo_jax.checkpoint)
  EvalSettings, Evaluator(policy, tools, scorer, settings, rollouts=None).run(name, examples, path=None) -> records
                                                   (resumable from the JSONL; `loop`: the caller's agent loop)
  Scorer(judge=None).score(example, response) -> dict; probe_judge(url, model)
  summarize_records(records, ks), write_summary(...), compare(run_dirs, out_prefix) -> (markdown, png)
  rescore(run_dir, output, protocol=...) -> summary (the same answers, the other scorer); protocol_differences(a, b)
  pass_at_k(n, c, k), mean_pass_at_k, best_of_k, bootstrap_ci, summarize
"""

from aepo_jax.eval._api import (
  EvalInputError,
  EvalPlan,
  build_tools,
  check_inputs,
  evaluate,
  make_judge,
  run_evaluation,
)
from aepo_jax.eval._benchmarks import (
  SCORER_OF_FAMILY,
  family_of,
  load_examples,
  needs_judge,
  needs_search,
  requirements_error,
  select_benchmarks,
)
from aepo_jax.checkpoint import (
  CheckpointDamagedError,
  CheckpointNotFoundError,
  CheckpointRef,
  Policy,
  load_policy,
  load_tokenizer,
  resolve_checkpoint,
  training_config,
)
from aepo_jax.eval._passk import best_of_k, bootstrap_ci, mean_pass_at_k, pass_at_k, summarize
from aepo_jax.eval._report import compare, load_summary, summarize_records, summary_markdown, write_summary
from aepo_jax.eval._rescore import disagreements, protocol_differences, rescore
from aepo_jax.eval._runner import EvalSettings, Evaluator, read_records, tool_calls_from_text
from aepo_jax.eval._remote import PolicyServerError, RemoteRollouts, probe_policy_server
from aepo_jax.eval._scoring import JudgeUnavailableError, Scorer, probe_judge

__all__ = [
  "training_config",
  "EvalInputError",
  "EvalPlan",
  "build_tools",
  "check_inputs",
  "evaluate",
  "run_evaluation",
  "SCORER_OF_FAMILY",
  "family_of",
  "load_examples",
  "needs_judge",
  "needs_search",
  "requirements_error",
  "select_benchmarks",
  "CheckpointDamagedError",
  "CheckpointNotFoundError",
  "CheckpointRef",
  "Policy",
  "load_policy",
  "load_tokenizer",
  "resolve_checkpoint",
  "best_of_k",
  "bootstrap_ci",
  "mean_pass_at_k",
  "pass_at_k",
  "summarize",
  "compare",
  "disagreements",
  "protocol_differences",
  "rescore",
  "make_judge",
  "load_summary",
  "summarize_records",
  "summary_markdown",
  "write_summary",
  "EvalSettings",
  "Evaluator",
  "read_records",
  "tool_calls_from_text",
  "PolicyServerError",
  "RemoteRollouts",
  "probe_policy_server",
  "JudgeUnavailableError",
  "Scorer",
  "probe_judge",
]
