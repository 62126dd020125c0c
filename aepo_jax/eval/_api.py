"""One evaluation from a checkpoint path to a summary, with every input checked before compute.

  plan = check_inputs(checkpoint, benchmarks, search_backend=..., judge_url=..., judge_model=...)
  summary = run_evaluation(plan, output_dir, settings=EvalSettings(n=5), ks=(1, 5), limit=None)
  evaluate(config, model_cfg, params, tokenizer, examples, mesh=None, tools=None)   # the trainer's validation

check_inputs fails, in this order and before any weights are read: unknown benchmark names; a checkpoint
path that does not exist; benchmarks whose search backend or judge is not configured; a judge endpoint that
does not answer a health probe; a retrieval server that does not answer GET /health.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional, Sequence

from aepo_jax.eval import _benchmarks, _checkpoint_io, _report
from aepo_jax.eval._runner import EvalSettings, Evaluator
from aepo_jax.eval._scoring import Scorer, probe_judge


class EvalInputError(ValueError):
  """Bad evaluation input found before any compute; the message names the input and the fix."""


@dataclasses.dataclass
class EvalPlan:
  checkpoint: _checkpoint_io.CheckpointRef
  benchmarks: list
  search_backend: Optional[str] = None      # None: not given; 'none': explicitly no search
  search_options: dict = dataclasses.field(default_factory=dict)
  judge_url: Optional[str] = None
  judge_model: Optional[str] = None
  tokenizer: Optional[str] = None
  allow_unsandboxed: bool = False
  python_timeout_s: float = 120.0


def _probe_retrieval(url: str) -> None:
  from aepo_jax.tools import JsonClient
  try:
    JsonClient(timeout_s=5.0, retries=0).request("GET", url.rstrip("/") + "/health")
  except Exception as e:  # noqa: BLE001 -- any failure means the server is not usable
    raise EvalInputError(f"the retrieval server at {url} did not answer GET /health ({e}); start it with "
                         "`python launch/retrieval_server.py ...` or fix --search-url.") from e


def check_inputs(checkpoint: str, benchmarks, *, search_backend: Optional[str] = None,
                 search_options: Optional[dict] = None, judge_url: Optional[str] = None,
                 judge_model: Optional[str] = None, probe: bool = True, **kwargs) -> EvalPlan:
  """Every check that can fail before weights are read (see the module docstring)."""
  try:
    names = _benchmarks.select_benchmarks(benchmarks)
  except ValueError as e:
    raise EvalInputError(str(e)) from None
  try:
    ref = _checkpoint_io.resolve_checkpoint(checkpoint)
  except FileNotFoundError as e:
    raise EvalInputError(str(e)) from None
  if bool(judge_url) != bool(judge_model):
    raise EvalInputError("--judge-url and --judge-model go together (the OpenAI base URL and the model name).")
  problem = _benchmarks.requirements_error(names, search_backend=search_backend, judge=bool(judge_url))
  if problem:
    raise EvalInputError(problem)
  opts = {k: v for k, v in (search_options or {}).items() if v not in (None, "")}
  if search_backend == "retrieval" and not opts.get("url"):
    raise EvalInputError("--search-backend retrieval needs --search-url http://HOST:PORT (the retrieval server).")
  if search_backend == "local" and not opts.get("corpus"):
    raise EvalInputError("--search-backend local needs --search-corpus corpus.jsonl.")
  if probe and judge_url:
    try:
      probe_judge(judge_url, judge_model)
    except RuntimeError as e:
      raise EvalInputError(str(e)) from None
  if probe and search_backend == "retrieval":
    _probe_retrieval(opts["url"])
  return EvalPlan(ref, names, search_backend, opts, judge_url, judge_model, **kwargs)


def build_tools(plan: EvalPlan, settings: EvalSettings):
  """The evaluation ToolSet: python always; search through the plan's backend (spec §2.5 limits)."""
  from aepo_jax import tools as tools_lib
  tools = {"python": tools_lib.PythonTool(timeout_s=plan.python_timeout_s, allow_unsandboxed=plan.allow_unsandboxed)}
  if plan.search_backend not in (None, "none"):
    opts = dict(plan.search_options)
    if plan.search_backend == "replay":
      from aepo_jax.data import arpo_data_root
      opts.setdefault("path", str(arpo_data_root() / "search_cache.json"))
      opts.setdefault("on_miss", "empty")  # eval questions mostly miss the training cache; say so, don't crash
    try:
      backend = tools_lib.make_search_backend(plan.search_backend, **opts)
    except (TypeError, ValueError, FileNotFoundError, KeyError) as e:
      raise EvalInputError(f"--search-backend {plan.search_backend}: {e}") from None
    tools["search"] = tools_lib.SearchTool(backend, topk=10)
  return tools_lib.ToolSet(tools, mode="eval", eval_limits={"python": settings.python_limit,
                                                            "search": settings.search_limit},
                           timeout_s=plan.python_timeout_s + 30.0)


