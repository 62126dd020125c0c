"""End to end on SmolLM2-135M-Instruct, offline: math and QA sets through the CLI with the python tool live and
the search tool on the cache replay; every answer scored by its family's scorer. Low accuracy is expected (the
untuned model does not follow the tool protocol, docs/environment.md); the point is that it runs and is scored."""

import json
import os

import pytest

from aepo_jax.eval import EvalSettings, build_tools, check_inputs, read_records
from aepo_jax.tools import ToolCall

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_smollm2_math_and_qa_offline(tmp_path):
  import importlib.util

  spec = importlib.util.spec_from_file_location("evaluate_cli", os.path.join(ROOT, "launch", "evaluate.py"))
  cli = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(cli)

  # The python tool of this configuration really runs code (sandboxed), and search replays the ARPO cache.
  plan = check_inputs("smollm2-135m-instruct", "gsm8k,math500,bamboogle", search_backend="replay")
  tools = build_tools(plan, EvalSettings())
  try:
    assert tools.execute(ToolCall("python", "import math\nmath.factorial(5)"), _state()).text.strip() == "120"
    assert tools.execute(ToolCall("search", "no such query in the cache"), _state()).text == "No search results found."
  finally:
    tools.shutdown()

  out = str(tmp_path / "smol")
  rc = cli.main(
    [
      "--checkpoint=smollm2-135m-instruct",
      "--benchmarks=gsm8k,math500,bamboogle",
      "--limit=2",
      "--n=1",
      "--k=1",
      "--search_backend=replay",
      "--max_prompt_len=512",
      "--max_response_len=64",
      "--batch_size=2",
      f"--output={out}",
      "--noprogress",
    ]
  )
  assert rc == 0
  summary = json.load(open(os.path.join(out, "summary.json")))
  assert set(summary["benchmarks"]) == {"gsm8k", "math500", "bamboogle"}
  assert summary["source"].startswith("pretrained smollm2-135m-instruct")
  # the CLI's default protocol is the official evaluator's: math by its math_equal, QA without a judge by token F1
  assert summary["protocol"] == "official"
  for bench, scorers in (("gsm8k", {"math_equal"}), ("math500", {"math_equal"}), ("bamboogle", {"f1"})):
    recs = read_records(os.path.join(out, f"{bench}.jsonl"))
    assert [(r["sample"]) for r in recs] == [0, 0] and len({r["id"] for r in recs}) == 2
    for r in recs:
      assert r["response"] and 0 < r["response_len"] <= 64 and r["stop_reason"] in ("eos", "length")
      assert r["protocol"] == "official" and r["scorer"] in scorers and 0.0 <= r["score"] <= 1.0
      if bench == "bamboogle":
        assert r["f1"] is not None and 0.0 <= r["f1"] <= 1.0
    b = summary["benchmarks"][bench]
    assert b["num_answers"] == 2 and 0.0 <= b["pass@1"] <= 1.0
  assert os.path.exists(os.path.join(out, "summary.md"))


def _state():
  from aepo_jax.tools import CallState

  return CallState()
