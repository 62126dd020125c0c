"""Evaluating a served policy: the scripted tiny policies behind this project's OpenAI-compatible `Server` on a
loopback port, evaluated through `RemoteRollouts` and directly (the engine in process), give the same per-example
records (response, tool calls, stop reason, lengths, score); the launcher's --policy_url path; one clear error when
nothing listens."""

import dataclasses
import importlib.util
import json
import os

import pytest

from aepo_jax.eval import (
  EvalInputError,
  Evaluator,
  Policy,
  PolicyServerError,
  RemoteRollouts,
  Scorer,
  check_inputs,
  probe_policy_server,
  read_records,
)
from aepo_jax.tools import PYTHON_LIMIT_MESSAGE, ToolSet

from eval_helpers import SETTINGS, free_port, short_examples

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAME = ("id", "sample", "response", "tool_calls", "stop_reason", "num_tool_calls", "prompt_len", "response_len")
SAME += ("extracted", "correct", "score")


@pytest.fixture(scope="module")
def served(tiny_config, scripted, tokenizer):
  """`served(name)`: a started Server of scripted policy `name` ('answer' | 'loop') on a free loopback port."""
  from aepo_jax.serve import Server

  servers = {}

  def get(name):
    if name not in servers:
      servers[name] = Server(
        tiny_config,
        scripted[name],
        tokenizer,
        model_name=f"scripted-{name}",
        max_slots=4,
        max_len=SETTINGS.max_prompt_len + SETTINGS.max_response_len,
        port=0,
        steps_per_call=8,
      ).start()
    return servers[name]

  yield get
  for srv in servers.values():
    srv.shutdown(1.0)


class _Python:
  """The scripted policies' python tool: answers 42, recording each call's code and, as a tool that reads the
  trajectory (the SDS browser does), the steps the loop gave it."""

  wants_trajectory = True

  def __init__(self, calls, steps):
    self.calls, self.steps = calls, steps

  def __call__(self, code, trajectory=None):
    self.calls.append(code)
    self.steps.append(trajectory)
    return "42"


def _tools(calls, steps=None):
  return ToolSet({"python": _Python(calls, [] if steps is None else steps)}, mode="eval", retry_count=1)


def _both(tiny_config, params, tokenizer, srv, examples, settings=SETTINGS, steps=(None, None)):
  """(local records, remote records, local tool calls, remote tool calls, remote rollouts) of one evaluation;
  `steps`: two lists that receive the trajectories the local and the remote loop gave the tool."""
  local_calls, remote_calls = [], []
  local = Evaluator(
    Policy(tiny_config, params, tokenizer, "scripted"),
    _tools(local_calls, steps[0]),
    Scorer(),
    settings,
    show_progress=False,
  ).run("toy", examples)
  tools = _tools(remote_calls, steps[1])
  rollouts = RemoteRollouts(srv.url + "/v1", srv.model_name, tokenizer, tools, settings.rollout_settings())
  policy = Policy(None, None, tokenizer, rollouts.source)
  remote = Evaluator(policy, tools, Scorer(), settings, show_progress=False, rollouts=rollouts).run("toy", examples)
  return local, remote, local_calls, remote_calls, rollouts


def _same(local, remote):
  assert len(local) == len(remote)
  for a, b in zip(local, remote):
    assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}


def test_a_tool_call_then_the_answer_gives_the_records_of_the_local_engine(tiny_config, scripted, tokenizer, served):
  local_steps, remote_steps = [], []
  local, remote, local_calls, remote_calls, rollouts = _both(
    tiny_config, scripted["answer"], tokenizer, served("answer"), short_examples(3), steps=(local_steps, remote_steps)
  )
  _same(local, remote)
  for r in remote:
    assert r["response"].startswith("<python>1</python><result>42</result><answer>\\boxed{18}</answer>")
    assert (r["stop_reason"], r["num_tool_calls"], r["score"]) == ("eos", 1, 1.0)
  assert local_calls == remote_calls == ["1"] * 6
  assert local_steps == remote_steps == [["<python>1</python>"]] * 6  # the official log so far: the model's turn
  prompt = tokenizer.apply_chat_template([{"role": "user", "content": "q"}])
  traj = rollouts(None, [prompt, prompt])
  assert traj.stats["rollout/remote_token_ids"] == 1.0 and traj.stats["rollout/remote_requests"] == 4
  assert traj.loss_mask_bt[0, len(prompt) :].tolist()[:8] == [1, 1, 1, 0, 0, 0, 1, 1]  # the tool result: 0


