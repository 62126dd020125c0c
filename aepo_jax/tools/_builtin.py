"""The shipped tools, registered as any plug-in registers its own (docs/tools.md).

  python   <python>code</python>     PythonTool: a fresh sandbox per call (spec §4)
  search   <search>query</search>    SearchTool over tools.search_backend; tools.search_mode='browse': the browser
  browse   <search>query</search>    the browser (the evaluation's SDS browser, spec §2.5) whatever search_mode says
The browser is BrowseTool, or with browse.variant 'sds' / 'sds_cn' SdsBrowseTool (the official one as released).

The settings each reads are the `tools.*` keys of the training config (aepo_jax/train/_config.py), or the same keys
in a dict. Evaluation adds `search_options` (the backend's keywords as given on the command line, used as they are)
and `search_on_miss` (what a replay backend does on a query it has not stored).
"""

from __future__ import annotations

from aepo_jax.tools._registry import ToolContext, register_tool, setting

_SEARCH_SETTINGS = (
  "search_backend",
  "search_url",
  "search_corpus",
  "search_topk",
  "search_mode",
  "search_options",
  "search_on_miss",
  "browse",
)


def _python(settings, context: ToolContext):
  from aepo_jax.tools._python import PythonLimits, PythonTool

  limits = {}
  if setting(settings, "python_memory_mb") is not None:
    limits["memory_mb"] = setting(settings, "python_memory_mb")
  if setting(settings, "python_max_output") is not None:
    limits["max_output_chars"] = setting(settings, "python_max_output")
  return PythonTool(
    timeout_s=setting(settings, "python_timeout", 120.0),
    allow_unsandboxed=bool(setting(settings, "allow_unsandboxed", False)),
    limits=PythonLimits(**limits) if limits else None,
  )


def _backend(settings, context: ToolContext):
  """(backend, the corpus that stands in for a page store): settings' search_options as they are (evaluation), else
  built from search_url / search_corpus, the suite's corpus for a local backend without one (training)."""
  from aepo_jax.tools._web import make_search_backend

  kind = setting(settings, "search_backend", "local")
  corpus = setting(settings, "search_corpus") or None
  if kind == "local" and corpus is None and setting(settings, "search_options") is None:
    corpus = context.corpus_path()  # the suite's generated corpus
  raw = setting(settings, "search_options")
  if raw is not None:
    opts = dict(raw)
  else:
    opts = {"url": setting(settings, "search_url") or None}
    opts["path" if kind == "replay" else "corpus"] = corpus
  if kind == "replay":  # a query -> result cache; default ARPO's search_cache.json
    if not opts.get("path"):
      opts["path"] = context.data_path("search_cache.json")
    if setting(settings, "search_on_miss"):
      opts.setdefault("on_miss", setting(settings, "search_on_miss"))
  return make_search_backend(kind, **opts), (corpus if kind != "replay" else None)


def _browse_tool(settings, context: ToolContext, backend, corpus):
  """browse.variant: 'project' (BrowseTool, this project's prompt) or 'sds' / 'sds_cn' (SdsBrowseTool: the official
  deep-search evaluation's browser as released, English / Chinese)."""
  from aepo_jax.tools._browse import BROWSE_VARIANTS, BrowseTool, PageStore
  from aepo_jax.tools._llm import ChatClient

  b = setting(settings, "browse", {})
  pages = setting(b, "pages") or corpus
  variant = setting(b, "variant", None) or "project"
  if variant not in BROWSE_VARIANTS:
    raise ValueError(f"browse variant {variant!r} is not one of {BROWSE_VARIANTS} (--browse_variant)")
  if variant != "project":
    from aepo_jax.tools._sds import SdsBrowseTool, sds_summarizer

    return SdsBrowseTool(
      backend,
      sds_summarizer(setting(b, "summarizer_url", ""), setting(b, "summarizer_model", "")),
      pages=PageStore(pages) if pages else None,
      live=bool(setting(b, "live", False)),
      variant=variant,
    )
  return BrowseTool(
    backend,
    ChatClient(setting(b, "summarizer_url", ""), setting(b, "summarizer_model", "")),
    pages=PageStore(pages) if pages else None,
    topk=setting(settings, "search_topk", 10),
    max_pages=setting(b, "max_pages", 10),
    page_chars=setting(b, "page_chars", 5000),
    live=bool(setting(b, "live", False)),
  )


def _search(settings, context: ToolContext):
  backend, corpus = _backend(settings, context)
  if setting(settings, "search_mode", "snippets") == "browse":
    return _browse_tool(settings, context, backend, corpus)
  from aepo_jax.tools._search import SearchTool

  return SearchTool(backend, topk=setting(settings, "search_topk", 10))


def _browse(settings, context: ToolContext):
  backend, corpus = _backend(settings, context)
  return _browse_tool(settings, context, backend, corpus)


_PYTHON_SETTINGS = ("python_timeout", "python_memory_mb", "python_max_output", "allow_unsandboxed")

# Registration order is the order of the official format checks (search, then python).
register_tool("search", _search, eval_limit=10, settings=_SEARCH_SETTINGS, reward_tool=True)
register_tool("python", _python, eval_limit=5, needs_sandbox=True, settings=_PYTHON_SETTINGS, reward_tool=True)
register_tool("browse", _browse, call_tag="search", eval_limit=10, settings=_SEARCH_SETTINGS, reward_tool=True)

# The evaluation's tools (eval.build_tools): python always; search when the plan has a backend (spec §2.5).
EVALUATION_TOOLS = ("python", "search")
