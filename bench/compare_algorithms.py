r"""RL algorithms side by side on one config over seeds: per seed one cold-start SFT that every algorithm starts
from, then RL with each algorithm at the same rollout budget; results.json, results.md (table with 95% bootstrap
intervals over seeds) and PNG plots.

  python bench/compare_algorithms.py --config=configs/cpu_default.py --algorithms=grpo,arpo,aepo \
      --seeds=0,1,2 --steps=5 --out=/tmp/compare
  python bench/compare_algorithms.py --out=/tmp/compare --report_only      # re-read the runs, rewrite the report
  python bench/compare_algorithms.py --records=docs/results/partial_rollouts_ramp_20_steps.json \
      --windows=5-12,13-20      # a saved sweep's tables, plus per-seed ratios over those RL steps; runs nothing

Resumable: each finished run leaves `summary.json` in its folder and is never rerun; an interrupted one continues
from its own checkpoints (the trainer's exact resume). Rerunning with more seeds or algorithms adds runs; another
--config, --set or --steps into the same --out is refused.

Algorithms are the presets of configs/common.py (grpo, dapo, reinforce_pp, arpo, aepo) or the `NAME` function of
configs/NAME_gaia.py (gspo, gppo, cispo); `config` is the base config's own algorithm, unchanged. A preset may set only the algorithm's own keys (`algo.*` and the rollout
policy's: policy, initial_rollouts, enable_dynamic_rollouts, consecutive_penalty, premonitor_beta, probe_tokens,
penalize_refills); everything else it changes (e.g. arpo's tools.retry_count) is put back to the base config's value
and listed in the run's record, so every algorithm has the same prompts per step, samples per prompt (rollout.n),
response length, tools, learning rate and steps. Seeds: train.seed = sft.seed = data.seed = the seed.

Variants: `NAME+KEY=VALUE[+KEY=VALUE...]` is preset NAME with those keys set after it (any key: they are what the
variant is about), e.g. `--algorithms=aepo,aepo+train.max_staleness=1+algo.off_policy=decoupled` compares the
synchronous step with partial rollouts (docs/rollout.md) at the same budget.

Per run and RL step it records reward, tool calls per trajectory, the update batch's policy entropy, the sampler's
per-token entropy over the first 20 tokens after tool results against every other generated token (and the branching
rule's window statistic after tool results and at the start), branch statistics (branches per prompt, top-3 share,
consecutive share, tree depth), response length and step time; held-out accuracy (greedy) before and after RL and at
--eval_every; with --set=eval.pass_k=K also Pass@1 and Pass@K of K sampled answers per question before and after RL.
The runs' own folders keep their metrics.jsonl, evaluations and logs.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _compare_report as report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Keys an algorithm preset owns; anything else it changes is put back to the base config's value.
OWNED = (
  "algo",
  "rollout.policy",
  "rollout.initial_rollouts",
  "rollout.enable_dynamic_rollouts",
  "rollout.consecutive_penalty",
  "rollout.premonitor_beta",
  "rollout.probe_tokens",
  "rollout.penalize_refills",
)


def _owned(key: str) -> bool:
  return any(key == p or key.startswith(p + ".") for p in OWNED)


def preset(name: str):
  """The function that turns a config into algorithm `name`'s (configs/common.py, else configs/NAME_gaia.py)."""
  from aepo_jax import train

  if name == "config":  # the base config's own algorithm, as it is
    return lambda c: c
  configs = os.path.join(ROOT, "configs")
  common = train.load_sibling(os.path.join(configs, "common.py"), "common")
  fn = getattr(common, name, None) if not name.startswith("_") else None
  if fn is None and os.path.exists(os.path.join(configs, f"{name}_gaia.py")):
    fn = getattr(train.load_sibling(os.path.join(configs, "common.py"), f"{name}_gaia"), name, None)
  known = ("grpo", "dapo", "reinforce_pp", "arpo", "aepo", "gspo", "gppo", "cispo")
  if not callable(fn):
    raise app.UsageError(f"--algorithms: no preset {name!r}; choose from {', '.join(known)}.")
  return fn


def parse_label(label: str) -> tuple:
  """'aepo+train.max_staleness=1' -> ('aepo', {'train.max_staleness': 1})."""
  name, *sets = label.split("+")
  extra = {}
  for item in sets:
    key, eq, value = item.partition("=")
    if not eq or not key:
      raise app.UsageError(f"--algorithms: {label!r}: each '+' part must be KEY=VALUE (got {item!r}).")
    extra[key] = _parse_value(value)
  return name, extra


def algorithm_config(base, label: str):
  """(config, the keys put back to the base's value) of algorithm `label` (a preset, or a variant of one) on
  `base`."""
  from aepo_jax import train

  name, extra = parse_label(label)
  c = preset(name)(copy.deepcopy(base))
  before, after = train.flatten(base), train.flatten(c)
  reverted = []
  for key in sorted(set(before) | set(after)):
    if before.get(key) != after.get(key) and not _owned(key):
      train.set_key(c, key, before[key])
      reverted.append(key)
  for key, value in extra.items():
    if key not in before:
      raise app.UsageError(f"--algorithms: {label!r}: no config key {key!r}.")
    train.set_key(c, key, value)
  return c, reverted


