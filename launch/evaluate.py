r"""Evaluate a checkpoint or a served policy (Pass@1 / Pass@k, spec §2.5) on the papers' benchmarks or your own
data, or compare runs.

  python launch/evaluate.py --checkpoint=smollm2-135m-instruct --benchmarks=gsm8k,math500 --limit=20 \
      --n=5 --k=1,5 --output=/tmp/eval/smollm2
  python launch/evaluate.py --checkpoint=gs://BUCKET/run/checkpoints/rl --benchmarks=qa \
      --search_backend=retrieval --search_url=http://127.0.0.1:8000 --output=/tmp/eval/rl
  python launch/evaluate.py --checkpoint=/ckpt/rl/300 --benchmarks=deep_search --search_backend=serper \
      --judge_url=http://127.0.0.1:8001/v1 --judge_model=Qwen2.5-72B-Instruct --output=/tmp/eval/ds
  python launch/evaluate.py --checkpoint=/ckpt/rl/300 --benchmarks=gaia --search_backend=retrieval \
      --search_url=http://127.0.0.1:8000 --search_mode=browse --browse_pages=/data/wiki.jsonl \
      --summarizer_url=http://127.0.0.1:8001/v1 --summarizer_model=Qwen2.5-72B-Instruct \
      --judge_url=http://127.0.0.1:8001/v1 --judge_model=Qwen2.5-72B-Instruct --output=/tmp/eval/sds
  python launch/evaluate.py --checkpoint=/ckpt/rl/300 --benchmarks=gs://BUCKET/data/my_test.jsonl \
      --question_field=problem --answer_field=solution --data_family=math --output=/tmp/eval/mine
  python launch/evaluate.py --policy_url=http://127.0.0.1:8000/v1 --policy_model=my-model \
      --tokenizer=/ckpt/hf/my-model --benchmarks=math500 --output=/tmp/eval/served
  python launch/evaluate.py --compare=/tmp/eval/smollm2,/tmp/eval/rl [--output=/tmp/eval/cmp]

--checkpoint: an Orbax checkpoint (step dir, phase dir or training workdir; local or gs://), an HF directory,
or a pretrained name. --policy_url instead: a policy served by any OpenAI-compatible server (launch/serve.py, vLLM,
SGLang) with its --policy_model and --tokenizer, run through the same tools, protocol, scoring and records (the
generation calls go over HTTP as token ids; docs/evaluation.md "Evaluating a served policy"). The defaults are the official evaluation protocol (spec §2.5): T=0.6, top_p 0.95, top_k 20,
min_p 0, repetition penalty 1.1, at most 4,096 tokens per generation call, 5 python and 10 search calls; with
--judge_url the QA and deep-search sets are scored by the judge OR math equivalence. Rerunning the same command resumes: answers already in <output>/<benchmark>.jsonl are
kept. Bad input (unknown benchmark, missing checkpoint or data file, missing search backend or judge, a judge
that does not answer) fails before any model is loaded. See docs/evaluation.md; data files: docs/data.md.
Flags are absl flags (--name=value or --name value); the older spellings --search-backend, --no-progress and
`--compare DIR DIR` still work.
"""

import os
import sys
from typing import Optional

from absl import flags

if not __package__:  # run as a script from a checkout (not as `python -m aepo_jax.launch.NAME`)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# This script's own flags, so that importing it (tests load it more than once) never collides with another
# module's definitions in absl's global FLAGS.
FLAGS = flags.FlagValues()
_F = {"flag_values": FLAGS}

