r"""Evaluate a checkpoint on the papers' benchmarks (Pass@1 / Pass@k, spec §2.5), or compare evaluation runs.

  python launch/evaluate.py --checkpoint smollm2-135m-instruct --benchmarks gsm8k,math500 --limit 20 \
      --n 5 --k 1,5 --output /tmp/eval/smollm2
  python launch/evaluate.py --checkpoint gs://BUCKET/run/checkpoints/rl --benchmarks qa \
      --search-backend retrieval --search-url http://127.0.0.1:8000 --output /tmp/eval/rl
  python launch/evaluate.py --checkpoint /ckpt/rl/300 --benchmarks deep_search --search-backend serper \
      --judge-url http://127.0.0.1:8001/v1 --judge-model Qwen2.5-72B-Instruct --output /tmp/eval/ds
  python launch/evaluate.py --compare /tmp/eval/smollm2 /tmp/eval/rl [--output /tmp/eval/cmp]

--checkpoint: an Orbax checkpoint (step dir, phase dir or training workdir; local or gs://), an HF directory,
or a pretrained name. Rerunning the same command resumes: answers already in <output>/<benchmark>.jsonl are
kept. Bad input (unknown benchmark, missing checkpoint, missing search backend or judge, a judge that does
not answer) fails before any model is loaded. See docs/evaluation.md.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--checkpoint", help="Orbax checkpoint (local or gs://), HF directory, or pretrained name.")
  p.add_argument("--benchmarks", default="math", help="Names, families (math, qa, deep_search) or 'all'.")
  p.add_argument("--k", default="1,5", help="Pass@k values, e.g. '1,5' or '5' (Pass@1 is always reported).")
  p.add_argument("--n", type=int, default=None, help="Samples per question (default: the largest k).")
  p.add_argument("--limit", type=int, default=None, help="First N questions of each benchmark.")
  p.add_argument("--output", default=None, help="Run directory (JSONL per benchmark + summary).")
  p.add_argument("--search-backend", default=None,
                 help="retrieval | replay | local | serper | brave | bing | none (QA/deep-search sets need one).")
  p.add_argument("--search-url", default=None, help="Retrieval server URL (--search-backend retrieval).")
  p.add_argument("--search-cache", default=None, help="search_cache.json for replay (default: the ARPO one).")
  p.add_argument("--search-corpus", default=None, help="Corpus JSONL for --search-backend local.")
  p.add_argument("--judge-url", default=None, help="OpenAI-compatible base URL of the LLM judge.")
  p.add_argument("--judge-model", default=None, help="Model name served at --judge-url.")
  p.add_argument("--tokenizer", default=None, help="Tokenizer dir or pretrained name (overrides the checkpoint's).")
  p.add_argument("--template", default=None, help="System prompt template (default: code_search; math without search).")
  p.add_argument("--temperature", type=float, default=0.6)
  p.add_argument("--top-p", type=float, default=0.95)
  p.add_argument("--top-k", type=int, default=20)
  p.add_argument("--max-response-len", type=int, default=4096)
  p.add_argument("--max-prompt-len", type=int, default=2048)
  p.add_argument("--batch-size", type=int, default=8, help="Trajectories decoded together.")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--allow-unsandboxed", action="store_true", help="Run the python tool without bwrap/unshare.")
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--compare", nargs="+", default=None, metavar="RUN_DIR", help="Compare evaluation run directories.")
  args = p.parse_args(argv)
  if args.compare is None and not args.checkpoint:
    p.error("give --checkpoint PATH (evaluate) or --compare RUN_DIR [RUN_DIR ...] (compare).")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  from aepo_jax.parallel import use_cpu_xla_flags
  use_cpu_xla_flags()  # before JAX starts its backend
  from aepo_jax import eval as eval_lib

  if args.compare is not None:
    try:
      out = args.output or os.path.join(args.compare[0], "compare")
      md, png = eval_lib.compare(args.compare, out)
    except FileNotFoundError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    print(md)
    print(f"wrote {out}.md and {png}")
    return 0

  try:
    ks = sorted({int(k) for k in str(args.k).split(",") if k.strip()} | {1})
  except ValueError:
    print(f"error: --k {args.k!r} must be integers like '1,5'.", file=sys.stderr)
    return 2
  n = args.n or max(ks)
  search_opts = {"url": args.search_url, "path": args.search_cache, "corpus": args.search_corpus}
  try:
    plan = eval_lib.check_inputs(args.checkpoint, args.benchmarks, search_backend=args.search_backend,
                                 search_options=search_opts, judge_url=args.judge_url, judge_model=args.judge_model,
                                 tokenizer=args.tokenizer, allow_unsandboxed=args.allow_unsandboxed)
    template = args.template or ("math" if plan.search_backend in (None, "none") else "code_search")
    try:
      settings = eval_lib.EvalSettings(
          n=n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_prompt_len=args.max_prompt_len,
          max_response_len=args.max_response_len, batch_size=args.batch_size, seed=args.seed, template=template)
    except ValueError as e:
      raise eval_lib.EvalInputError(str(e)) from None
    output = args.output or os.path.join("eval_runs", os.path.basename(os.path.normpath(args.checkpoint)))
    summary = eval_lib.run_evaluation(plan, output, settings=settings, ks=ks, limit=args.limit,
                                      show_progress=not args.no_progress)
  except (eval_lib.EvalInputError, eval_lib.CheckpointNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(eval_lib.summary_markdown(summary))
  print(f"wrote {output}/summary.md, summary.json and one JSONL per benchmark")
  return 0


if __name__ == "__main__":
  sys.exit(main())
