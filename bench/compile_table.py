r"""The compiled programs of shipped pod configs on TPU slices, at full depth: one table, the single source of the
compiled per-chip peaks, HBM and collective bytes the docs quote (docs/compiled.md).

  pip install -e ".[tpu]"     # libtpu: XLA:TPU compiles on this CPU host
  python bench/compile_table.py                                  # aepo_gaia on v5p:4x4x2 and v6e:8x8
  python bench/compile_table.py --configs=aepo_gaia,arpo_gaia_8b --topologies=v5p:4x4x2 --programs=update,decode

Each (config, topology) runs `launch/compile.py` (every program of the config's run unless --programs) in its own
process and keeps its JSON line in --out (default docs/results/compiled/CONFIG@TOPOLOGY.json); a pair whose JSON is
there is not compiled again (--force: it is; with --programs only those programs' rows are replaced). Then docs/compiled.md is written from every JSON in --out: per
program the peak GB per chip, the HBM and collective GB one call moves per chip (loop trip counts included), the
compile time, and whether it fits; per config the decode step's HBM bytes against its bound (the rollout weights
and KV pool per chip). Compiling a 40-layer program takes minutes on a 2-core host (prefill and decode loop over
layers in Python: their compile time grows with depth).
"""

import datetime
import json
import os
import subprocess
import sys

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def define_flags() -> None:
  """The command's flags (defined only when run as a command: importing this module, as its test does, defines
  none, so it never collides with another module's flags)."""
  flags.DEFINE_list("configs", ["aepo_gaia"], "Shipped configs (configs/NAME.py[:variant]).")
  flags.DEFINE_list("topologies", ["v5p:4x4x2", "v6e:8x8"], "TPU slices.")
  flags.DEFINE_list("programs", [], "Programs (default: every program of each config's run).")
  flags.DEFINE_string("out", os.path.join(ROOT, "docs", "results", "compiled"), "Where the JSON lines go.")
  flags.DEFINE_string("table", os.path.join(ROOT, "docs", "compiled.md"), "The markdown table ('' = none).")
  flags.DEFINE_bool("force", False, "Compile again where a JSON is already in --out.")
  flags.DEFINE_integer("timeout", 7200, "Seconds per (config, topology).")


def compile_one(config: str, topology: str, programs, timeout: int) -> dict:
  """launch/compile.py's JSON report of `config` (NAME[:variant]) on `topology`, at the config's full depth."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  name, _, variant = config.partition(":")
  cmd = [
    sys.executable,
    os.path.join(ROOT, "launch", "compile.py"),
    f"--config={os.path.join(ROOT, 'configs', name + '.py')}" + (f":{variant}" if variant else ""),
    f"--topology={topology}",
  ] + ([f"--programs={','.join(programs)}"] if programs else [])
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  lines = out.stdout.strip().splitlines()
  if out.returncode not in (0, 1) or not lines or not lines[-1].startswith("{"):
    raise RuntimeError(f"{config} on {topology}: launch/compile.py exited {out.returncode}:\n{out.stderr[-3000:]}")
  report = json.loads(lines[-1])
  report["config"] = config
  report["date"] = datetime.date.today().isoformat()
  report["table"] = [line for line in lines[:-1] if line.strip()]
  return report


def merge(old: dict, new: dict) -> dict:
  """`old` with the programs compiled again in `new` replaced (and its rollout facts, date and table lines);
  fits again only if every program does."""
  out = dict(old, programs={**old["programs"], **new["programs"]}, date=new["date"])
  out["rollout"] = {**old.get("rollout", {}), **new.get("rollout", {})}
  usable = out["hbm_gb"] * (1 - out.get("headroom", 0.0))
  out["fits"] = all(p["peak_gb"] <= usable for p in out["programs"].values())
  out["table"] = new["table"]
  return out


def markdown(reports: list) -> str:
  """docs/compiled.md from the reports (sorted by config, then topology)."""
  lines = [
    "# Compiled programs of the pod configs",
    "",
    "What XLA:TPU compiles for each shipped pod config at its full depth, on this CPU host (libtpu,",
    "`jax.experimental.topologies`): measured compilations, not runs. Written by `python bench/compile_table.py`",
    "from `launch/compile.py`'s JSON (docs/results/compiled/); the docs and config docstrings quote this page.",
    "",
    "Per chip: `peak` = arguments + outputs - donated + temporaries + what stays resident while the program runs",
    "(the training state during rollouts); `HBM` = bytes one call reads and writes (an estimate from the compiled",
    "text, aepo_jax/train/_hlo.py); `coll` = collective result bytes of one call; loop trip counts included; GB.",
    "",
  ]
  for r in sorted(reports, key=lambda r: (r["config"], r["topology"])):
    ro = r.get("rollout", {})
    lines += [
      f"## {r['config']} on {r['topology']} ({r['chips']} chips, {r['hbm_gb']:.0f} GB HBM each; compiled {r['date']})",
      "",
      "| program | peak GB | HBM GB per call | collectives GB per call | large copies GB | compile s | fits |",
      "|---|---|---|---|---|---|---|",
    ]
    usable = r["hbm_gb"] * (1 - r.get("headroom", 0.0))
    for name, p in r["programs"].items():
      lines.append(
        f"| {name} | {p['peak_gb']:.2f} | {p.get('hbm_gb', 0):.2f} | {p['collective_gb']:.2f} | "
        f"{p['large_copy_gb']:.2f} | {p['compile_s']:.0f} | {'yes' if p['peak_gb'] <= usable else 'NO'} |"
      )
    lines.append("")
    if ro:
      lines.append(
        f"Rollouts: {ro['hosts']} hosts x {ro['host_chips']} chips, {ro['slots']} slots per host "
        f"({ro.get('compact_slots') or 'no'} in a compact decode call), {ro['kv_layout']} KV cache of "
        f"{ro['kv_tokens']:,} tokens per host ({ro['kv_cache_gb']:.2f} GB per chip), rollout weights "
        f"{ro['weights_gb']:.2f} GB per chip."
      )
      if "decode_hbm_ratio" in ro:
        lines.append(
          f"A decode step moves {ro['decode_hbm_ratio']:.2f}x its bound (weights + KV pool per chip, "
          f"{ro['decode_bound_gb']:.2f} GB)."
        )
      lines.append("")
    lines.append(f"Result: {'fits' if r['fits'] else 'does NOT fit'} with {r.get('headroom', 0):.0%} of HBM left free.")
    lines.append("")
  return "\n".join(lines)


def main(argv):
  del argv
  from tqdm import tqdm

  F = flags.FLAGS
  os.makedirs(F.out, exist_ok=True)
  jobs = [(c, t) for c in F.configs for t in F.topologies]
  for config, topology in tqdm(jobs, desc="compile", unit="config"):
    path = os.path.join(F.out, f"{config.replace(':', '+')}@{topology.replace(':', '_')}.json")
    if os.path.exists(path) and not F.force:
      continue
    report = compile_one(config, topology, F.programs, F.timeout)
    if F.programs and os.path.exists(path):  # some programs again: the others' rows stay
      report = merge(json.load(open(path)), report)
    with open(path + ".tmp", "w") as f:
      json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)
    print("\n".join(report["table"]), flush=True)
  reports = []
  for name in sorted(os.listdir(F.out)):
    if name.endswith(".json"):
      with open(os.path.join(F.out, name)) as f:
        reports.append(json.load(f))
  if F.table:
    with open(F.table, "w") as f:
      f.write(markdown(reports))
    print(f"wrote {F.table} ({len(reports)} config x topology)")


if __name__ == "__main__":
  define_flags()
  app.run(main)
