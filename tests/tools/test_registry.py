"""The tool registry: the shipped tools registered like any other, specs, tags, and build_toolset's checks."""

import pytest

from aepo_jax import tools as tools_lib


@pytest.fixture
def echo():
  spec = tools_lib.register_tool(
    "echo_test", lambda settings, context: lambda content: f"{context.mode}:{content}", call_tag="echo", result_tag="r"
  )
  yield spec
  tools_lib.unregister_tool("echo_test")


def test_shipped_tools_are_registered():
  assert {"python", "search", "browse"} <= set(tools_lib.registered_tools())
  python, search, browse = (tools_lib.tool_spec(n) for n in ("python", "search", "browse"))
  assert python.needs_sandbox and not search.needs_sandbox
  assert (python.eval_limit, search.eval_limit) == (5, 10)
  assert browse.call_tag == "search" and "search_backend" in browse.settings
  assert tools_lib.call_tags(["python", "search"]) == ("python", "search")
  assert tools_lib.EVALUATION_TOOLS == ("python", "search")
  with pytest.raises(KeyError, match="no tool 'pyhton' is registered; did you mean 'python'"):
    tools_lib.tool_spec("pyhton")


def test_register_build_and_result_tag(echo):
  assert tools_lib.register_tool(echo.name, echo.factory, call_tag="echo", result_tag="r") == echo  # same: no-op
  with pytest.raises(ValueError, match="already registered"):
    tools_lib.register_tool(echo.name, lambda s, c: str, call_tag="echo")
  with pytest.raises(ValueError, match="call_tag='a b'"):
    tools_lib.register_tool("bad_tool", lambda s, c: str, call_tag="a b")
  ts = tools_lib.build_toolset([echo.name], {"call_limit": 2, "retry_count": 1}, mode="eval")
  assert ts.tags == ("echo",) and ts.result_tags == {"echo": "r"} and ts.eval_limits["echo"] == 5
  assert ts.execute(tools_lib.ToolCall("echo", "hi"), tools_lib.CallState()).text == "eval:hi"
  assert tools_lib.format_result("x", "eval", "r") == "<r>x</r>"
  assert tools_lib.build_toolset([], {}) is None
  with pytest.raises(ValueError, match="both answer <search>"):
    tools_lib.build_toolset(["search", "browse"], {"search_backend": "local", "search_corpus": "x"})


def test_eval_records_parse_registered_tags(echo):
  from aepo_jax.eval import tool_calls_from_text

  text = "<echo>a</echo><r>eval:a</r> <python>1</python><result>1</result>"
  assert tool_calls_from_text(text) == [
    {"tool": "echo", "input": "a", "result": "eval:a"},
    {"tool": "python", "input": "1", "result": "1"},
  ]


def test_agent_tags_default_to_the_toolsets(echo):
  from aepo_jax.rollout import AgentConfig
  from aepo_jax.rollout._agent_run import _tool_tags

  ts = tools_lib.build_toolset([echo.name], {})
  assert AgentConfig().tool_tags is None
  assert _tool_tags(AgentConfig(), ts) == ("echo",)
  assert _tool_tags(AgentConfig(tool_tags=("python",)), ts) == ("python",)
