"""One evaluation from a checkpoint path (or a served policy) to a summary, with every input checked before compute.

  plan = check_inputs(checkpoint, benchmarks, search_backend=..., judge_url=..., judge_model=...)
  plan = check_inputs(None, benchmarks, policy_url="http://HOST:PORT/v1", policy_model=NAME, tokenizer=TOK)
  summary = run_evaluation(plan, output_dir, settings=EvalSettings(n=5), ks=(1, 5), limit=None)
  evaluate(evaluator, {name: examples}, reward_timeout_s=10.0)   # the trainer's validation metrics

check_inputs fails, in this order and before any weights are read: unknown benchmark names; a checkpoint
path that does not exist (or both or neither of a checkpoint and a policy URL, a policy URL without its model name
or tokenizer); benchmarks whose search backend or judge is not configured; a browse setting without its summariser
or page store; a judge or summariser endpoint that does not answer a health probe; a retrieval server that does not
answer GET /health; a policy server that does not list its model at GET /models.

A served policy (`policy_url`: any OpenAI-compatible server) runs through `RemoteRollouts` (_remote.py): the same
tools, protocol, scoring and records, the generation calls made over HTTP.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Mapping, Optional, Sequence

from aepo_jax import checkpoint as checkpoint_lib
from aepo_jax.eval import _benchmarks, _report
from aepo_jax.eval._runner import EvalSettings, Evaluator
from aepo_jax.eval._scoring import Scorer, probe_judge


class EvalInputError(ValueError):
  """Bad evaluation input found before any compute; the message names the input and the fix."""


@dataclasses.dataclass
class EvalPlan:
  checkpoint: Optional[checkpoint_lib.CheckpointRef]  # None: a served policy (policy_url)
  benchmarks: list
  search_backend: Optional[str] = None  # None: not given; 'none': explicitly no search
  search_options: dict = dataclasses.field(default_factory=dict)
  judge_url: Optional[str] = None
  judge_model: Optional[str] = None
  tokenizer: Optional[str] = None
  allow_unsandboxed: bool = False
  python_timeout_s: float = 120.0
  data_options: dict = dataclasses.field(default_factory=dict)  # load_records keywords for data files
  judge_qa: bool = True  # with a judge, QA sets are judged too (the protocol)
  # The SDS browse form of search (spec §2.5): {pages, summarizer_url, summarizer_model, live, variant}; None =
  # snippets. variant: 'project' (BrowseTool) | 'sds' | 'sds_cn' (the official browser as released, tools._sds).
  browse: Optional[dict] = None
  # Registered tools beyond the evaluation's own (build_tools), and the plug-in modules that register them.
  tools: tuple = ()
  tool_plugins: tuple = ()
  # A served policy instead of a checkpoint: its OpenAI base URL and model name (the tokenizer is `tokenizer`), the
  # API key it wants (never written to run.json or the summary) and the deadline of one generation request.
  policy_url: Optional[str] = None
  policy_model: Optional[str] = None
  policy_api_key: Optional[str] = dataclasses.field(default=None, repr=False)
  policy_timeout_s: float = 600.0

  @property
  def policy_name(self) -> str:
    """What is evaluated: the checkpoint's path, or `MODEL at URL` for a served policy."""
    if self.policy_url:
      return f"{self.policy_model} at {self.policy_url}"
    return self.checkpoint.path if self.checkpoint is not None else "?"


def _probe_retrieval(url: str) -> None:
  from aepo_jax.tools import JsonClient

  try:
    JsonClient(timeout_s=5.0, retries=0).request("GET", url.rstrip("/") + "/health")
  except Exception as e:  # noqa: BLE001 -- any failure means the server is not usable
    raise EvalInputError(
      f"the retrieval server at {url} did not answer GET /health ({e}); start it with "
      "`python launch/retrieval_server.py ...` or fix --search_url."
    ) from e


def _probe_summarizer(url: str, model: str) -> None:
  from aepo_jax.tools import ChatClient

  try:
    ChatClient(url, model, timeout_s=10.0, retries=0, max_tokens=4).complete("Say OK.")
  except (RuntimeError, OSError, ValueError) as e:
    raise EvalInputError(
      f"the summariser at {url} (model {model!r}) did not answer a health probe ({e}); start the "
      "server, or fix --summarizer_url / --summarizer_model."
    ) from None