_CHECKPOINT = flags.DEFINE_string(
  "checkpoint", None, "Orbax checkpoint (local or gs://), HF directory, or pretrained name.", **_F
)
_POLICY_URL = flags.DEFINE_string(
  "policy_url",
  None,
  "OpenAI base URL of a served policy (http://HOST:PORT/v1: launch/serve.py, vLLM, SGLang), evaluated instead of a "
  "--checkpoint; needs --policy_model and --tokenizer.",
  **_F,
)
_POLICY_MODEL = flags.DEFINE_string("policy_model", None, "Model name served at --policy_url.", **_F)
_POLICY_API_KEY = flags.DEFINE_string(
  "policy_api_key", None, "API key of --policy_url (default: $AEPO_JAX_POLICY_API_KEY; none: no key).", **_F
)
_POLICY_TIMEOUT_S = flags.DEFINE_float(
  "policy_timeout_s", 600.0, "Deadline of one generation request to --policy_url, in seconds.", **_F
)
_BENCHMARKS = flags.DEFINE_string(
  "benchmarks",
  "math",
  "Benchmark names, families (math, qa, deep_search), 'all', or .jsonl / .parquet data "
  "files (local or gs://), comma separated.",
  **_F,
)
_K = flags.DEFINE_string("k", "1,5", "Pass@k values, e.g. '1,5' or '5' (Pass@1 is always reported).", **_F)
_N = flags.DEFINE_integer("n", None, "Samples per question (default: the largest k).", **_F)
_LIMIT = flags.DEFINE_integer(
  "limit",
  None,
  "First N questions of each benchmark (0: all). Default: all; with --protocol=official 500, the official runs' cap "
  "per set.",
  **_F,
)
OFFICIAL_LIMIT = 500  # the official evaluation scripts evaluate at most 500 items of a set


_SAMPLE_TIMEOUT = flags.DEFINE_float(
  "sample_timeout",
  None,
  "Wall-clock seconds one answer may take (queued, decoding, tools); then it ends and is recorded as the official "
  "evaluator records a timeout (its text so far + '[Timeout (exceeding Ns)]', prediction 'Timeout': wrong). "
  "Default: 1500 with --protocol=official (the official SDS scripts' SAMPLE_TIMEOUT), else none. 0: no limit.",
  **_F,
)
OFFICIAL_SAMPLE_TIMEOUT_S = 1500.0  # SAMPLE_TIMEOUT of the official infer_local_sds.sh / infer_local_sds_cn.sh


def sample_timeout(flag: Optional[float], protocol: str) -> float:
  """Seconds per answer (0: no limit) from --sample_timeout and --protocol."""
  if flag is None:
    return OFFICIAL_SAMPLE_TIMEOUT_S if protocol == "official" else 0.0
  return float(flag)


def question_limit(flag: Optional[int], protocol: str) -> Optional[int]:
  """Questions per benchmark (None: all) from --limit and --protocol."""
  if flag is None:
    return OFFICIAL_LIMIT if protocol == "official" else None
  return flag or None


