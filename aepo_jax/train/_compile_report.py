"""What `launch/compile.py` prints for a compile plan (`_compile.compile_plan`): the table, the advice for a program
that does not fit, and the one-line JSON report that bench/compile_table.py keeps (docs/compiled.md)."""

from __future__ import annotations

import json

from aepo_jax.train._compile import compile_plan

# Per program: the settings that lower its per-chip memory, for the advice when it does not fit.
KNOBS = {
  "sft": "sft.micro_batch_size (rows per micro-batch), sft.max_len, model.remat=True, mesh.fsdp / mesh.tensor",
  "weight_cast": "mesh.fsdp / mesh.tensor (more sharding of the training state)",
  "weight_copy": "rollout.mesh (more chips per host for the copy), rollout.dtype=bfloat16",
  "decode_compact": "rollout.kv_tokens, rollout.max_slots (as for decode)",
  "update": "train.micro_batch_size (rows per micro-batch), model.remat=True, mesh.fsdp / mesh.tensor (more "
  "sharding), rollout.max_response_len",
  "logprob": "train.micro_batch_size, mesh.fsdp / mesh.tensor",
  "prefill": "rollout.prefill_rows, rollout.prefill_chunk, rollout.kv_tokens (the paged KV pool per host) or "
  "rollout.max_slots (a smaller KV cache)",
  "decode": "rollout.kv_tokens (the paged KV pool per host; slots that run short wait or are preempted), "
  "rollout.max_slots (slots per host; the agent loop queues the rest), rollout.mesh.tensor, "
  "rollout.dtype=bfloat16, rollout.max_response_len",
}


def report_json(report: dict) -> dict:
  """The one-line summary: topology, chips, hbm_gb, per-program peak_gb (and parts), fits."""
  return {
    "topology": report["topology"],
    "chips": report["chips"],
    "hbm_gb": report["hbm_gb"],
    "programs": {
      name: {
        "peak_gb": round(p.peak_gb, 2),
        "argument_gb": round(p.argument_gb, 2),
        "output_gb": round(p.output_gb, 2),
        "alias_gb": round(p.alias_gb, 2),
        "temp_gb": round(p.temp_gb, 2),
        "resident_gb": round(p.resident_gb, 2),
        "compile_s": round(p.compile_s, 1),
        "attention": p.attention,
        "kernels": list(p.kernels),
        "collective_gb": round(p.collective_gb, 3),
        "collectives_gb": {k: round(v, 3) for k, v in p.collectives.items()},
        "large_copy_gb": round(p.copy_gb, 3),
        "large_copies": [list(c) for c in p.large_copies],
        "hbm_gb": round(p.hbm_gb, 3),
        "flops": p.flops,
      }
      for name, p in report["programs"].items()
    },
    **(
      {"rollout": {k: round(v, 3) if isinstance(v, float) else v for k, v in report["rollout"].items()}}
      if "rollout" in report
      else {}
    ),
    "headroom": report.get("headroom", 0.0),
    "fits": bool(report["fits"]),
  }


def format_table(report: dict) -> str:
  lines = [
    f"topology {report['topology']}: {report['chips']} chips, {report['hbm_gb']:.0f} GB HBM each; "
    f"training mesh {report['mesh']}"
  ]
  if "rollout" in report:
    ro = report["rollout"]
    lines.append(
      f"rollouts: {ro['hosts']} hosts x {ro['host_chips']} chips; {ro['slots']} slots x {ro['max_len']} "
      f"tokens per host; rollout weights {ro['weights_gb']:.2f} GB, KV cache {ro['kv_cache_gb']:.2f} GB "
      f"per chip ({ro.get('kv_layout', 'dense')}, {ro.get('kv_tokens', 0):,} tokens per host)"
    )
  lines.append(
    f"training state per chip: params {report['params_gb']:.2f} GB, optimizer {report['opt_state_gb']:.2f} GB"
  )
  head = (
    f"{'program':<15}{'chips':>6}{'args':>9}{'out':>9}{'alias':>9}{'temp':>9}{'resident':>10}{'peak':>9}"
    f"{'compile':>9}{'hbm':>10}{'coll':>9}  fits  attention"
  )
  lines += [head, "-" * len(head)]
  for name, p in report["programs"].items():
    ok = p.peak_gb <= report.get("usable_gb", report["hbm_gb"])
    lines.append(
      f"{name:<15}{p.devices:>6}{p.argument_gb:>9.2f}{p.output_gb:>9.2f}{p.alias_gb:>9.2f}{p.temp_gb:>9.2f}"
      f"{p.resident_gb:>10.2f}{p.peak_gb:>9.2f}{p.compile_s:>8.1f}s{p.hbm_gb:>10.2f}{p.collective_gb:>9.2f}  {'yes' if ok else 'NO':<4}  "
      f"{p.attention}"
    )
  ro = report.get("rollout", {})
  if "decode_hbm_ratio" in ro:
    lines.append(
      f"decode: {report['programs']['decode'].hbm_gb / ro['decode_steps']:.2f} GB of HBM per step per chip, "
      f"{ro['decode_hbm_ratio']:.2f}x the bound (rollout weights + KV pool per chip, {ro['decode_bound_gb']:.2f} GB)"
    )
  lines.append(
    "(GB per chip; peak = args + out - alias + temp + resident; fits: peak within HBM less "
    f"{report.get('headroom', 0.0):.0%} headroom; hbm / coll: HBM bytes read and written / collective result bytes per call, loop trips "
    "included; "
    "attention: the kernels it calls, xla: none)"
  )
  sh = report.get("shardings", {})
  if sh:
    lines.append("parameter shardings: " + ", ".join(f"{k}={v}" for k, v in list(sh["params"].items())[:6]) + ", ...")
    if sh.get("kv_cache"):
      axes = (
        "per layer (kv_heads, pages, page_size, head_dim)"
        if report.get("rollout", {}).get("kv_layout") == "paged"
        else "(layers, slots, length, kv_heads, head_dim)"
      )
      lines.append(f"KV cache sharding {axes}: {sh['kv_cache']}")
  return "\n".join(lines)


def advice(report: dict) -> list:
  """For each program over the chip's HBM: what to change."""
  return [
    f"{name} needs {p.peak_gb:.1f} GB per chip > {report.get('usable_gb', report['hbm_gb']):.1f} GB "
    f"({report['hbm_gb']:.0f} GB less {report.get('headroom', 0.0):.0%} headroom): try {KNOBS[name]}."
    for name, p in report["programs"].items()
    if p.peak_gb > report.get("usable_gb", report["hbm_gb"])
  ]


def check(config, topology: str, programs=None, *, hlo_dir: str = "", headroom=0.05) -> int:
  """Compiles (programs=None: the run's), prints the table and (last) the JSON line; returns the exit status: 0
  fits, 1 does not."""
  report = compile_plan(config, topology, programs=programs, hlo_dir=hlo_dir, headroom=headroom)
  print(format_table(report))
  for line in advice(report):
    print("does not fit: " + line)
  print(json.dumps(report_json(report)), flush=True)
  return 0 if report["fits"] else 1