def check_inputs(
  checkpoint: Optional[str],
  benchmarks,
  *,
  search_backend: Optional[str] = None,
  search_options: Optional[dict] = None,
  judge_url: Optional[str] = None,
  judge_model: Optional[str] = None,
  probe: bool = True,
  **kwargs,
) -> EvalPlan:
  """Every check that can fail before weights are read (see the module docstring). A served policy: checkpoint
  None and `policy_url`, `policy_model`, `tokenizer` (and `policy_api_key`, `policy_timeout_s`) in kwargs."""
  try:
    names = _benchmarks.select_benchmarks(benchmarks)
  except ValueError as e:
    raise EvalInputError(str(e)) from None
  policy_url = kwargs.get("policy_url")
  if policy_url:
    if checkpoint:
      raise EvalInputError("give --checkpoint (evaluate its weights here) or --policy_url (a served policy), not both.")
    if not kwargs.get("policy_model"):
      raise EvalInputError("--policy_url needs --policy_model=NAME, the model name the server serves.")
    if not kwargs.get("tokenizer"):
      from aepo_jax.model import PRETRAINED

      model = kwargs["policy_model"]
      if model not in PRETRAINED and not os.path.isdir(model):
        raise EvalInputError(
          "--policy_url needs --tokenizer=DIR_OR_NAME, the served model's tokenizer (prompts go as its token ids), "
          "unless --policy_model is itself a bundled name or a model directory."
        )
      kwargs["tokenizer"] = model  # vLLM-style serving under the model's own directory or name
    ref = None
  else:
    if not checkpoint:
      raise EvalInputError("give --checkpoint=PATH, or --policy_url=URL with --policy_model=NAME.")
    try:
      ref = checkpoint_lib.resolve_checkpoint(checkpoint)
    except FileNotFoundError as e:
      raise EvalInputError(str(e)) from None
  from aepo_jax.data import data_file_exists, is_data_file

  for name in names:
    if is_data_file(name) and not data_file_exists(name):
      raise EvalInputError(f"data file {name!r} (in --benchmarks) does not exist; check the path (local or gs://).")
  if bool(judge_url) != bool(judge_model):
    raise EvalInputError("--judge_url and --judge_model go together (the OpenAI base URL and the model name).")
  problem = _benchmarks.requirements_error(names, search_backend=search_backend, judge=bool(judge_url))
  if problem:
    raise EvalInputError(problem)
  opts = {k: v for k, v in (search_options or {}).items() if v not in (None, "")}
  if search_backend == "retrieval" and not opts.get("url"):
    raise EvalInputError("--search_backend=retrieval needs --search_url=http://HOST:PORT (the retrieval server).")
  if search_backend == "local" and not opts.get("corpus"):
    raise EvalInputError("--search_backend=local needs --search_corpus=corpus.jsonl.")
  browse = kwargs.get("browse")
  if browse is not None:
    if search_backend in (None, "none"):
      raise EvalInputError(
        "--search_mode=browse needs a search backend (--search_backend=...): the browser reads the pages of its hits."
      )
    if not browse.get("summarizer_url") or not browse.get("summarizer_model"):
      raise EvalInputError(
        "--search_mode=browse needs --summarizer_url (an OpenAI-compatible base URL, e.g. "
        "http://127.0.0.1:8001/v1) and --summarizer_model."
      )
    from aepo_jax.tools import BROWSE_VARIANTS

    if browse.get("variant") not in (None, *BROWSE_VARIANTS):
      raise EvalInputError(f"--browse_variant={browse['variant']!r}: choose one of {', '.join(BROWSE_VARIANTS)}.")
    pages = browse.get("pages")
    if pages and not os.path.exists(pages):
      raise EvalInputError(f"--browse_pages={pages!r} does not exist; give a directory of pages or a corpus JSONL.")
    if not pages and not browse.get("live"):
      raise EvalInputError(
        "--search_mode=browse needs a page store: --browse_pages=DIR_OR_JSONL (or "
        "--search_corpus), or --browse_live to fetch pages."
      )
  if probe and judge_url:
    try:
      probe_judge(judge_url, judge_model)
    except RuntimeError as e:
      raise EvalInputError(str(e)) from None
  if probe and browse is not None:
    _probe_summarizer(browse["summarizer_url"], browse["summarizer_model"])
  if probe and search_backend == "retrieval":
    _probe_retrieval(opts["url"])
  if probe and policy_url:
    from aepo_jax.eval._remote import PolicyServerError, probe_policy_server

    try:
      probe_policy_server(policy_url, kwargs["policy_model"], api_key=kwargs.get("policy_api_key"))
    except PolicyServerError as e:
      raise EvalInputError(str(e)) from None
  return EvalPlan(ref, names, search_backend, opts, judge_url, judge_model, **kwargs)


