"""tools: what the agent can call, and how calls and results are written (spec §1.2, §2.5, §4).

Never imports jax: this part runs in worker processes and must start fast.

Python tool
    run_python(code, timeout_s=120, **limits) -> PythonResult   one call in a fresh sandbox (bwrap / unshare)
    check_sandbox(allow_unsandboxed=False) -> 'bwrap' | 'unshare' | 'none'   start-up check; raises naming the fix
    PythonLimits, PythonResult, PythonTool, PythonPool, resolve_isolation, SandboxUnavailableError
Search
    SearchTool(backend, topk=10)            query -> "Page i: ..." text (query cleaned as the official tool)
    SearchBackend (interface: search(query, topk) -> list[SearchHit]), SearchHit, SearchError
    ReplayBackend (official search_cache.json), CachedBackend (sqlite), RetrievalBackend (HTTP client),
    LocalIndexBackend (in-process index),
    SerperBackend, BraveBackend, BingBackend, make_search_backend(kind, ...)
    RetrievalIndex, make_server, serve_in_thread, load_corpus   the Search-R1-style retrieval server
Browse (the evaluation's SDS search: fetch the hits' pages, an LLM summarises them; SEARCH_MODES)
    BrowseTool(backend, summarizer, pages=PageStore(dir_or_corpus), max_pages, page_chars, live)
    PageStore, fetch_page, html_to_text, ChatClient(base_url, model) (any OpenAI-compatible server), ChatError
    SdsBrowseTool(backend, sds_summarizer(url, model), pages, live, variant='sds'|'sds_cn')   the official SDS
        browser as released (BROWSE_VARIANTS); its parts: summary_prompt, truncated_prev_reasoning,
        final_information, snippet_window, visible_text, pdf_text, fetch_page_text
HTTP
    http_request(method, url, data=, headers=, timeout_s=) -> (status, body)   one deadline for the whole call
    JsonClient(timeout_s, retries, backoff_s, max_concurrency)                  JSON with retries, on top of it
Registry and plug-ins (docs/tools.md)
    register_tool(name, factory, *, call_tag=name, result_tag='result', eval_limit=5, needs_sandbox, settings,
                  reward_tool) -> ToolSpec;  factory(settings, ToolContext(mode, corpus, data_root)) -> tool
    registered_tools(), tool_spec(name), call_tags(names), reward_tags(), settings_read(names), needs_sandbox(names),
    import_plugins(modules), setting(settings, key, default), EVALUATION_TOOLS (eval.build_tools' own)
    build_toolset(names, settings, *, mode, context, plugins, eval_limits) -> ToolSet   training's and evaluation's
Protocol and agent-loop interface
    parse_tool_call(text, tags) -> ToolCall | None, format_result(text, mode)
    ToolSet(tools, mode, call_limit, ...).execute/submit(call, state, trajectory=None) -> ToolOutput, CallState
    trajectory_steps(tokens, mask, decode) -> the steps given to a tool that wants them (ToolSet.wants_trajectory)
"""

from aepo_jax.tools._browse import BROWSE_VARIANTS, SEARCH_MODES, BrowseTool, PageStore, fetch_page, html_to_text
from aepo_jax.tools._http import JsonClient, http_request
from aepo_jax.tools._isolation import SandboxUnavailableError, check_sandbox, resolve_isolation
from aepo_jax.tools._llm import ChatClient, ChatError
from aepo_jax.tools._protocol import (
  PYTHON_LIMIT_MESSAGE,
  REPEATED_QUERY_MESSAGE,
  SEARCH_LIMIT_MESSAGE,
  ToolCall,
  empty_output_message,
  failure_message,
  format_result,
  parse_tool_call,
  trajectory_steps,
)
from aepo_jax.tools._pycode import wrap_last_expression
from aepo_jax.tools._build import build_toolset
from aepo_jax.tools._registry import (
  ToolBuildError,
  ToolContext,
  ToolSpec,
  all_call_tags,
  call_tags,
  default_eval_limits,
  import_plugins,
  needs_sandbox,
  register_tool,
  registered_tools,
  reward_tags,
  setting,
  settings_read,
  tool_spec,
  unregister_tool,
)
from aepo_jax.tools._python import PythonLimits, PythonPool, PythonResult, PythonTool, run_python
from aepo_jax.tools._retrieval import (
  MAX_BODY_BYTES,
  MAX_QUERIES,
  LocalIndexBackend,
  RetrievalBackend,
  RetrievalIndex,
  load_corpus,
  make_server,
  serve_in_thread,
)
from aepo_jax.tools._search import (
  NO_RESULTS,
  CachedBackend,
  ReplayBackend,
  SearchBackend,
  SearchError,
  SearchHit,
  SearchTool,
  clean_query,
  format_hits,
  parse_pages,
)
from aepo_jax.tools._sds import (
  SdsBrowseTool,
  final_information,
  sds_summarizer,
  snippet_window,
  summary_prompt,
  truncated_prev_reasoning,
)
from aepo_jax.tools._sds_pages import fetch_page_text, pdf_text, visible_text
from aepo_jax.tools._toolset import CallState, ToolOutput, ToolSet
from aepo_jax.tools._web import BingBackend, BraveBackend, SerperBackend, make_search_backend
from aepo_jax.tools._builtin import EVALUATION_TOOLS  # registers python, search and browse

__all__ = [
  "BROWSE_VARIANTS",
  "SEARCH_MODES",
  "BrowseTool",
  "PageStore",
  "fetch_page",
  "html_to_text",
  "ChatClient",
  "ChatError",
  "JsonClient",
  "http_request",
  "SandboxUnavailableError",
  "check_sandbox",
  "resolve_isolation",
  "PYTHON_LIMIT_MESSAGE",
  "REPEATED_QUERY_MESSAGE",
  "SEARCH_LIMIT_MESSAGE",
  "ToolCall",
  "empty_output_message",
  "failure_message",
  "format_result",
  "parse_tool_call",
  "trajectory_steps",
  "SdsBrowseTool",
  "fetch_page_text",
  "final_information",
  "pdf_text",
  "sds_summarizer",
  "snippet_window",
  "summary_prompt",
  "truncated_prev_reasoning",
  "visible_text",
  "wrap_last_expression",
  "EVALUATION_TOOLS",
  "ToolBuildError",
  "ToolContext",
  "ToolSpec",
  "all_call_tags",
  "build_toolset",
  "call_tags",
  "default_eval_limits",
  "import_plugins",
  "needs_sandbox",
  "register_tool",
  "registered_tools",
  "reward_tags",
  "setting",
  "settings_read",
  "tool_spec",
  "unregister_tool",
  "PythonLimits",
  "PythonPool",
  "PythonResult",
  "PythonTool",
  "run_python",
  "LocalIndexBackend",
  "MAX_BODY_BYTES",
  "MAX_QUERIES",
  "RetrievalBackend",
  "RetrievalIndex",
  "load_corpus",
  "make_server",
  "serve_in_thread",
  "NO_RESULTS",
  "CachedBackend",
  "ReplayBackend",
  "SearchBackend",
  "SearchError",
  "SearchHit",
  "SearchTool",
  "clean_query",
  "format_hits",
  "parse_pages",
  "CallState",
  "ToolOutput",
  "ToolSet",
  "BingBackend",
  "BraveBackend",
  "SerperBackend",
  "make_search_backend",
]
