"""What a compiled XLA program moves, read from its text (`compiled.as_text()`): collectives and their bytes per chip
with loop trip counts included, and the copies of large buffers.

`compiled.cost_analysis()` counts a loop body once; here each computation is weighted by how often it runs: a
`while` body by its trip count (from the condition's `compare(i, constant(N)), direction=LT`), a fusion or call by its
caller's count, and each branch of a `conditional` by its caller's count (an upper bound: one branch runs).

  collectives(text) -> {"all-gather": CollectiveTotal(count, bytes), ...}
  large_copies(text, min_bytes) -> [(shape, layout, count)]
  hbm_bytes(text) -> bytes one call reads and writes in HBM (an estimate; see there)

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
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)  # XLA's own, where it wrote one
        visit(body, m * (int(known.group(1)) if known else _trip_count(comps.get(cond, []), comps)))
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


# Instructions that move no data of their own (aliases, control flow whose bodies are counted, buffer markers).
_NO_TRAFFIC = {
  "parameter",
  "constant",
  "tuple",
  "get-tuple-element",
  "bitcast",
  "while",
  "conditional",
  "call",
  "after-all",
  "partition-id",
  "replica-id",
  "opt-barrier",
  "add-dependency",
  "iota",
}
_SLICE_READS = ("dynamic-slice", "gather", "slice")
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # updates a buffer (operand 0) in place: its update operand


def _hbm_array_bytes(type_text: str) -> int:
  """Bytes of every array in an instruction's type (each element of a tuple) that lives in HBM: arrays in another
  memory space (`S(1)` VMEM, `S(5)` host, ...) are left out."""
  total = 0
  for dtype, dims, layout in _SHAPE.findall(type_text):
    if dtype in _DTYPE_BYTES and not re.search(r"S\([1-9]\d*\)", layout or ""):
      total += int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * _DTYPE_BYTES[dtype]
  return total


def _parse(line: str):
  """(name, result type, opcode, operand names) of one instruction line, or None."""
  m = re.match(r"(?:ROOT )?%(\S+) = ", line)
  op = _OP.search(line)
  if not m or not op:
    return None
  start = op.end()
  depth, end = 1, start
  while end < len(line) and depth:
    depth += {"(": 1, ")": -1}.get(line[end], 0)
    end += 1
  return m.group(1), op.group(1), op.group(2), re.findall(r"%([\w.\-]+)", line[start : end - 1])


def _param_reads(lines: list, index: int, comps: dict) -> tuple:
  """(bytes read of parameter `index` of a fused computation, whether a dynamic-update-slice or scatter updates it in
  place): a parameter only sliced (dynamic-slice, gather, slice; through bitcasts and nested fusions) reads the
  slices; one only updated in place reads nothing; anything else reads it whole (None: the caller counts the whole operand)."""
  insts = [x for x in (_parse(line) for line in lines) if x]
  name = next(
    (m.group(1) for line in lines if (m := re.match(rf"(?:ROOT )?%(\S+) = .* parameter\({index}\)", line))), None
  )
  if name is None:
    return None, False
  total, in_place, frontier = 0, False, [name]
  while frontier:
    current = frontier.pop()
    for user, t, opcode, operands in insts:
      for i, o in enumerate(operands):
        if o != current:
          continue
        if opcode == "bitcast":
          frontier.append(user)
        elif opcode in _SLICE_READS and i == 0:
          total += _hbm_array_bytes(t)
        elif opcode in _IN_PLACE and i == 0:
          in_place = True
        elif opcode == "fusion":
          line = next(x for x in lines if re.match(rf"(?:ROOT )?%{re.escape(user)} = ", x))
          callee = re.search(r"calls=%([\w.\-]+)", line).group(1)
          nested, nested_in_place = _param_reads(comps.get(callee, []), i, comps)
          if nested is None:
            return None, False
          total, in_place = total + nested, in_place or nested_in_place
        else:
          return None, False
  return total, in_place


def _fusion_traffic(fused: list, operand_types: list, result_type: str, comps: dict) -> int:
  """HBM bytes of one fusion: each operand read whole, except one only sliced inside (a dynamic-slice, gather or
  slice of it, also in a nested fusion: the slices' bytes) or updated in place (the buffer of a dynamic-update-slice
  or scatter: nothing read); the result written whole, except an in-place update's buffer (only the update's
  bytes)."""
  insts = [x for x in (_parse(line) for line in fused) if x]
  total, in_place = 0, False
  for idx, t in enumerate(operand_types):
    read, updated = _param_reads(fused, idx, comps)
    total += _hbm_array_bytes(t) if read is None else read
    in_place = in_place or updated
  root = next((_parse(line) for line in fused if line.startswith("ROOT ")), None)
  if root is None:
    return total + _hbm_array_bytes(result_type)
  by_name = {name: (t, opcode, operands) for name, t, opcode, operands in insts}
  for part in [root[0]] if root[2] != "tuple" else root[3]:
    t, opcode, operands = by_name.get(part, ("", "", []))
    if opcode in _IN_PLACE and in_place:
      total += _hbm_array_bytes(by_name.get(operands[_IN_PLACE[opcode]], ("",))[0])
    else:
      total += _hbm_array_bytes(t)
  return total


def hbm_bytes(text: str) -> float:
  """HBM bytes one call of a compiled program reads and writes, loop trip counts included: every instruction outside
  fusions (a fusion, copy, collective, custom call such as a Pallas kernel, ...) reads its operands and writes its
  result, as XLA's cost analysis counts them, with its exceptions: a slice reads only the slice, an in-place
  dynamic-update-slice or scatter reads nothing of its buffer and writes only the update, and arrays outside HBM (VMEM) are
  left out. An estimate of the traffic (a kernel that reads part of an operand, say only the live pages of a KV
  pool, is counted as reading all of it), to compare with a bound such as weights + KV cache per decode step."""
  comps, entry = computations(text)
  mult = multiplicities(comps, entry)
  fused = set()
  for lines in comps.values():
    for line in lines:
      if " fusion(" in line:
        fused.update(re.findall(r"calls=%([\w.\-]+)", line))
  total = 0.0
  for name, lines in comps.items():
    m = mult.get(name, 0.0)
    if not m or name in fused:
      continue
    types = {}
    for line in lines:
      x = _parse(line)
      if not x:
        continue
      inst, result, opcode, operands = x
      types[inst] = result
      if opcode in _NO_TRAFFIC or opcode.endswith("-done") or 'custom_call_target="AllocateBuffer"' in line:
        continue
      operand_types = [types.get(o, "") for o in operands]
      if opcode == "fusion":
        callee = re.search(r"calls=%([\w.\-]+)", line).group(1)
        total += m * _fusion_traffic(comps.get(callee, []), operand_types, result, comps)
      elif opcode in _SLICE_READS:
        total += m * 2 * _hbm_array_bytes(result)
      elif opcode in _IN_PLACE:
        total += m * 2 * _hbm_array_bytes(operand_types[_IN_PLACE[opcode]])
      else:
        total += m * (sum(_hbm_array_bytes(t) for t in operand_types) + _hbm_array_bytes(result))
  return total