_OUTPUT = flags.DEFINE_string(
  "output",
  None,
  "Run directory (JSONL per benchmark + summary); default eval_runs/<checkpoint name>. With "
  "--compare: the output prefix.",
  **_F,
)
_COMPILE_CACHE = flags.DEFINE_string(
  "compile_cache",
  "auto",
  "Persistent XLA compilation cache: a rerun (or resume) reads the engine's programs back instead of compiling them "
  "again. auto: <output>/compile_cache ($JAX_COMPILATION_CACHE_DIR, where set, stands instead); a folder (local or "
  "gs://); '' = none.",
  **_F,
)
_SEARCH_BACKEND = flags.DEFINE_string(
  "search_backend",
  None,
  "retrieval | replay | local | serper | brave | bing | none (QA and deep-search benchmarks need one).",
  **_F,
)
_SEARCH_URL = flags.DEFINE_string("search_url", None, "Retrieval server URL (--search_backend=retrieval).", **_F)
_SEARCH_CACHE = flags.DEFINE_string("search_cache", None, "search_cache.json for replay (default: the ARPO one).", **_F)
_SEARCH_CORPUS = flags.DEFINE_string("search_corpus", None, "Corpus JSONL for --search_backend=local.", **_F)
_TOOLS = flags.DEFINE_list(
  "tools",
  None,
  "Registered tools to add to python and search (comma separated; default: the checkpoint's training tools.names).",
  **_F,
)
_TOOL_PLUGINS = flags.DEFINE_list(
  "tool_plugins",
  None,
  "Modules to import first, which register tools (default: the checkpoint's training tools.plugins).",
  **_F,
)
_JUDGE_URL = flags.DEFINE_string("judge_url", None, "OpenAI-compatible base URL of the LLM judge.", **_F)
_JUDGE_MODEL = flags.DEFINE_string("judge_model", None, "Model name served at --judge_url.", **_F)
_JUDGE_QA = flags.DEFINE_bool(
  "judge_qa",
  True,
  "With a judge, also judge the QA sets (the protocol); --nojudge_qa scores them by exact match.",
  **_F,
)
_SEARCH_MODE = flags.DEFINE_enum(
  "search_mode",
  "snippets",
  ["snippets", "browse"],
  "snippets: `Page i:` lines; browse: the SDS browser (the "
  "hits' pages from --browse_pages, condensed by the LLM at --summarizer_url).",
  **_F,
)
_BROWSE_PAGES = flags.DEFINE_string(
  "browse_pages",
  None,
  "Page store of --search_mode=browse: a directory of pages or a corpus JSONL (default: --search_corpus).",
  **_F,
)
_SUMMARIZER_URL = flags.DEFINE_string(
  "summarizer_url", None, "OpenAI-compatible base URL of the browse summariser (--search_mode=browse).", **_F
)
_SUMMARIZER_MODEL = flags.DEFINE_string("summarizer_model", None, "Model name served at --summarizer_url.", **_F)
_BROWSE_LIVE = flags.DEFINE_bool("browse_live", False, "Fetch http(s) pages the page store lacks.", **_F)
_BROWSE_VARIANT = flags.DEFINE_enum(
  "browse_variant",
  None,
  ["project", "sds", "sds_cn"],
  "Browser of --search_mode=browse: sds / sds_cn (the official SDS browser as released, English / Chinese: the "
  "agent's previous reasoning in the prompt, snippet-anchored page windows, **Final Information**) or project (this "
  "project's summary prompt). Default: sds with --protocol=official (sds_cn when every benchmark is a Chinese set: "
  "xbench), else project.",
  **_F,
)
CHINESE_SETS = frozenset({"xbench"})  # the official runs them by infer_local_sds_cn.sh: code_search_cn, sds_cn


def official_chinese(benchmarks, protocol: str) -> bool:
  """Whether the official Chinese set-up applies by default (the official sds_cn script's browser and prompt)."""
  return protocol == "official" and bool(benchmarks) and set(benchmarks) <= CHINESE_SETS


def browse_variant(flag: Optional[str], protocol: str, benchmarks=()) -> str:
  """The browser from --browse_variant, --protocol and the benchmarks."""
  if flag:
    return flag
  if protocol != "official":
    return "project"
  return "sds_cn" if official_chinese(benchmarks, protocol) else "sds"


