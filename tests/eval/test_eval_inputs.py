"""Bad input fails before any compute, with a message that names the input and the fix."""

import http.server
import importlib.util
import json
import os
import threading
import time

import pytest

from aepo_jax.eval import EvalInputError, check_inputs, resolve_checkpoint
from aepo_jax import checkpoint as checkpoint_lib

from eval_helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch():
  spec = importlib.util.spec_from_file_location("evaluate_cli", os.path.join(ROOT, "launch", "evaluate.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.fixture()
def no_compute(monkeypatch):
  """Any attempt to load weights fails the test."""

  def forbidden(*a, **k):
    raise AssertionError("weights were loaded although the input is bad")

  monkeypatch.setattr(checkpoint_lib, "load_policy", forbidden)
  monkeypatch.setattr("aepo_jax.model.load_hf", forbidden)
  monkeypatch.setattr("aepo_jax.model.load_pretrained", forbidden)


class _Judge(http.server.BaseHTTPRequestHandler):
  mode = "ok"

  def do_POST(self):
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    if self.mode == "500":
      self.send_response(500)
      self.end_headers()
      return
    assert body["messages"][0]["role"] == "user"
    out = json.dumps({"choices": [{"message": {"content": "Correct"}}]}).encode()
    self.send_response(200)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(out)))
    self.end_headers()
    self.wfile.write(out)

  def log_message(self, *a):
    pass


@pytest.fixture()
def judge_server():
  servers = []

  def start(mode):
    handler = type("H", (_Judge,), {"mode": mode})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    servers.append(srv)
    return f"http://127.0.0.1:{srv.server_address[1]}/v1"

  yield start
  for s in servers:
    s.shutdown()
    s.server_close()


def test_unknown_benchmark_is_reported_first(no_compute):
  with pytest.raises(EvalInputError) as e:
    check_inputs("/does/not/exist", "gsm8k,aime2024")
  assert "'aime2024'" in str(e.value) and "aime24" in str(e.value)


def test_missing_checkpoint(no_compute, tmp_path):
  with pytest.raises(EvalInputError, match="does not exist") as e:
    check_inputs(str(tmp_path / "nope"), "gsm8k")
  assert "Orbax" in str(e.value) and "smollm2-135m-instruct" in str(e.value)
  (tmp_path / "empty").mkdir()
  with pytest.raises(EvalInputError, match="neither config.json"):
    check_inputs(str(tmp_path / "empty"), "gsm8k")


def test_checkpoint_kinds_resolved_without_reading_weights(no_compute, orbax_ckpt):
  ref = resolve_checkpoint(orbax_ckpt)
  assert ref.kind == "orbax" and ref.directory.endswith("checkpoints/rl") and ref.step is None
  step = resolve_checkpoint(os.path.join(orbax_ckpt, "checkpoints", "rl", "3"))
  assert (step.kind, step.step) == ("orbax", 3)
  assert resolve_checkpoint("smollm2-135m-instruct").kind == "pretrained"


def test_deep_search_needs_search_and_judge(no_compute, orbax_ckpt):
  with pytest.raises(EvalInputError, match="need a search backend"):
    check_inputs(orbax_ckpt, "gaia", judge_url="http://127.0.0.1:1/v1", judge_model="m")
  with pytest.raises(EvalInputError, match="--judge_url="):
    check_inputs(orbax_ckpt, "webwalker", search_backend="replay")
  with pytest.raises(EvalInputError, match="go together"):
    check_inputs(orbax_ckpt, "gsm8k", judge_url="http://127.0.0.1:1/v1")
  with pytest.raises(EvalInputError, match="--search_url="):
    check_inputs(orbax_ckpt, "bamboogle", search_backend="retrieval")


def test_judge_that_does_not_answer_fails_fast(no_compute, orbax_ckpt, judge_server):
  dead = f"http://127.0.0.1:{free_port()}/v1"
  t0 = time.monotonic()
  with pytest.raises(EvalInputError, match="did not answer a health probe") as e:
    check_inputs(orbax_ckpt, "gaia", search_backend="replay", judge_url=dead, judge_model="judge")
  assert dead in str(e.value) and time.monotonic() - t0 < 10
  with pytest.raises(EvalInputError, match="health probe"):
    check_inputs(orbax_ckpt, "gaia", search_backend="replay", judge_url=judge_server("500"), judge_model="judge")
  plan = check_inputs(orbax_ckpt, "gaia", search_backend="replay", judge_url=judge_server("ok"), judge_model="judge")
  assert plan.benchmarks == ["gaia"] and plan.checkpoint.kind == "orbax"


def test_retrieval_server_that_does_not_answer(no_compute, orbax_ckpt):
  with pytest.raises(EvalInputError, match="GET /health"):
    check_inputs(
      orbax_ckpt, "bamboogle", search_backend="retrieval", search_options={"url": f"http://127.0.0.1:{free_port()}"}
    )


@pytest.mark.parametrize(
  "argv,expect",
  [
    (["--benchmarks=gsm8k,nope"], "unknown benchmark 'nope'"),
    (["--benchmarks=gaia"], "need a search backend"),
    (["--benchmarks=hotpotqa"], "--search_backend=none"),
    (["--benchmarks=gsm8k", "--k=1,5", "--n=2"], "--n >= 5"),
  ],
)
def test_cli_errors_before_compute(no_compute, orbax_ckpt, tmp_path, capsys, argv, expect):
  rc = _launch().main([f"--checkpoint={orbax_ckpt}", f"--output={tmp_path / 'out'}", "--noprogress"] + argv)
  assert rc == 2
  assert expect in capsys.readouterr().err


def test_cli_missing_checkpoint(no_compute, tmp_path, capsys):
  rc = _launch().main([f"--checkpoint={tmp_path / 'missing'}", "--benchmarks=gsm8k"])
  assert rc == 2 and "does not exist" in capsys.readouterr().err