def _parse_value(text: str):
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    return text


def base_config(spec: dict):
  from aepo_jax import train

  path, _, arg = spec["config"].partition(":")
  overrides = {k: _parse_value(v) for k, v in (s.split("=", 1) for s in spec["set"])}
  c = train.load_config(path, arg or None, overrides=overrides)
  if spec["steps"]:
    c.train.steps = spec["steps"]
  c.train.eval_every = spec["eval_every"]
  c.eval.before_rl = c.eval.after_rl = True
  c.metrics.progress = False  # the sweep's bar shows progress; each run's log is in its folder
  return c


def plan(spec: dict) -> list[dict]:
  """Every run of the sweep, SFT runs first per seed: {'kind', 'algorithm', 'seed', 'dir', 'config', 'reverted'}."""
  base = base_config(spec)
  out, runs = spec["out"], []
  for seed in spec["seeds"]:
    sft = copy.deepcopy(base)
    sft.mode = "sft"
    sft.train.seed = sft.sft.seed = sft.data.seed = seed
    sft_dir = os.path.join(out, "sft", f"seed{seed}")
    sft.workdir = os.path.join(sft_dir, "work")
    runs.append(dict(kind="sft", algorithm="sft", seed=seed, dir=sft_dir, config=sft, reverted=[]))
    for name in spec["algorithms"]:
      c, reverted = algorithm_config(base, name)
      c.mode = "rl"
      c.train.seed = c.sft.seed = c.data.seed = seed
      c.model.init = "checkpoint"
      c.model.name = os.path.join(sft.workdir, "checkpoints", "sft")
      run_dir = os.path.join(out, "rl", name, f"seed{seed}")
      c.workdir = os.path.join(run_dir, "work")
      runs.append(dict(kind="rl", algorithm=name, seed=seed, dir=run_dir, config=c, reverted=reverted))
  return runs


def check_spec(spec: dict) -> None:
  """Write OUT/sweep.json, or refuse when it holds another base config, overrides or step count."""
  path = os.path.join(spec["out"], "sweep.json")
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    fixed = ("config", "set", "steps", "eval_every")
    diff = [f"{k}: {old.get(k)!r} there, {spec[k]!r} now" for k in fixed if old.get(k) != spec[k]]
    if diff:
      raise app.UsageError(
        f"--out={spec['out']} holds a sweep with other settings ({'; '.join(diff)}); use a new --out, or the same "
        "settings to continue it (more --seeds or --algorithms only add runs)."
      )
    spec = {
      **spec,
      "algorithms": _union(old["algorithms"], spec["algorithms"]),
      "seeds": _union(old["seeds"], spec["seeds"]),
    }
  os.makedirs(spec["out"], exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(spec, f, indent=1)
  os.replace(path + ".tmp", path)


def _union(a: list, b: list) -> list:
  return list(a) + [x for x in b if x not in a]


def is_done(run: dict) -> bool:
  return os.path.exists(os.path.join(run["dir"], "summary.json"))


def _steps_of(run: dict) -> int:
  c = run["config"]
  return int(c.sft.steps if run["kind"] == "sft" else c.train.steps)


def _logged_steps(run: dict) -> int:
  """The last training step the run's metrics.jsonl holds (its progress)."""
  key = "sft/nll" if run["kind"] == "sft" else "reward/mean"
  last = 0
  try:
    with open(os.path.join(run["config"].workdir, "metrics.jsonl")) as f:
      for line in f:
        if key in line:
          last = max(last, json.loads(line)["step"])
  except (OSError, ValueError):
    pass
  return last


def execute(run: dict, on_poll) -> float:
  """Run one config in a child process (its log: DIR/log.txt); seconds it took. Raises on failure."""
  from aepo_jax import train

  os.makedirs(run["dir"], exist_ok=True)
  with open(os.path.join(run["dir"], "config.json"), "w") as f:
    f.write(train.to_json(run["config"]))
  t0 = time.time()
  with open(os.path.join(run["dir"], "log.txt"), "a") as log:
    proc = subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), f"--child={run['dir']}"], stdout=log, stderr=log
    )
    while proc.poll() is None:
      on_poll()
      time.sleep(2.0)
  if proc.returncode != 0:
    raise RuntimeError(
      f"{run['kind']} run {run['algorithm']} seed {run['seed']} failed (exit {proc.returncode}); its log: "
      f"{os.path.join(run['dir'], 'log.txt')}. Rerun the same command to continue after fixing it."
    )
  return time.time() - t0


def child(run_dir: str) -> None:
  """Inside the child process: train the run folder's config, then write summary.json (the run is done)."""
  from aepo_jax import logs, parallel

  parallel.use_cpu_xla_flags()
  logs.setup()
  from aepo_jax import train

  with open(os.path.join(run_dir, "config.json")) as f:
    config = train.from_json(f.read())
  t0 = time.time()
  try:
    summary = {k: v for k, v in train.run(config).items() if k != "params"}
  except train.NothingToDo:  # finished before an interruption kept summary.json from being written
    summary = {}
  summary["wall_s"] = time.time() - t0
  path = os.path.join(run_dir, "summary.json")
  with open(path + ".tmp", "w") as f:
    json.dump(summary, f, indent=1, default=float)
  os.replace(path + ".tmp", path)


