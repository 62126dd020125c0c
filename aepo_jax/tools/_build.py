"""`build_toolset`: a run's ToolSet from tool names and settings, each tool built by its registered factory."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

from aepo_jax.tools._registry import ToolBuildError, ToolContext, import_plugins, setting, tool_spec
from aepo_jax.tools._toolset import ToolSet


def build_toolset(
  names: Sequence[str],
  settings: Any = None,
  *,
  mode: str = "train",
  context: Optional[ToolContext] = None,
  plugins: Sequence[str] = (),
  eval_limits: Optional[Mapping[str, int]] = None,
  timeout_s: Optional[float] = None,
):
  """The ToolSet of the named tools, each built by its factory from `settings`; None when `names` is empty.

  ToolSet keywords come from `settings` too: call_limit (3), retry_count (official 3), max_workers (64) and the
  per-call bound `timeout_s` (python_timeout + 30 s, python_timeout's default 120 s). eval_limits: per call tag,
  over each tool's `eval_limit`. Training (`train._wiring.make_toolset`) and evaluation (`eval.build_tools`) both
  come here; where their values differ (search_topk, replay misses, Python limits), the caller's settings say which
  (docs/tools.md, "Building a run's tools")."""
  import_plugins(plugins)
  names = list(dict.fromkeys(names))  # a name listed twice is one tool
  if not names:
    return None
  context = context or ToolContext(mode=mode)
  if context.mode != mode:
    context = dataclasses.replace(context, mode=mode)
  specs = [tool_spec(n) for n in names]
  owner = {}
  for spec in specs:  # before any tool is built
    if spec.call_tag in owner:
      raise ValueError(
        f"tools {owner[spec.call_tag]!r} and {spec.name!r} both answer <{spec.call_tag}>; name one of them."
      )
    owner[spec.call_tag] = spec.name
  tools, result_tags, limits = {}, {}, {}
  for spec in specs:
    try:
      tools[spec.call_tag] = spec.factory(settings, context)
    except (TypeError, ValueError, FileNotFoundError, KeyError) as e:
      raise ToolBuildError(spec.name, e) from e
    result_tags[spec.call_tag] = spec.result_tag
    limits[spec.call_tag] = spec.eval_limit
  limits.update(eval_limits or {})
  if timeout_s is None:
    timeout_s = float(setting(settings, "python_timeout", 120.0)) + 30.0
  kwargs = {
    "call_limit": setting(settings, "call_limit", 3),
    "retry_count": setting(settings, "retry_count", 3),
    "max_workers": setting(settings, "max_workers", 64),
  }
  return ToolSet(tools, mode=mode, eval_limits=limits, timeout_s=timeout_s, result_tags=result_tags, **kwargs)
