"""What a compiled XLA program moves, read from its text (`compiled.as_text()`): collectives and their bytes per chip
with loop trip counts included, and the copies of large buffers.

`compiled.cost_analysis()` counts a loop body once; here each computation is weighted by how often it runs: a
`while` body by its trip count (from the condition's `compare(i, constant(N)), direction=LT`), a fusion or call by its
caller's count, and each branch of a `conditional` by its caller's count (an upper bound: one branch runs).

  collectives(text) -> {"all-gather": CollectiveTotal(count, bytes), ...}
  large_copies(text, min_bytes) -> [(shape, layout, count)]

Bytes are those of each collective's result on one chip (for an all-gather the gathered array, for an all-reduce the
reduced array): a like-for-like measure to compare two programs, not a wire-level count.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

import numpy as np

_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "bf16": 2,
  "f16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
_HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{\s*$")
_SHAPE = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+([a-z][\w-]*)\(")


@dataclasses.dataclass
class CollectiveTotal:
  count: float = 0.0  # executions per call of the program (trip counts included)
  bytes: float = 0.0  # result bytes on one chip, summed over executions


def computations(text: str) -> tuple[dict, str]:
  """{name: [instruction lines]} of an HLO module's text, and the ENTRY computation's name."""
  comps, entry, current = {}, "", None
  for line in text.splitlines():
    m = _HEADER.match(line)
    if m:
      current = m.group(2)
      comps[current] = []
      if m.group(1):
        entry = current
    elif line.startswith("}"):
      current = None
    elif current is not None and line.strip():
      comps[current].append(line.strip())
  return comps, entry


def _trip_count(condition: list, comps: dict) -> int:
  """N of a counted loop's condition `compare(i, constant(N)), direction=LT`, the compare written out or inside a
  fusion the condition calls (XLA:CPU wraps it); 1 when not recognisable."""
  consts = {}
  for line in condition:
    m = re.match(r"%(\S+) = [su]\d+\[\](?:\{[^}]*\})? constant\((-?\d+)\)", line)
    if m:
      consts[m.group(1)] = int(m.group(2))
  for line in condition:
    args = None
    if " compare(" in line and "direction=LT" in line:
      args = re.search(r"compare\(([^)]*)\)", line).group(1)
    else:
      called = re.search(r"fusion\(([^)]*)\).*calls=%([\w.\-]+)", line)
      if called and any(" compare(" in x and "direction=LT" in x for x in comps.get(called.group(2), [])):
        args = called.group(1)
    if args is None:
      continue
    for name in re.findall(r"%([\w.\-]+)", args):
      if name in consts:
        return max(consts[name], 1)
    m = re.search(r"constant\((\d+)\)", args)
    if m:
      return max(int(m.group(1)), 1)
  return 1


def multiplicities(comps: dict, entry: str) -> dict:
  """How many times each computation runs per call of the program."""
  mult = defaultdict(float)

  def visit(name, m):
    if name not in comps or m == 0:
      return
    mult[name] += m
    for line in comps[name]:
      if " while(" in line:
        cond = re.search(r"condition=%([\w.\-]+)", line).group(1)
        body = re.search(r"body=%([\w.\-]+)", line).group(1)
        visit(body, m * _trip_count(comps.get(cond, []), comps))
        continue
      for callee in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line):
        if not re.search(r"\b(reduce|reduce-window|scatter|sort|map|select-and-scatter|all-reduce)(-start)?\(", line):
          visit(callee, m)
      branches = re.search(r"branch_computations=\{([^}]*)\}", line)
      if branches:
        for callee in re.findall(r"%([\w.\-]+)", branches.group(1)):
          visit(callee, m)
      for key in ("true_computation", "false_computation"):
        callee = re.search(rf"{key}=%([\w.\-]+)", line)
        if callee:
          visit(callee.group(1), m)

  visit(entry, 1.0)
  return mult


def _bytes(shape_text: str) -> int:
  """Bytes of the largest array in an instruction's result type (a tuple's largest element: an async start's
  buffer)."""
  best = 0
  for dtype, dims, _ in _SHAPE.findall(shape_text):
    if dtype in _DTYPE_BYTES:
      best = max(best, int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * _DTYPE_BYTES[dtype])
  return best


def collectives(text: str) -> dict:
  """{kind: CollectiveTotal} per call of the program, loop trip counts included (async pairs counted once, at
  their start)."""
  comps, entry = computations(text)
  mult = multiplicities(comps, entry)
  out = {kind: CollectiveTotal() for kind in COLLECTIVES}
  for name, lines in comps.items():
    m = mult.get(name, 0.0)
    if not m:
      continue
    for line in lines:
      op = _OP.search(line)
      if not op:
        continue
      kind = op.group(2).removesuffix("-start")
      if kind in out and not op.group(2).endswith("-done"):
        out[kind].count += m
        out[kind].bytes += m * _bytes(op.group(1))
  return out


def large_copies(text: str, min_bytes: int) -> list:
  """[(result type, executions per call)] of `copy` / `copy-start` instructions whose result is at least
  `min_bytes` (relayouts and moves of big buffers), loop trip counts included."""
  comps, entry = computations(text)
  mult = multiplicities(comps, entry)
  found = []
  for name, lines in comps.items():
    m = mult.get(name, 0.0)
    for line in lines:
      op = _OP.search(line)
      if m and op and op.group(2) in ("copy", "copy-start") and _bytes(op.group(1)) >= min_bytes:
        found.append((op.group(1)[:120], m))
  return found