def build_tools(plan: EvalPlan, settings: EvalSettings):
  """The evaluation ToolSet (`tools.build_toolset`): the evaluation's tools (`tools.EVALUATION_TOOLS`: python always;
  search only with a backend, through the plan's backend as snippets or, with `plan.browse`, the SDS browser), then
  the plan's further tools (`plan.tools`, after importing `plan.tool_plugins`). Limits per tool: EvalSettings'
  `<name>_limit` (python_limit, search_limit: spec §2.5) where it has one, else the tool's registered eval_limit."""
  from aepo_jax import tools as tools_lib

  has_backend = plan.search_backend not in (None, "none")
  try:
    tools_lib.import_plugins(tuple(plan.tool_plugins))
    specs = [tools_lib.tool_spec(name) for name in (*tools_lib.EVALUATION_TOOLS, *plan.tools)]
  except (ImportError, KeyError) as e:
    raise EvalInputError(e.args[0] if isinstance(e, KeyError) else str(e)) from None
  names, tags = [], set()
  for spec in specs:
    if spec.call_tag in tags or (not has_backend and "search_backend" in spec.settings):
      continue  # a tag answered once; a tool of the search backend only with one
    names.append(spec.name)
    tags.add(spec.call_tag)
  opts = {
    "python_timeout": plan.python_timeout_s,
    "allow_unsandboxed": plan.allow_unsandboxed,
    "search_backend": plan.search_backend,
    "search_options": dict(plan.search_options),
    "search_on_miss": "empty",  # eval questions mostly miss the training cache; say so, don't crash
    "search_topk": 10,
    "search_mode": "snippets" if plan.browse is None else "browse",
    "browse": dict(plan.browse or {}),
    "retry_count": 3,
  }
  limits = {
    tools_lib.tool_spec(n).call_tag: getattr(settings, f"{n}_limit") for n in names if hasattr(settings, f"{n}_limit")
  }
  from aepo_jax.data import arpo_data_root

  context = tools_lib.ToolContext("eval", data_root=arpo_data_root)  # replay's default: ARPO's search_cache.json
  try:
    return tools_lib.build_toolset(names, opts, mode="eval", context=context, eval_limits=limits)
  except tools_lib.ToolBuildError as e:
    if "search_backend" in tools_lib.tool_spec(e.tool).settings:
      raise EvalInputError(f"--search_backend={plan.search_backend}: {e.cause}") from None
    raise EvalInputError(str(e)) from None


def make_judge(plan: EvalPlan, protocol: str = "project"):
  """The project's strict judge, or (protocol 'official') the official judge request and reading."""
  if not plan.judge_url:
    return None
  from aepo_jax.rewards import OfficialJudge, OpenAICompatibleJudge

  if protocol == "official":
    return OfficialJudge(plan.judge_url, plan.judge_model)
  return OpenAICompatibleJudge(plan.judge_url, plan.judge_model)