class _TextOnly(RemoteRollouts):
  """A server that answers without token ids (SGLang, older vLLM): the text is read back."""

  def _post(self, body):
    choice = super()._post(body)
    choice.pop("token_ids", None)
    return choice


def test_a_server_without_token_ids_is_read_from_its_text(tiny_config, scripted, tokenizer, served, caplog):
  srv, examples = served("answer"), short_examples(2)
  local = Evaluator(
    Policy(tiny_config, scripted["answer"], tokenizer, "scripted"), _tools([]), Scorer(), SETTINGS, show_progress=False
  ).run("toy", examples)
  tools = _tools([])
  rollouts = _TextOnly(srv.url + "/v1", srv.model_name, tokenizer, tools, SETTINGS.rollout_settings())
  policy = Policy(None, None, tokenizer, rollouts.source)
  remote = Evaluator(policy, tools, Scorer(), SETTINGS, show_progress=False, rollouts=rollouts).run("toy", examples)
  _same(local, remote)  # these tags are single tokens: the text encodes back to the sampled ids
  assert "without token_ids" in caplog.text


def test_calls_beyond_the_python_limit_are_refused_the_same_way(tiny_config, scripted, tokenizer, served):
  local, remote, local_calls, remote_calls, rollouts = _both(
    tiny_config, scripted["loop"], tokenizer, served("loop"), short_examples(1)
  )
  _same(local, remote)
  results = [c["result"] for c in remote[0]["tool_calls"]]
  assert results[:5] == ["42"] * 5 and set(results[5:]) == {PYTHON_LIMIT_MESSAGE}
  assert remote[0]["stop_reason"] == "length" and remote[0]["response_len"] == SETTINGS.max_response_len
  assert len(local_calls) == len(remote_calls) == 2 * 5


def test_the_call_cap_and_its_continuation_match(tiny_config, scripted, tokenizer, served):
  """max_tokens_per_call=2 cuts `<python>1</python>` after `<python>1`: 'call_tokens' with one call per turn; with
  two, the turn is continued and the call completes (the official engine's continuation)."""
  srv = served("answer")
  for calls_per_turn, reason in ((1, "call_tokens"), (2, "eos")):
    settings = dataclasses.replace(SETTINGS, n=1, max_tokens_per_call=2, max_calls_per_turn=calls_per_turn)
    local, remote, *_ = _both(tiny_config, scripted["answer"], tokenizer, srv, short_examples(1), settings)
    _same(local, remote)
    assert remote[0]["stop_reason"] == reason


def test_a_served_answer_past_the_sample_timeout_ends_as_the_local_one(tiny_config, scripted, tokenizer, served):
  """sample_timeout_s against a served policy: a hanging tool ends the answer ('timeout', the official record) as
  on the local engine, and the evaluation returns while the call still blocks."""
  import threading

  release, running = threading.Event(), []

  def hangs(code):
    running.append(code)
    release.wait(300)
    return "42"

  settings = dataclasses.replace(SETTINGS, n=1, sample_timeout_s=1.0)
  tools = ToolSet({"python": hangs}, mode="eval", retry_count=1)
  srv = served("answer")
  rollouts = RemoteRollouts(srv.url + "/v1", srv.model_name, tokenizer, tools, settings.rollout_settings())
  policy = Policy(None, None, tokenizer, rollouts.source)
  try:
    recs = Evaluator(policy, tools, Scorer(), settings, show_progress=False, rollouts=rollouts).run(
      "toy", short_examples(2)
    )
    assert running and not release.is_set()
  finally:
    release.set()
  for r in recs:
    assert r["stop_reason"] == "timeout" and r["response"].endswith("\n[Timeout (exceeding 1s)]")
    assert r["response"].startswith("<python>1</python>") and r["score"] == 0.0 and r["extracted"] == "Timeout"