def sweep(spec: dict) -> None:
  import shutil

  from tqdm import tqdm

  runs = plan(spec)
  todo = [r for r in runs if not is_done(r)]
  print(f"{len(runs)} runs ({len(runs) - len(todo)} done already) in {spec['out']}", flush=True)
  per_step = {"sft": [], "rl": []}  # seconds per step of the finished runs, for the ETA
  bar = tqdm(total=sum(_steps_of(r) for r in todo), unit="step", dynamic_ncols=True)

  def eta(current=None) -> str:
    left = 0.0
    for r in todo:
      if is_done(r):
        continue
      rate = per_step[r["kind"]] or per_step["sft" if r["kind"] == "rl" else "rl"]
      if not rate:
        return "ETA after the first run"
      factor = 3.0 if (r["kind"] == "rl" and not per_step["rl"]) else 1.0  # an RL step ~3 SFT steps here
      n = _steps_of(r) - (_logged_steps(r) if r is current else 0)
      left += factor * n * sum(rate) / len(rate)
    return f"ETA {left / 60:.0f} min"

  for run in todo:
    label = f"{run['algorithm']} seed {run['seed']}"
    bar.set_description(label)
    start = bar.n

    def poll(run=run, start=start):
      bar.update(start + _logged_steps(run) - bar.n)
      bar.set_postfix_str(eta(run))

    logged_before = _logged_steps(run)  # a resumed run: only the steps this process ran time the ETA
    seconds = execute(run, poll)
    bar.update(start + _steps_of(run) - bar.n)
    ran = _logged_steps(run) - logged_before
    if ran > 0:
      per_step[run["kind"]].append(seconds / ran)
    bar.write(f"{label}: {seconds / 60:.1f} min; {eta()}")
    if run["kind"] == "rl" and not spec["keep_checkpoints"]:
      shutil.rmtree(os.path.join(run["config"].workdir, "checkpoints"), ignore_errors=True)
  bar.close()


def define_flags() -> None:
  """The command's flags (defined only when run as a command: importing this module defines none)."""
  flags.DEFINE_string("config", "configs/cpu_default.py", "Base experiment config (configs/*.py[:arg]).")
  flags.DEFINE_list("algorithms", ["grpo", "arpo", "aepo"], "Algorithm presets to compare.")
  flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds (train.seed = sft.seed = data.seed).")
  flags.DEFINE_integer("steps", 0, "RL steps per run (0 = the config's train.steps).")
  flags.DEFINE_integer("eval_every", 0, "Held-out evaluation every N RL steps (0: before and after).")
  flags.DEFINE_multi_string("set", [], "Base config override KEY=VALUE (JSON value or string), repeatable.")
  flags.DEFINE_string("out", None, "Output folder (local).")
  flags.DEFINE_bool("keep_checkpoints", False, "Keep each finished RL run's checkpoints (about 3 GB each).")
  flags.DEFINE_bool("report_only", False, "Only re-read the finished runs and rewrite the report.")
  flags.DEFINE_string(
    "records", None, "Print the report's tables from a saved results.json (e.g. docs/results/*.json); runs nothing."
  )
  flags.DEFINE_string(
    "windows",
    "",
    "With --records: also the per-seed ratios to the first arm over these RL step windows, e.g. 5-12,13-20.",
  )
  flags.DEFINE_string("child", None, "Internal: run the config in this run folder.")


def main(argv):
  del argv
  F = flags.FLAGS
  if F.child:
    child(F.child)
    return
  if F.records:
    print(report.tables_from(F.records, report.parse_windows(F.windows)))
    return
  if F.windows:
    raise app.UsageError("--windows only reads saved records: give --records=results.json with it.")
  if not F.out:
    raise app.UsageError("--out=DIR is required.")
  out = os.path.abspath(F.out)
  if F.report_only:
    with open(os.path.join(out, "sweep.json")) as f:
      spec = json.load(f)
  else:
    spec = dict(
      config=F.config,
      algorithms=list(F.algorithms),
      seeds=[int(s) for s in F.seeds],
      steps=F.steps,
      eval_every=F.eval_every,
      set=list(F.set),
      out=out,
      keep_checkpoints=F.keep_checkpoints,
    )
    check_spec(spec)
    with open(os.path.join(out, "sweep.json")) as f:
      spec = {**json.load(f), "keep_checkpoints": F.keep_checkpoints}
    for label in spec["algorithms"]:
      algorithm_config(base_config(spec), label)  # a wrong name or key fails before any run
    sweep(spec)
  runs = [r for r in plan(spec) if r["kind"] == "rl" and is_done(r)]
  paths = report.write(out, runs, spec)
  print("\n".join(f"wrote {p}" for p in paths))


if __name__ == "__main__":
  define_flags()
  app.run(main)
