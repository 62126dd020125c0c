"""Chat traces for the cold-start SFT: JSONL or Parquet files (local or gs://, read as a stream) in the forms
LLaMA-Factory reads, normalised to one `Trace` per record.

  alpaca     {"instruction": ..., "input": ... (optional), "output": ..., "system": ... (optional),
              "history": [[user, assistant], ...] (optional)}; the user turn is instruction + "\\n" + input.
  sharegpt   {"conversations": [{"from": "human" | "gpt" | "system" | "observation" | "function_call", "value": ...}],
              "system": ... (optional)}, or {"messages": [{"role": "user" | "assistant" | "system" | "tool",
              "content": ...}]} (the OpenAI form).
The form is detected per record. Tool results live inside an assistant turn as `<result>...</result>` (how
ARPO-SFT-54K and our rollouts write them); an observation / tool turn is folded into the assistant turn before it
in the training result format (" <result>\\n{text}\\n</result>") and its place kept (`OBSERVED`). `segments` splits an
assistant turn into the model's text (trained) and its tool results (no loss, as in RL); with mask_results=False
only the folded observation turns are untrained, as LLaMA-Factory's released recipe trains (a `<result>` written
inside an assistant turn is then trained like the rest of the turn). A malformed record raises RecordError naming the
file, the line (JSONL, from 1) or row (Parquet, from 0) and the field.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterator

from aepo_jax.data._files import iter_rows, is_data_file
from aepo_jax.data._records import RecordError

_ROLES = {
  "human": "user",
  "user": "user",
  "gpt": "assistant",
  "assistant": "assistant",
  "function_call": "assistant",
  "system": "system",
  "observation": "tool",
  "tool": "tool",
  "function": "tool",
}
_RESULT = re.compile(r"\s*<result>.*?</result>", re.DOTALL)
OBSERVED = "observed"  # an assistant message's key: [(start, end)] character spans of folded observation turns


@dataclasses.dataclass(frozen=True)
class Trace:
  """messages: [{"role": "system" | "user" | "assistant", "content": str}], starting with an optional system turn
  and a user turn, with at least one assistant turn; tool results are inside the assistant turns."""

  id: str
  messages: list


def segments(
  text: str, *, where: str = "assistant turn", mask_results: bool = True, observed=()
) -> list[tuple[str, bool]]:
  """An assistant turn as (text, trained) pieces: the model's own text trained, every `<result>...</result>`
  (with the whitespace before it, which the rollout appends as part of the result) not. With mask_results=False
  only the `observed` character spans (folded observation turns, `OBSERVED`) are untrained."""
  spans = [(m.start(), m.end()) for m in _RESULT.finditer(text)]
  tail = text[spans[-1][1] :] if spans else text
  opened = tail.find("<result>")
  if opened >= 0:
    raise ValueError(f"{where}: '<result>' at character {len(text) - len(tail) + opened} has no closing '</result>'")
  if not mask_results:
    spans = sorted(tuple(s) for s in observed)
  out, at = [], 0
  for start, end in spans:
    if start > at:
      out.append((text[at:start], True))
    out.append((text[start:end], False))
    at = end
  if text[at:]:
    out.append((text[at:], True))
  return out


def _text(value: Any, path, i, field: str, unit: str, *, required: bool = True) -> str:
  if value is None and not required:
    return ""
  if not isinstance(value, str) or (required and not value.strip()):
    raise RecordError(path, i, field, f"expected a non-empty string, got {value!r:.80}", unit=unit)
  return value


def _alpaca(rec: dict, path, i, unit) -> list:
  msgs = []
  if rec.get("system"):
    msgs.append({"role": "system", "content": _text(rec["system"], path, i, "system", unit)})
  history = rec.get("history") or []
  if not isinstance(history, list):
    raise RecordError(path, i, "history", "expected a list of [user, assistant] pairs", unit=unit)
  for k, pair in enumerate(history):
    if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
      raise RecordError(path, i, f"history[{k}]", "expected a [user, assistant] pair", unit=unit)
    msgs.append({"role": "user", "content": _text(pair[0], path, i, f"history[{k}][0]", unit)})
    msgs.append({"role": "assistant", "content": _text(pair[1], path, i, f"history[{k}][1]", unit)})
  query = _text(rec.get("instruction"), path, i, "instruction", unit)
  extra = _text(rec.get("input"), path, i, "input", unit, required=False)
  msgs.append({"role": "user", "content": f"{query}\n{extra}" if extra else query})
  msgs.append({"role": "assistant", "content": _text(rec.get("output"), path, i, "output", unit)})
  return msgs


def _sharegpt(rec: dict, path, i, unit) -> list:
  key = "conversations" if "conversations" in rec else "messages"
  turns = rec[key]
  if not isinstance(turns, list) or not turns:
    raise RecordError(path, i, key, "expected a non-empty list of turns", unit=unit)
  role_key, text_key = ("from", "value") if isinstance(turns[0], dict) and "from" in turns[0] else ("role", "content")
  msgs = []
  if rec.get("system"):
    msgs.append({"role": "system", "content": _text(rec["system"], path, i, "system", unit)})
  for k, turn in enumerate(turns):
    field = f"{key}[{k}]"
    if not isinstance(turn, dict):
      raise RecordError(path, i, field, f"expected an object with {role_key!r} and {text_key!r}", unit=unit)
    role = _ROLES.get(str(turn.get(role_key)))
    if role is None:
      raise RecordError(
        path, i, f"{field}.{role_key}", f"unknown role {turn.get(role_key)!r}; use one of {sorted(_ROLES)}", unit=unit
      )
    text = _text(turn.get(text_key), path, i, f"{field}.{text_key}", unit)
    if role == "tool":  # a tool result: into the assistant turn before it, as the rollout writes it
      if not msgs or msgs[-1]["role"] != "assistant":
        raise RecordError(path, i, field, "a tool result must follow an assistant turn", unit=unit)
      wrapped = text if "<result>" in text else f" <result>\n{text}\n</result>"
      start = len(msgs[-1]["content"])
      msgs[-1]["content"] += wrapped
      msgs[-1].setdefault(OBSERVED, []).append((start, start + len(wrapped)))
    elif role == "assistant" and msgs and msgs[-1]["role"] == "assistant":
      msgs[-1]["content"] += text  # the model continues after a tool result
    elif role == "system" and msgs:
      raise RecordError(path, i, field, "a system turn must come first", unit=unit)
    else:
      msgs.append({"role": role, "content": text})
  return msgs


def _check(msgs: list, path, i, unit, form: str) -> None:
  roles = [m["role"] for m in msgs]
  body = roles[1:] if roles[:1] == ["system"] else roles
  if not body or body[0] != "user":
    raise RecordError(
      path,
      i,
      form,
      f"the turns must start with a user turn (after an optional system turn); got roles {roles}",
      unit=unit,
    )
  if "assistant" not in body:
    raise RecordError(path, i, form, "no assistant turn: nothing to train on", unit=unit)
  for k, m in enumerate(msgs):
    if m["role"] == "assistant":
      try:
        segments(m["content"], where=f"{form} assistant turn {k}")
      except ValueError as e:
        raise RecordError(path, i, form, str(e), unit=unit) from None


def trace_from_record(rec: Any, path: str, i: int, unit: str = "line") -> Trace:
  """One record (alpaca or sharegpt form, detected) as a Trace; RecordError names the line and field."""
  if not isinstance(rec, dict):
    raise RecordError(path, i, "<record>", f"expected a JSON object, got {type(rec).__name__}", unit=unit)
  if "conversations" in rec or "messages" in rec:
    form, msgs = "conversations" if "conversations" in rec else "messages", _sharegpt(rec, path, i, unit)
  elif "instruction" in rec or "output" in rec:
    form, msgs = "instruction", _alpaca(rec, path, i, unit)
  else:
    raise RecordError(
      path,
      i,
      "<record>",
      f"neither alpaca (instruction/input/output) nor sharegpt "
      f"(conversations or messages) fields; fields present: {sorted(rec)}",
      unit=unit,
    )
  _check(msgs, path, i, unit, form)
  return Trace(f"{path}:{i}", msgs)


def read_traces(path: str) -> Iterator[Trace]:
  """Every record of a JSONL or Parquet file of chat traces (local or gs://), streamed."""
  path = str(path)
  if not is_data_file(path):
    raise ValueError(f"trace file {path!r}: expected a .jsonl or .parquet file (local or gs://).")
  n = 0
  for i, rec, unit in iter_rows(path):
    n += 1
    yield trace_from_record(rec, path, i, unit)
  if not n:
    raise ValueError(f"trace file {path!r} holds no records.")