def test_launcher_evaluates_a_served_policy(served, tok_dir, tmp_path, capsys):
  srv = served("answer")
  data = tmp_path / "mine.jsonl"
  data.write_text(
    "".join(json.dumps({"question": f"What is {i} plus {18 - i}?", "answer": "18"}) + "\n" for i in range(2))
  )
  spec = importlib.util.spec_from_file_location("evaluate_cli_remote", os.path.join(ROOT, "launch", "evaluate.py"))
  cli = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(cli)
  out = str(tmp_path / "out")
  argv = [
    f"--policy_url={srv.url}/v1",
    f"--policy_model={srv.model_name}",
    f"--tokenizer={tok_dir}",
    f"--benchmarks={data}",
    "--protocol=project",
    "--data_family=math",
    "--n=1",
    "--k=1",
    "--temperature=0",
    f"--max_prompt_len={SETTINGS.max_prompt_len}",
    f"--max_response_len={SETTINGS.max_response_len}",
    "--batch_size=2",
    "--template=compact",
    "--allow_unsandboxed",
    "--noprogress",
    f"--output={out}",
  ]
  assert cli.main(argv) == 0, capsys.readouterr().err
  recs = read_records(os.path.join(out, "mine.jsonl"))
  assert [(r["stop_reason"], r["num_tool_calls"], r["score"]) for r in recs] == [("eos", 1, 1.0)] * 2
  assert recs[0]["tool_calls"][0]["input"] == "1"
  summary = json.load(open(os.path.join(out, "summary.json")))
  assert (summary["policy_url"], summary["policy_model"]) == (f"{srv.url}/v1", srv.model_name)
  run = json.load(open(os.path.join(out, "run.json")))
  assert run["checkpoint"] is None and run["policy_model"] == srv.model_name
  assert cli.main(argv + ["--checkpoint=/some/ckpt"]) == 2
  assert "not both" in capsys.readouterr().err


def test_nothing_listening_is_one_clear_error(tokenizer, tmp_path, capsys):
  url = f"http://127.0.0.1:{free_port()}/v1"
  tools = _tools([])
  rollouts = RemoteRollouts(url, "m", tokenizer, tools, SETTINGS.rollout_settings(), retries=1, backoff_s=0.01)
  prompt = tokenizer.apply_chat_template([{"role": "user", "content": "q"}])
  with pytest.raises(PolicyServerError, match=r"127\.0\.0\.1:\d+/v1 failed 2 attempts.*launch/serve\.py") as e:
    rollouts(None, [prompt])
  assert "\n" not in str(e.value)
  with pytest.raises(PolicyServerError, match=r"did not answer GET .*/v1/models.*--policy_url"):
    probe_policy_server(url, "m")
  with pytest.raises(EvalInputError, match="did not answer"):  # the launcher's check, before any compute
    check_inputs(None, "gsm8k", policy_url=url, policy_model="m", tokenizer="tok")
  with pytest.raises(EvalInputError, match="--policy_model"):
    check_inputs(None, "gsm8k", policy_url=url, tokenizer="tok")
  with pytest.raises(EvalInputError, match="--tokenizer"):
    check_inputs(None, "gsm8k", policy_url=url, policy_model="m")


def test_the_api_key_and_the_model_name_are_checked_up_front(tiny_config, scripted, tokenizer):
  from aepo_jax.serve import Server

  srv = Server(tiny_config, scripted["answer"], tokenizer, model_name="m", max_slots=1, max_len=64, port=0, api_key="k")
  srv.start()
  try:
    url = srv.url + "/v1"
    probe_policy_server(url, "m", api_key="k")
    with pytest.raises(PolicyServerError, match="refused the API key .*AEPO_JAX_POLICY_API_KEY"):
      probe_policy_server(url, "m", api_key="wrong")
    with pytest.raises(PolicyServerError, match=r"serves \['m'\], not 'other'; fix --policy_model"):
      probe_policy_server(url, "other", api_key="k")
  finally:
    srv.shutdown(1.0)
