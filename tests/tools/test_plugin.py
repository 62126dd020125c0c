"""A tool defined outside the package (a `<calc>` plug-in module in a temporary folder) used by name from a config:
registered by `tools.plugins`, checked by the pre-flight, built for training and evaluation, and called by the agent
in a tiny main job (RL step and its in-training evaluation) and in a standalone evaluation, without touching the
package.

The model is a tiny Hugging Face Llama whose weights make it write one token, `<calc>6*7</calc>` (added to the tiny
tokenizer), whatever the context: its embeddings share one large coordinate, the blocks add nothing, and the LM head
reads that coordinate for that token only. So every generation call is a calc call, through the real engine, agent
loop, ToolSet and trainer.
"""

import json
import os
import sys
import textwrap

import pytest

from aepo_jax import tools as tools_lib

MODULE = "aepo_test_calc_plugin"
CALL = "<calc>6*7</calc>"
LIMIT = "The maximum calc call limit is exceeded. You are not allowed to use calc."
PLUGIN = textwrap.dedent(
  '''
  """A calculator tool: <calc>expression</calc> -> its value."""
  import ast
  import operator

  from aepo_jax.tools import register_tool

  CALLS = []  # (mode, content) of every call, for the test
  _OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


  def _value(node):
    if isinstance(node, ast.Expression):
      return _value(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
      return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      return _OPS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError("not arithmetic")


  def make_calc(settings, context):
    def calc(content):
      CALLS.append((context.mode, content))
      return str(_value(ast.parse(content, mode="eval")))

    return calc


  register_tool("calc", make_calc, eval_limit=2)
  '''
)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
  """The plug-in module on sys.path (not imported: the config's tools.plugins imports it); unregistered after."""
  (tmp_path / f"{MODULE}.py").write_text(PLUGIN)
  monkeypatch.syspath_prepend(str(tmp_path))
  yield MODULE
  tools_lib.unregister_tool("calc")
  sys.modules.pop(MODULE, None)


def _config(**overrides):
  from aepo_jax.train import base_config

  c = base_config()
  c.tools.names = ("calc",)
  c.tools.plugins = (MODULE,)
  for k, v in overrides.items():
    c.tools[k] = v
  return c


def _tool_problems(config):
  from aepo_jax.train._preflight import checklist

  return dict((part, problems) for part, _, problems in checklist(config))["tools"]


def test_plugin_tool_from_config(plugin):
  from aepo_jax.train import _wiring

  config = _config()
  assert "calc" not in tools_lib.registered_tools()  # the package knows nothing of it
  assert _tool_problems(config) == []  # the pre-flight imports the plug-in and finds the tool
  tools = _wiring.make_toolset(config)
  assert tools.tags == ("calc",) and _wiring.tool_tags(config) == ("calc",)
  out = tools.execute(tools_lib.ToolCall("calc", "6*7"), tools_lib.CallState())
  assert out.ok and out.text == "42" and tools.metrics()["tools/calc_calls"] == 1
  assert not tools_lib.needs_sandbox(config.tools.names)
  eval_tools = _wiring.make_toolset(config, mode="eval")
  state = tools_lib.CallState()
  texts = [eval_tools.execute(tools_lib.ToolCall("calc", "1+1"), state).text for _ in range(3)]
  assert texts == ["2", "2", LIMIT]  # the plug-in's eval_limit: 2


def test_preflight_names_unknown_tools_and_missing_plugins(plugin):
  [unknown] = _tool_problems(_config(plugins=()))  # the plug-in not named: calc is not registered
  assert "tools.names has 'calc', which is not a registered tool" in unknown and "tools.plugins" in unknown
  [typo] = _tool_problems(_config(names=("clac",)))
  assert "tools.names has 'clac'" in typo and "did you mean 'calc'?" in typo
  problems = _tool_problems(_config(plugins=("no_such_plugin_module",)))
  assert any("tools.plugins has 'no_such_plugin_module', which cannot be imported" in m for m in problems)


def test_evaluation_builds_plugin_tools(plugin, tmp_path):
  from aepo_jax.eval import EvalInputError, EvalPlan, EvalSettings, build_tools

  plan = EvalPlan(checkpoint=None, benchmarks=[], search_backend="none", tools=("calc",), tool_plugins=(MODULE,))
  tools = build_tools(plan, EvalSettings())
  assert tools.tags == ("python", "calc") and tools.mode == "eval"
  assert tools.eval_limits["python"] == 5 and tools.eval_limits["calc"] == 2
  with pytest.raises(EvalInputError, match="no tool 'clac' is registered; did you mean 'calc'"):
    build_tools(EvalPlan(checkpoint=None, benchmarks=[], tools=("clac",)), EvalSettings())