def run_evaluation(
  plan: EvalPlan,
  output: str,
  *,
  settings: EvalSettings = EvalSettings(),
  ks: Sequence[int] = (1, 5),
  limit: Optional[int] = None,
  show_progress: bool = True,
  policy=None,
) -> dict:
  """Evaluates every benchmark of the plan into `output/<benchmark>.jsonl` and writes the summary."""
  ks = sorted({int(k) for k in ks})
  if ks and ks[-1] > settings.n:
    raise EvalInputError(f"--k={ks[-1]} needs at least that many samples per question; set --n >= {ks[-1]}.")
  os.makedirs(output, exist_ok=True)
  try:  # data errors (a missing file, a malformed record) come before the model too
    examples = {
      name: _benchmarks.load_examples(name, limit, data_options=plan.data_options) for name in plan.benchmarks
    }
  except (ValueError, FileNotFoundError) as e:
    raise EvalInputError(str(e)) from None
  if plan.policy_url and policy is None:  # a served policy: only its tokenizer is read here
    try:
      tokenizer = checkpoint_lib.load_tokenizer(plan.tokenizer)
    except (OSError, ValueError) as e:
      raise EvalInputError(f"--tokenizer={plan.tokenizer!r} could not be loaded ({e}).") from None
  _check_run_dir(output, plan, settings)
  tools = build_tools(plan, settings)
  try:
    rollouts = None
    if plan.policy_url:
      from aepo_jax.eval._remote import RemoteRollouts

      if policy is None:
        policy = checkpoint_lib.Policy(None, None, tokenizer, f"served policy {plan.policy_name}")
      rollouts = RemoteRollouts(
        plan.policy_url,
        plan.policy_model,
        policy.tokenizer,
        tools,
        settings.rollout_settings(),
        api_key=plan.policy_api_key,
        timeout_s=plan.policy_timeout_s,
      )
    elif policy is None:
      policy = checkpoint_lib.load_policy(plan.checkpoint, tokenizer=plan.tokenizer)
    scorer = Scorer(make_judge(plan, settings.protocol), judge_qa=plan.judge_qa, protocol=settings.protocol)
    evaluator = Evaluator(policy, tools, scorer, settings, show_progress=show_progress, rollouts=rollouts)
    results, t0 = {}, time.monotonic()
    for name in plan.benchmarks:
      shown = _benchmarks.display_name(name)
      results[shown] = evaluator.run(shown, examples[name], os.path.join(output, f"{shown}.jsonl"))
    meta = {
      "checkpoint": plan.policy_name,
      "protocol": settings.protocol,
      "source": policy.source,
      "settings": dataclasses.asdict(settings),
      "limit": limit,
      "search_backend": plan.search_backend,
      "judge_model": plan.judge_model,
      "judge_qa": plan.judge_qa,
      "browse": plan.browse,
      "tool_metrics": tools.metrics(),
      "seconds": time.monotonic() - t0,
    }
    if plan.policy_url:
      meta.update(policy_url=plan.policy_url, policy_model=plan.policy_model)
    families = {
      _benchmarks.display_name(n): _benchmarks.family_of(n, plan.data_options.get("family", "qa"))
      for n in plan.benchmarks
    }
    return _report.write_summary(output, results, ks=ks, families=families, meta=meta)
  finally:
    tools.shutdown()


_RUN_FILE = "run.json"
# Settings added after run.json files were written, with the value those runs used.
_SETTINGS_BEFORE = {"protocol": "project", "max_calls_per_turn": 1, "sample_timeout_s": 0.0}


def _check_run_dir(output: str, plan: EvalPlan, settings: EvalSettings) -> None:
  """A resumed run must use the settings of the run it continues (else its JSONL mixes two protocols)."""
  path = os.path.join(output, _RUN_FILE)
  mine = {
    "checkpoint": plan.checkpoint.path if plan.checkpoint is not None else None,
    "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k not in ("n", "batch_size", "chunk_steps")},
  }
  if plan.policy_url:  # a served policy: its URL and model in place of a checkpoint
    mine.update(policy_url=plan.policy_url, policy_model=plan.policy_model)
  if os.path.exists(path):
    with open(path) as f:
      theirs = json.load(f)
    for key, before in _SETTINGS_BEFORE.items():  # a run written before the setting existed ran with its default
      theirs.get("settings", {}).setdefault(key, before)
    if theirs != mine:
      diff = [
        k
        for k in set(theirs["settings"]) | set(mine["settings"])
        if theirs["settings"].get(k) != mine["settings"].get(k)
      ]
      for key in ("policy_model", "policy_url", "checkpoint"):
        if theirs.get(key) != mine.get(key):
          diff.insert(0, key)
      raise EvalInputError(
        f"--output {output!r} holds a run with different {diff}; resume with the same settings "
        "or choose another --output."
      )
  else:
    with open(path, "w") as f:
      json.dump(mine, f, indent=2, sort_keys=True)


