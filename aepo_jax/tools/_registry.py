"""The tool registry: every tool the agent can call, by name, with how it is built and how its calls are written.

  register_tool(name, factory, *, call_tag=name, result_tag="result", eval_limit=5, ...)
  registered_tools() -> names          tool_spec(name) -> ToolSpec          call_tags(names) -> tags
  import_plugins(modules)              the modules of `tools.plugins`: each registers its tools when imported
  build_toolset(names, settings, *, mode, context) -> ToolSet   the one place a run's tools are built

A factory is `factory(settings, context) -> tool`, where `settings` is the run's tool settings (the `config.tools`
section, a dict, or any object with those attributes; `setting(settings, key, default)` reads one) and `context` a
ToolContext (mode 'train' / 'eval', the data suite's corpus when known). The tool is a callable
`tool(content) -> str | object with .text` (ToolSet's contract). The shipped tools (python, search, browse) are
registered by `aepo_jax.tools._builtin` exactly as a plug-in registers its own.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import threading
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

_MISSING = object()


def setting(settings: Any, key: str, default: Any = None) -> Any:
  """`settings[key]` of a ConfigDict, a mapping or an attribute object; `default` when it is absent or None."""
  if settings is None:
    return default
  if isinstance(settings, Mapping) or hasattr(settings, "get"):
    value = settings.get(key, _MISSING)
  else:
    value = getattr(settings, key, _MISSING)
  return default if value is _MISSING or value is None else value


@dataclasses.dataclass(frozen=True)
class ToolContext:
  """What a factory may need besides the settings. corpus: the data suite's corpus path, or a function that makes it
  (called only by a tool that needs it: generating the suite costs time). data_root: the ARPO data folder (the
  official files, e.g. search_cache.json), or a function that finds it."""

  mode: str = "train"
  corpus: Optional[str | Callable[[], str]] = None
  data_root: Optional[str | Callable[[], Any]] = None

  def corpus_path(self) -> Optional[str]:
    c = self.corpus() if callable(self.corpus) else self.corpus
    return str(c) if c else None

  def data_path(self, name: str) -> Optional[str]:
    root = self.data_root() if callable(self.data_root) else self.data_root
    return os.path.join(str(root), name) if root else None


@dataclasses.dataclass(frozen=True)
class ToolSpec:
  """A registered tool.

  name: what `tools.names` lists. factory(settings, context) -> the tool. call_tag: the model writes
  `<call_tag>content</call_tag>`; result_tag: the result comes back as `<result_tag>...</result_tag>`.
  eval_limit: calls per trajectory in evaluation (over it the model is told so and continues).
  needs_sandbox: the run checks for a sandbox (bwrap / unshare) at start-up when this tool is named.
  settings: the `tools.*` keys the tool reads (the pre-flight checks those settings only when a named tool reads
  them). reward_tool: one of the tools of the official ARPO/AEPO protocol: the deep-research reward checks the order
  of its blocks and its tool bonus needs every such tool used; the official evaluator's metrics count its calls.
  """

  name: str
  factory: Callable[[Any, ToolContext], Callable[[str], Any]]
  call_tag: str
  result_tag: str = "result"
  eval_limit: int = 5
  needs_sandbox: bool = False
  settings: tuple = ()
  reward_tool: bool = False


class ToolBuildError(ValueError):
  """A tool's factory failed: `tool` names the tool, `cause` is its exception."""

  def __init__(self, tool: str, cause: BaseException):
    super().__init__(f"tool {tool!r}: {cause}")
    self.tool, self.cause = tool, cause


_LOCK = threading.Lock()
_REGISTRY: dict[str, ToolSpec] = {}


def _check_tag(what: str, tag: str) -> None:
  if not tag or not all(ch.isalnum() or ch in "_-" for ch in tag):
    raise ValueError(f"register_tool: {what}={tag!r} must be a non-empty word (letters, digits, '_', '-').")


