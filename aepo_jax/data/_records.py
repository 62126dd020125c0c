"""The one normalised record type for every data source, and the error for malformed records."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

FAMILIES = ("math", "qa", "deep_search")


class RecordError(ValueError):
  """A malformed record; the message names the file, the line (or row) and the field."""

  def __init__(self, path: str | os.PathLike, line: int, field: str, problem: str, unit: str = "line"):
    self.path, self.line, self.field = str(path), line, field
    where = f"{path}:{line}" if unit == "line" else f"{path} {unit} {line}"
    super().__init__(f"{where}: field {field!r}: {problem}")


@dataclasses.dataclass(frozen=True)
class Example:
  """One question with its reference answers.

  id: unique within its source ("<benchmark>:<line>" or "<parquet stem>:<row>").
  answers: every accepted alias, as strings (ints and `####` solutions already normalised).
  source: benchmark or file name; family: 'math' | 'qa' | 'deep_search'.
  metadata: source-specific extras (GAIA level, HLE answer_type, data_source, ...), JSON-safe.
  """

  id: str
  question: str
  answers: list[str]
  source: str
  family: str
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"Example {self.id}: family must be one of {FAMILIES}, got {self.family!r}")
    if not isinstance(self.answers, list) or not all(isinstance(a, str) for a in self.answers):
      raise TypeError(f"Example {self.id}: answers must be a list of str, got {self.answers!r}")

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "Example":
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def require(record: Any, field: str, types: type | tuple[type, ...], path: Path | str, line: int):
  """record[field] checked to be present and of `types`, else a RecordError naming all three."""
  if not isinstance(record, dict):
    raise RecordError(path, line, "<record>", f"expected a JSON object, got {type(record).__name__}")
  if field not in record:
    raise RecordError(path, line, field, f"missing (keys present: {sorted(record)})")
  value = record[field]
  if not isinstance(value, types) or isinstance(value, bool):
    names = types.__name__ if isinstance(types, type) else "/".join(t.__name__ for t in types)
    raise RecordError(path, line, field, f"expected {names}, got {type(value).__name__} {value!r:.80}")
  return value


def answers_from(value: Any, path: Path | str, line: int, field: str = "answer", unit: str = "line") -> list[str]:
  """int | str | list[str|int] -> non-empty list[str]."""
  if isinstance(value, bool) or not isinstance(value, (str, int, list)):
    raise RecordError(
      path, line, field, f"expected str, int or list of str, got {type(value).__name__} {value!r:.80}", unit=unit
    )
  items = value if isinstance(value, list) else [value]
  if not items:
    raise RecordError(path, line, field, "empty list of answers", unit=unit)
  out = []
  for i, a in enumerate(items):
    if isinstance(a, bool) or not isinstance(a, (str, int)):
      raise RecordError(path, line, f"{field}[{i}]", f"expected str or int, got {type(a).__name__}", unit=unit)
    out.append(str(a))
  return out