# ------------------------------------------------------------------------------------------------ the real model
def _calc_model(path):
  """A tiny HF Llama (and its tokenizer, with the added token CALL) that writes CALL at every position."""
  import torch
  from tokenizers import Tokenizer

  from aepo_jax.testing import tiny_hf_model, tiny_tokenizer

  tiny_tokenizer(path)
  tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
  tok.add_tokens([CALL])
  tok.save(os.path.join(path, "tokenizer.json"))
  call_id = tok.token_to_id(CALL)
  model = tiny_hf_model("llama", max_position_embeddings=4096)
  with torch.no_grad():
    params = dict(model.named_parameters())
    params["model.embed_tokens.weight"][:, 0] = 20.0  # one large coordinate shared by every token
    for name, p in params.items():
      if name.endswith(("o_proj.weight", "down_proj.weight")):
        p.zero_()  # the blocks add nothing to the residual stream
    params["model.norm.weight"].zero_()
    params["model.norm.weight"][0] = 1.0
    params["lm_head.weight"].zero_()
    params["lm_head.weight"][call_id, 0] = 5.0  # logit ~40 for CALL, 0 for every other token
  model.save_pretrained(path)
  return str(path)


@pytest.fixture(scope="module")
def calc_model(tmp_path_factory):
  return _calc_model(tmp_path_factory.mktemp("calc_model"))


@pytest.mark.slow
def test_main_job_calls_the_plugin_tool(plugin, calc_model, tmp_path):
  """(a) The main job (`train.run`): the RL step's rollouts and the in-training evaluation call calc."""
  import ml_collections

  from aepo_jax.train import load_config, read_metrics, run

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  overrides = {
    "workdir": str(tmp_path / "run"),
    "mode": "rl",
    "sft.enabled": False,
    "train.steps": 1,
    "model.name": calc_model,
    "model.init": "pretrained",
    "model.tokenizer": calc_model,
    "tools.names": ("calc",),
    "tools.plugins": (MODULE,),
    "data.val": ("suite",),
    "eval.num_prompts": 1,
    "eval.after_rl": False,
  }
  config = load_config(os.path.join(root, "configs", "testing", "tiny_rl.py"), overrides=overrides, num_devices=None)
  with config.unlocked():
    config.model.overrides = ml_collections.ConfigDict()  # the checkpoint's own shape
  summary = run(config)
  assert summary["rl/steps"] == 1
  calls = sys.modules[MODULE].CALLS
  assert ("train", "6*7") in calls
  records = read_metrics(config.workdir)
  assert any(r.get("tools/calc_calls", 0) > 0 for r in records)  # the RL step's rollouts
  assert any(r.get("eval/tools/calc_calls", 0) > 0 for r in records)  # the in-training evaluation


@pytest.mark.slow
def test_evaluation_calls_the_plugin_tool(plugin, calc_model, tmp_path):
  """(b) The standalone evaluation (`eval.run_evaluation`, as launch/evaluate.py runs it) calls calc."""
  from aepo_jax.eval import EvalSettings, check_inputs, read_records, run_evaluation

  data = tmp_path / "calc.jsonl"
  data.write_text(json.dumps({"question": "What is 6*7?", "answer": "42"}) + "\n")
  plan = check_inputs(
    calc_model,
    str(data),
    search_backend="none",
    tokenizer=calc_model,
    data_options={"family": "math"},
    tools=("calc",),
    tool_plugins=(MODULE,),
  )
  settings = EvalSettings(n=1, batch_size=1, max_prompt_len=512, max_response_len=160, template="compact")
  run_evaluation(plan, str(tmp_path / "out"), settings=settings, ks=(1,), show_progress=False)
  [record] = read_records(str(tmp_path / "out" / "calc.jsonl"))
  calls = record["tool_calls"]
  assert [c["tool"] for c in calls[:3]] == ["calc"] * 3
  assert [c["result"] for c in calls[:3]] == ["42", "42", LIMIT]  # eval_limit 2
  assert ("eval", "6*7") in sys.modules[MODULE].CALLS