_TOKENIZER = flags.DEFINE_string(
  "tokenizer",
  None,
  "Tokenizer dir or pretrained name (overrides the checkpoint's; with --policy_url: the served model's).",
  **_F,
)
_TEMPLATE = flags.DEFINE_string(
  "template",
  None,
  "System prompt template (default: the one a training checkpoint was trained with; else code_search, math without "
  "search).",
  **_F,
)
_QUESTION_FIELD = flags.DEFINE_string("question_field", "question", "Question field of data-file records.", **_F)
_ANSWER_FIELD = flags.DEFINE_string(
  "answer_field",
  "answer",
  "Answer field of data-file records (a string, a number or a list of accepted answers).",
  **_F,
)
_SYSTEM_FIELD = flags.DEFINE_string(
  "system_field",
  "system",
  "Optional field of data-file records with their own system prompt (replaces the template's).",
  **_F,
)
_DATA_FAMILY = flags.DEFINE_enum(
  "data_family",
  "qa",
  ["qa", "math"],
  "Scoring of data-file answers: qa (math equivalence or exact match) or math (math equivalence only).",
  **_F,
)
_PROTOCOL = flags.DEFINE_enum(
  "protocol",
  "official",
  ["official", "project"],
  "Scoring: official (the official ARPO/AEPO evaluator: its metrics em/acc/f1/math_equal/llm_equal, judge prompt, "
  "reply rule and fallbacks) or project (math-verify, the strict judge). Named in every record and report.",
  **_F,
)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "Sampling temperature (0: greedy).", **_F)
_TOP_P = flags.DEFINE_float("top_p", 0.95, "Nucleus sampling mass.", **_F)
_TOP_K = flags.DEFINE_integer("top_k", 20, "Top-k sampling (0: off).", **_F)
_MIN_P = flags.DEFINE_float("min_p", 0.0, "min-p sampling (0: off).", **_F)
_REPETITION_PENALTY = flags.DEFINE_float(
  "repetition_penalty", 1.1, "vLLM repetition penalty over the prompt and the response (1: off).", **_F
)
_MAX_TOKENS_PER_CALL = flags.DEFINE_integer(
  "max_tokens_per_call",
  4096,
  "Tokens one generation call may sample (vLLM max_tokens); a call that reaches it ends the answer. 0: no cap.",
  **_F,
)
_MAX_RESPONSE_LEN = flags.DEFINE_integer(
  "max_response_len",
  8192,
  "Response tokens of a whole answer, tool results included (the engine's cache holds "
  "batch_size x (max_prompt_len + this)).",
  **_F,
)
_MAX_PROMPT_LEN = flags.DEFINE_integer("max_prompt_len", 2048, "Prompt tokens.", **_F)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Trajectories decoded together.", **_F)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.", **_F)
_ALLOW_UNSANDBOXED = flags.DEFINE_bool("allow_unsandboxed", False, "Run the python tool without bwrap/unshare.", **_F)
_PROGRESS = flags.DEFINE_bool("progress", True, "Show progress bars (--noprogress: off).", **_F)
_COMPARE = flags.DEFINE_list(
  "compare", None, "Compare evaluation run directories (comma separated) instead of evaluating.", **_F
)
_RESCORE = flags.DEFINE_string(
  "rescore",
  None,
  "An evaluation run directory whose answers to score again under --protocol (with --judge_url/--judge_model "
  "when it judges) into --output, without generating; prints where the two scorings differ.",
  **_F,
)


def _absl_spelling(argv):
  """--search-backend -> --search_backend, --no-progress / --no_progress -> --noprogress; `--compare A B C`
  -> `--compare=A,B,C` (argparse spellings of earlier versions of this script)."""
  out, compare = [], None
  for arg in argv:
    if compare is not None and not arg.startswith("-"):
      compare.append(arg)
      continue
    compare = None
    if arg.startswith("--") and len(arg) > 2:
      name, eq, value = arg[2:].partition("=")
      key = name.replace("-", "_")
      if key.startswith("no_") and key[3:] in FLAGS and FLAGS[key[3:]].boolean:
        key = "no" + key[3:]
      if key == "compare" and not eq:
        compare = []
        out.append(compare)
        continue
      arg = f"--{key}{eq}{value}"
    out.append(arg)
  return [f"--compare={','.join(a)}" if isinstance(a, list) else a for a in out]


def _usage() -> str:
  return __doc__ + "\nFlags:\n" + FLAGS.module_help(FLAGS.find_module_defining_flag("checkpoint"))


def parse(argv):
  """Parse `argv` (without the program name) into FLAGS; returns leftover positional arguments."""
  FLAGS.unparse_flags()
  return FLAGS(["evaluate.py", *_absl_spelling(argv)])[1:]