def evaluate(
  evaluator: Evaluator, sources: Mapping[str, Sequence], *, reward_timeout_s: float = 10.0, records_path: str = ""
) -> dict:
  """The trainer's validation: the answers of `evaluator` (built on the trainer's own agent loop) to each named
  source of examples, as metrics.

  n = 1 (evaluator.settings.n): eval/<name>/accuracy (the scorer's verdict), eval/<name>/reward
  (`rewards.deep_research`, 0 past reward_timeout_s), eval/<name>/tool_calls (mean calls per answer), and
  eval/accuracy (the mean over sources).
  n = k > 1 (sampled answers): eval/<name>/pass@1 (the mean score of all samples) and eval/<name>/pass@k (the
  unbiased estimator, `pass_at_k`, per question, averaged), eval/<name>/tool_calls, and eval/pass@1, eval/pass@k
  (means over sources); no accuracy keys, so they never mix with the greedy n = 1 ones.

  Every process answers its own round-robin share of each source on its own devices (shares differ by at most one
  example; all samples of a question on the same process), writing nothing; the sums are combined across
  processes once per source, so every process calls this with the same sources.

  records_path: also write every answer of this process (its source, the record the evaluator scored, its reward)
  as JSON lines there (local or gs://; `<path>.p<i>` on process i of several), and log each source's result when
  it is known."""
  import logging

  import jax
  import numpy as np
  from aepo_jax import rewards as rewards_lib
  from aepo_jax.eval._passk import pass_at_k

  p, n = jax.process_index(), jax.process_count()
  k = getattr(getattr(evaluator, "settings", None), "n", 1)  # a caller's evaluator may carry no settings
  out, lines = {}, []
  for name, examples in sources.items():
    records = evaluator.run(name, list(examples)[p::n])
    reward = (
      rewards_lib.shared_pool().map(  # bounded time per answer, as in training; 0 past it
        rewards_lib.deep_research,
        [(r["response"], r["answers"]) for r in records],
        timeout_s=reward_timeout_s,
        default=0.0,
      )
      if records
      else []
    )
    calls = sum(r.get("num_tool_calls", 0) for r in records)
    if k == 1:
      sums = [len(records), sum(r["score"] for r in records), sum(reward), calls]
    else:
      correct = {}
      for r in records:
        correct.setdefault(r["id"], []).append(bool(r["score"]))
      sums = [
        len(correct),
        sum(float(np.mean(c)) for c in correct.values()),
        sum(pass_at_k(len(c), int(sum(c)), min(k, len(c))) for c in correct.values()),
        calls / k,
      ]
    sums = np.asarray(sums, np.float64)
    if n > 1:
      from jax.experimental import multihost_utils

      sums = np.asarray(multihost_utils.process_allgather(sums)).reshape(n, -1).sum(0)
    count = max(sums[0], 1.0)
    keys = ("accuracy", "reward") if k == 1 else ("pass@1", f"pass@{k}")
    for key, total in zip(keys + ("tool_calls",), sums[1:]):
      out[f"eval/{name}/{key}"] = float(total / count)
    logging.info(
      "evaluation %s: %s (%d questions%s)",
      name,
      ", ".join(f"{key} {out[f'eval/{name}/{key}']:.3f}" for key in keys + ("tool_calls",)),
      int(sums[0]),
      f", {k} samples each" if k > 1 else "",
    )
    lines += [json.dumps({"source": name, **r, "reward": float(w)}, default=str) for r, w in zip(records, reward)]
  if records_path:
    from etils import epath

    path = epath.Path(records_path if n == 1 else f"{records_path}.p{p}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
  if sources:
    for key in ("accuracy",) if k == 1 else ("pass@1", f"pass@{k}"):
      out[f"eval/{key}"] = float(np.mean([out[f"eval/{name}/{key}"] for name in sources]))
  return out