def make_judge(plan: EvalPlan):
  if not plan.judge_url:
    return None
  from aepo_jax.rewards import OpenAICompatibleJudge
  return OpenAICompatibleJudge(plan.judge_url, plan.judge_model)


def run_evaluation(plan: EvalPlan, output: str, *, settings: EvalSettings = EvalSettings(),
                   ks: Sequence[int] = (1, 5), limit: Optional[int] = None, show_progress: bool = True,
                   policy=None) -> dict:
  """Evaluates every benchmark of the plan into `output/<benchmark>.jsonl` and writes the summary."""
  ks = sorted({int(k) for k in ks})
  if ks and ks[-1] > settings.n:
    raise EvalInputError(f"--k {ks[-1]} needs at least that many samples per question; set --n >= {ks[-1]}.")
  os.makedirs(output, exist_ok=True)
  examples = {name: _benchmarks.load_examples(name, limit) for name in plan.benchmarks}  # data errors: early too
  _check_run_dir(output, plan, settings)
  tools = build_tools(plan, settings)
  try:
    if policy is None:
      policy = _checkpoint_io.load_policy(plan.checkpoint, tokenizer=plan.tokenizer)
    evaluator = Evaluator(policy, tools, Scorer(make_judge(plan)), settings, show_progress=show_progress)
    results, t0 = {}, time.monotonic()
    for name in plan.benchmarks:
      results[name] = evaluator.run(name, examples[name], os.path.join(output, f"{name}.jsonl"))
    meta = {"checkpoint": plan.checkpoint.path, "source": policy.source, "settings": dataclasses.asdict(settings),
            "limit": limit, "search_backend": plan.search_backend, "judge_model": plan.judge_model,
            "tool_metrics": tools.metrics(), "seconds": time.monotonic() - t0}
    families = {n: _benchmarks.family_of(n) for n in plan.benchmarks}
    return _report.write_summary(output, results, ks=ks, families=families, meta=meta)
  finally:
    tools.shutdown()


_RUN_FILE = "run.json"


def _check_run_dir(output: str, plan: EvalPlan, settings: EvalSettings) -> None:
  """A resumed run must use the settings of the run it continues (else its JSONL mixes two protocols)."""
  path = os.path.join(output, _RUN_FILE)
  mine = {"checkpoint": plan.checkpoint.path, "settings": {k: v for k, v in dataclasses.asdict(settings).items()
                                                           if k not in ("n", "batch_size", "chunk_steps")}}
  if os.path.exists(path):
    with open(path) as f:
      theirs = json.load(f)
    if theirs != mine:
      diff = [k for k in set(theirs["settings"]) | set(mine["settings"])
              if theirs["settings"].get(k) != mine["settings"].get(k)]
      if theirs["checkpoint"] != mine["checkpoint"]:
        diff.insert(0, "checkpoint")
      raise EvalInputError(f"--output {output!r} holds a run with different {diff}; resume with the same settings "
                           "or choose another --output.")
  else:
    with open(path, "w") as f:
      json.dump(mine, f, indent=2, sort_keys=True)


def evaluate(config, model_cfg, params, tokenizer, examples, mesh=None, tools=None) -> dict:
  """The trainer's validation (ARPO: greedy, n = 1): {'accuracy', 'num_examples'} on `examples`."""
  import tempfile
  from aepo_jax import tools as tools_lib
  r = config.rollout
  ev = config.get("eval", {})
  settings = EvalSettings(n=1, temperature=float(ev.get("temperature", 0.0)), top_p=1.0, top_k=0,
                          max_prompt_len=int(r.max_prompt_len),
                          max_response_len=int(ev.get("max_response_len", 0) or r.max_response_len),
                          batch_size=max(1, min(len(examples), int(r.max_slots or 8))),
                          chunk_steps=int(r.decode_chunk), template=config.data.get("template", "code_search"))
  own_tools = tools is None
  if own_tools:
    tools = tools_lib.ToolSet({"python": tools_lib.PythonTool(
        allow_unsandboxed=bool(config.tools.get("allow_unsandboxed", False)))}, mode="eval")
  policy = _checkpoint_io.Policy(model_cfg, params, tokenizer, "in-training")
  try:
    ev_ = Evaluator(policy, tools, Scorer(None), settings, mesh=mesh, show_progress=False)
    with tempfile.TemporaryDirectory() as d:
      records = ev_.run("val", list(examples), os.path.join(d, "val.jsonl"))
  finally:
    if own_tools:
      tools.shutdown()
  return {"accuracy": float(sum(x["score"] for x in records) / max(1, len(records))),
          "num_examples": float(len(records))}
