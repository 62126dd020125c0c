"""tools: what the agent can call, and how calls and results are written (spec §1.2, §2.5, §4).

Never imports jax: this part runs in worker processes and must start fast.

Python tool
    run_python(code, timeout_s=120, **limits) -> PythonResult   one call in a fresh sandbox (bwrap / unshare)
    PythonLimits, PythonResult, PythonTool, PythonPool, resolve_isolation, SandboxUnavailableError
Search
    SearchTool(backend, topk=10)            query -> "Page i: ..." text (query cleaned as the official tool)
    SearchBackend (interface: search(query, topk) -> list[SearchHit]), SearchHit, SearchError
    ReplayBackend (official search_cache.json), CachedBackend (sqlite), RetrievalBackend (HTTP client),
    LocalIndexBackend (in-process index),
    SerperBackend, BraveBackend, BingBackend, make_search_backend(kind, ...)
    RetrievalIndex, make_server, serve_in_thread, load_corpus   the Search-R1-style retrieval server
Protocol and agent-loop interface
    parse_tool_call(text, tags) -> ToolCall | None, format_result(text, mode)
    ToolSet(tools, mode, call_limit, ...).execute/submit(call, state) -> ToolOutput, CallState
"""
from aepo_jax.tools._http import JsonClient
from aepo_jax.tools._isolation import SandboxUnavailableError, resolve_isolation
from aepo_jax.tools._protocol import (
    PYTHON_LIMIT_MESSAGE,
    REPEATED_QUERY_MESSAGE,
    SEARCH_LIMIT_MESSAGE,
    ToolCall,
    empty_output_message,
    failure_message,
    format_result,
    parse_tool_call,
)
from aepo_jax.tools._pycode import wrap_last_expression
from aepo_jax.tools._python import PythonLimits, PythonPool, PythonResult, PythonTool, run_python
from aepo_jax.tools._retrieval import (
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
from aepo_jax.tools._toolset import CallState, ToolOutput, ToolSet
from aepo_jax.tools._web import BingBackend, BraveBackend, SerperBackend, make_search_backend

__all__ = [
    "JsonClient", "SandboxUnavailableError", "resolve_isolation", "PYTHON_LIMIT_MESSAGE", "REPEATED_QUERY_MESSAGE",
    "SEARCH_LIMIT_MESSAGE", "ToolCall", "empty_output_message", "failure_message", "format_result",
    "parse_tool_call", "wrap_last_expression", "PythonLimits", "PythonPool", "PythonResult", "PythonTool",
    "run_python", "LocalIndexBackend", "RetrievalBackend", "RetrievalIndex", "load_corpus", "make_server",
    "serve_in_thread", "NO_RESULTS", "CachedBackend", "ReplayBackend", "SearchBackend", "SearchError", "SearchHit",
    "SearchTool", "clean_query", "format_hits", "parse_pages", "CallState", "ToolOutput", "ToolSet", "BingBackend",
    "BraveBackend", "SerperBackend", "make_search_backend",
]