def register_tool(
  name: str,
  factory: Callable[[Any, ToolContext], Callable[[str], Any]],
  *,
  call_tag: Optional[str] = None,
  result_tag: str = "result",
  eval_limit: int = 5,
  needs_sandbox: bool = False,
  settings: Sequence[str] = (),
  reward_tool: bool = False,
  replace: bool = False,
) -> ToolSpec:
  """Registers a tool under `name` (see ToolSpec). Registering the same spec again does nothing; another spec under a
  registered name raises unless `replace`. Returns the spec."""
  if not callable(factory):
    raise TypeError(f"register_tool({name!r}): factory must be callable (settings, context) -> tool.")
  _check_tag("name", name)
  spec = ToolSpec(
    name=name,
    factory=factory,
    call_tag=call_tag or name,
    result_tag=result_tag,
    eval_limit=int(eval_limit),
    needs_sandbox=bool(needs_sandbox),
    settings=tuple(settings),
    reward_tool=bool(reward_tool),
  )
  _check_tag("call_tag", spec.call_tag)
  _check_tag("result_tag", spec.result_tag)
  if spec.eval_limit < 0:
    raise ValueError(f"register_tool({name!r}): eval_limit={eval_limit} must be >= 0.")
  with _LOCK:
    old = _REGISTRY.get(name)
    if old is not None and old != spec and not replace:
      raise ValueError(f"register_tool: a different tool {name!r} is already registered (replace=True to replace it).")
    _REGISTRY[name] = spec
  return spec


def unregister_tool(name: str) -> None:
  """Removes a tool (tests; a run keeps its tools)."""
  with _LOCK:
    _REGISTRY.pop(name, None)


def registered_tools() -> tuple[str, ...]:
  """Names of the registered tools, in registration order."""
  with _LOCK:
    return tuple(_REGISTRY)


def tool_spec(name: str) -> ToolSpec:
  """The spec of a registered tool; KeyError naming the registered ones (and the closest) otherwise."""
  with _LOCK:
    spec = _REGISTRY.get(name)
    known = tuple(_REGISTRY)
  if spec is None:
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise KeyError(
      f"no tool {name!r} is registered{hint} (registered: {', '.join(known)}; a plug-in's tools are registered "
      "when its module, listed in tools.plugins, is imported)"
    )
  return spec


def call_tags(names: Iterable[str], plugins: Sequence[str] = ()) -> tuple[str, ...]:
  """The call tags of the named tools, in order (the engine's stop strings are their closing tags); the modules of
  `plugins` imported first."""
  import_plugins(plugins)
  out = []
  for name in names:
    tag = tool_spec(name).call_tag
    if tag not in out:
      out.append(tag)
  return tuple(out)


def all_call_tags() -> tuple[tuple[str, str], ...]:
  """(call_tag, result_tag) of every registered tool, in registration order, without repeats."""
  with _LOCK:
    specs = list(_REGISTRY.values())
  out = []
  for s in specs:
    if (s.call_tag, s.result_tag) not in out:
      out.append((s.call_tag, s.result_tag))
  return tuple(out)


def reward_tags() -> tuple[str, ...]:
  """Call tags of the tools of the official protocol (ToolSpec.reward_tool), in registration order."""
  with _LOCK:
    specs = list(_REGISTRY.values())
  out = []
  for s in specs:
    if s.reward_tool and s.call_tag not in out:
      out.append(s.call_tag)
  return tuple(out)


def default_eval_limits() -> dict[str, int]:
  """{call_tag: ToolSpec.eval_limit} of the registered tools (the first registered for a shared tag)."""
  with _LOCK:
    specs = list(_REGISTRY.values())
  out = {}
  for s in specs:
    out.setdefault(s.call_tag, s.eval_limit)
  return out


def settings_read(names: Iterable[str]) -> frozenset:
  """The `tools.*` settings the named tools read."""
  return frozenset(k for name in names for k in tool_spec(name).settings)


def needs_sandbox(names: Iterable[str], plugins: Sequence[str] = ()) -> bool:
  """Whether one of the named tools runs code in a sandbox (plug-ins imported first)."""
  import_plugins(plugins)
  return any(tool_spec(name).needs_sandbox for name in names)


def import_plugins(modules: Sequence[str] | str = ()) -> None:
  """Imports each module named in `modules` (a sequence, or one comma-separated string); importing a plug-in
  registers its tools. An import that fails raises ImportError naming the module and the setting."""
  if isinstance(modules, str):
    modules = [m for m in modules.split(",")]
  for module in modules or ():
    module = str(module).strip()
    if not module:
      continue
    try:
      importlib.import_module(module)
    except ImportError as e:
      raise ImportError(
        f"tools.plugins has {module!r}, which cannot be imported ({e}); put its folder on PYTHONPATH or fix the name."
      ) from e