def _rescore(eval_lib) -> int:
  """--rescore=RUN_DIR: the run's answers scored under --protocol into --output (default RUN_DIR_<protocol>)."""
  out = _OUTPUT.value or f"{_RESCORE.value.rstrip('/')}_{_PROTOCOL.value}"
  judge = None
  if _JUDGE_URL.value:
    if not _JUDGE_MODEL.value:
      print("error: --judge_url needs --judge_model.", file=sys.stderr)
      return 2
    plan = eval_lib.EvalPlan(checkpoint=None, benchmarks=(), judge_url=_JUDGE_URL.value, judge_model=_JUDGE_MODEL.value)
    judge = eval_lib.make_judge(plan, _PROTOCOL.value)
  try:
    eval_lib.rescore(_RESCORE.value, out, protocol=_PROTOCOL.value, judge=judge, judge_qa=_JUDGE_QA.value)
    print(eval_lib.protocol_differences(_RESCORE.value, out))
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {out}/ (records and summary under --protocol={_PROTOCOL.value})")
  return 0


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if any(a in ("-h", "--help", "-help", "--helpfull") for a in argv):
    print(_usage())
    return 0
  try:
    rest = parse(argv)
  except flags.Error as e:
    print(f"error: {e}\nSee --help.", file=sys.stderr)
    return 2
  if rest:
    print(f"error: unexpected arguments {rest}; flags are written --name=value.", file=sys.stderr)
    return 2
  if not _COMPARE.value and not _RESCORE.value and not _CHECKPOINT.value and not _POLICY_URL.value:
    print(
      "error: give --checkpoint=PATH (evaluate) or --compare=RUN_DIR,RUN_DIR (compare), or --policy_url=URL "
      "--policy_model=NAME --tokenizer=TOK (evaluate a served policy).",
      file=sys.stderr,
    )
    return 2

  from aepo_jax.parallel import use_cpu_xla_flags

  use_cpu_xla_flags()  # before JAX starts its backend
  from aepo_jax import eval as eval_lib

  if _COMPARE.value:
    try:
      out = _OUTPUT.value or os.path.join(_COMPARE.value[0], "compare")
      md, png = eval_lib.compare(_COMPARE.value, out)
    except FileNotFoundError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    print(md)
    print(f"wrote {out}.md and {png}")
    return 0
  if _RESCORE.value:
    return _rescore(eval_lib)

  try:
    ks = sorted({int(k) for k in str(_K.value).split(",") if k.strip()} | {1})
  except ValueError:
    print(f"error: --k={_K.value!r} must be integers like '1,5'.", file=sys.stderr)
    return 2
  n = _N.value or max(ks)
  search_opts = {"url": _SEARCH_URL.value, "path": _SEARCH_CACHE.value, "corpus": _SEARCH_CORPUS.value}
  browse = None
  if _SEARCH_MODE.value == "browse":
    browse = {
      "pages": _BROWSE_PAGES.value or _SEARCH_CORPUS.value,
      "summarizer_url": _SUMMARIZER_URL.value,
      "summarizer_model": _SUMMARIZER_MODEL.value,
      "live": _BROWSE_LIVE.value,
      "variant": _BROWSE_VARIANT.value,  # None: by --protocol and the benchmarks, once they are known
    }
  elif _BROWSE_VARIANT.value:
    print("error: --browse_variant needs --search_mode=browse.", file=sys.stderr)
    return 2
  data_opts = {
    "question_key": _QUESTION_FIELD.value,
    "answer_key": _ANSWER_FIELD.value,
    "system_key": _SYSTEM_FIELD.value,
    "family": _DATA_FAMILY.value,
  }
  served = {}
  if _POLICY_URL.value:
    served = {
      "policy_url": _POLICY_URL.value,
      "policy_model": _POLICY_MODEL.value,
      "policy_api_key": _POLICY_API_KEY.value or os.environ.get("AEPO_JAX_POLICY_API_KEY") or None,
      "policy_timeout_s": _POLICY_TIMEOUT_S.value,
    }
  try:
    plan = eval_lib.check_inputs(
      _CHECKPOINT.value,
      _BENCHMARKS.value,
      search_backend=_SEARCH_BACKEND.value,
      search_options=search_opts,
      judge_url=_JUDGE_URL.value,
      judge_model=_JUDGE_MODEL.value,
      tokenizer=_TOKENIZER.value,
      allow_unsandboxed=_ALLOW_UNSANDBOXED.value,
      data_options=data_opts,
      judge_qa=_JUDGE_QA.value,
      browse=browse,
      **served,
    )
    if plan.browse is not None:
      plan.browse["variant"] = browse_variant(_BROWSE_VARIANT.value, _PROTOCOL.value, plan.benchmarks)
    # The prompt the checkpoint was trained with (its saved data.template), unless --template says otherwise: a
    # checkpoint asked in another template's format scores near 0.
    trained_config = (eval_lib.training_config(plan.checkpoint) if plan.checkpoint is not None else None) or {}
    trained = trained_config.get("data", {}).get("template")
    # The tools the checkpoint was trained with (plug-ins too), unless --tools / --tool_plugins say otherwise.
    trained_tools = trained_config.get("tools", {})
    plan.tools = tuple(_TOOLS.value if _TOOLS.value is not None else trained_tools.get("names", ()))
    plan.tool_plugins = tuple(
      _TOOL_PLUGINS.value if _TOOL_PLUGINS.value is not None else trained_tools.get("plugins", ())
    )
    template = _TEMPLATE.value or trained or ("math" if plan.search_backend in (None, "none") else "code_search")
    if not _TEMPLATE.value and official_chinese(plan.benchmarks, _PROTOCOL.value):
      template = "code_search_cn"  # the official prompt of xbench (infer_local_sds_cn.sh), whatever it was trained with
      print(f"template: {template!r}, the official evaluation's for {', '.join(plan.benchmarks)}", file=sys.stderr)
    elif trained and not _TEMPLATE.value:
      print(f"template: {template!r}, the one the checkpoint was trained with (--template to change)", file=sys.stderr)
    try:
      settings = eval_lib.EvalSettings(
        n=n,
        temperature=_TEMPERATURE.value,
        top_p=_TOP_P.value,
        top_k=_TOP_K.value,
        min_p=_MIN_P.value,
        repetition_penalty=_REPETITION_PENALTY.value,
        max_tokens_per_call=_MAX_TOKENS_PER_CALL.value,
        max_prompt_len=_MAX_PROMPT_LEN.value,
        max_response_len=_MAX_RESPONSE_LEN.value,
        batch_size=_BATCH_SIZE.value,
        seed=_SEED.value,
        template=template,
        protocol=_PROTOCOL.value,
        max_calls_per_turn=4 if _PROTOCOL.value == "official" else 1,  # the official engine's continuation calls
        sample_timeout_s=sample_timeout(_SAMPLE_TIMEOUT.value, _PROTOCOL.value),
      )
    except ValueError as e:
      raise eval_lib.EvalInputError(str(e)) from None
    name = _CHECKPOINT.value or _POLICY_MODEL.value
    output = _OUTPUT.value or os.path.join("eval_runs", os.path.basename(os.path.normpath(name)))
    limit = question_limit(_LIMIT.value, _PROTOCOL.value)
    if _LIMIT.value is None and limit:
      print(f"--protocol=official: at most {limit} questions per benchmark (--limit=0 for all)", file=sys.stderr)
    from aepo_jax.parallel import CompileCacheError, use_compile_cache

    try:
      use_compile_cache(_COMPILE_CACHE.value, output, name="--compile_cache")
    except CompileCacheError as e:
      raise eval_lib.EvalInputError(str(e)) from None
    summary = eval_lib.run_evaluation(
      plan, output, settings=settings, ks=ks, limit=limit, show_progress=_PROGRESS.value
    )
  except (eval_lib.EvalInputError, eval_lib.CheckpointNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except eval_lib.PolicyServerError as e:  # the served policy failed mid-run: the answers so far are kept
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(eval_lib.summary_markdown(summary))
  print(f"wrote {output}/summary.md, summary.json and one JSONL per benchmark")
  return 0


if __name__ == "__main__":
  sys.exit(main())
