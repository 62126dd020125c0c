"""OpenAICompatibleJudge against a fake OpenAI-compatible server on 127.0.0.1."""

import http.server
import json
import threading
import time

import pytest

from aepo_jax.rewards import JUDGE_PROMPT, JudgeClient, JudgeError, OpenAICompatibleJudge, parse_verdict


class _Handler(http.server.BaseHTTPRequestHandler):
  script: list = []  # per-request behaviour, popped in order; then the default
  seen: list = []

  def log_message(self, *a):
    pass

  def do_POST(self):
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    type(self).seen.append((self.path, dict(self.headers), body))
    action = type(self).script.pop(0) if type(self).script else "judge"
    if action == "500":
      self.send_response(500), self.end_headers()
      return
    if action == "401":
      self.send_response(401), self.end_headers()
      return
    if action == "slow":
      time.sleep(8.0)
    prompt = body["messages"][0]["content"]
    labeled = prompt.split("Labeled Answer: ")[1].split("\n")[0]
    pred = prompt.split("Predicted Answer: ")[1].split("\n")[0]
    verdict = "Correct" if labeled.lower() == pred.lower() else "Incorrect"
    if action == "garbage":
      verdict = "Maybe"
    if action == "not correct":
      verdict = "Not correct"
    out = json.dumps({"choices": [{"message": {"role": "assistant", "content": verdict}}]}).encode()
    self.send_response(200)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(out)))
    self.end_headers()
    if action == "dribble":  # the whole body, one byte every 0.5 s: each read is quick, the answer never ends
      try:
        for i in range(len(out)):
          self.wfile.write(out[i : i + 1])
          self.wfile.flush()
          time.sleep(0.5)
      except OSError:  # the client gave up: as it should
        pass
      return
    self.wfile.write(out)


@pytest.fixture()
def server():
  _Handler.script, _Handler.seen = [], []
  srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
  t = threading.Thread(target=srv.serve_forever, daemon=True)
  t.start()
  yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
  srv.shutdown()
  srv.server_close()


def test_judge_round_trip_and_prompt(server, monkeypatch):
  monkeypatch.setenv("TEST_JUDGE_KEY", "sk-test")
  judge = OpenAICompatibleJudge(server, "qwen2.5-72b", api_key_env="TEST_JUDGE_KEY", timeout=5)
  assert isinstance(judge, JudgeClient)
  assert judge.judge("Capital of France?", "Paris", "paris") is True
  assert judge.judge("Capital of France?", ["Paris"], "Lyon") is False
  path, headers, body = _Handler.seen[0]
  assert path == "/v1/chat/completions"
  assert headers["Authorization"] == "Bearer sk-test"
  assert body["model"] == "qwen2.5-72b" and body["temperature"] == 0.0
  assert body["messages"][0]["content"] == JUDGE_PROMPT.format(
    question="Capital of France?", labeled_answer="Paris", pred_answer="paris"
  )


def test_no_key_sends_no_authorization(server, monkeypatch):
  monkeypatch.delenv("UNSET_JUDGE_KEY", raising=False)
  OpenAICompatibleJudge(server, "m", api_key_env="UNSET_JUDGE_KEY").judge("q", "a", "a")
  assert "Authorization" not in _Handler.seen[0][1]


def test_retries_on_5xx_and_timeout(server):
  _Handler.script = ["500", "slow", "judge"]
  judge = OpenAICompatibleJudge(server, "m", timeout=3.0, retries=3, backoff_s=0.01)  # "slow" takes 8 s
  assert judge.judge("q", "a", "a") is True
  assert len(_Handler.seen) == 3


def test_gives_up_with_a_clear_error(server):
  _Handler.script = ["500"] * 3
  judge = OpenAICompatibleJudge(server, "m", retries=2, backoff_s=0.01)
  with pytest.raises(JudgeError, match="failed after 3 attempts"):
    judge.judge("q", "a", "a")
  _Handler.script = ["401"]
  with pytest.raises(JudgeError, match="HTTP 401"):
    judge.judge("q", "a", "a")
  _Handler.script = ["garbage"]
  with pytest.raises(JudgeError, match="neither"):
    judge.judge("q", "a", "a")


def test_parse_verdict():
  assert parse_verdict(" Correct.") is True
  assert parse_verdict("**Correct**") is True
  assert parse_verdict("Incorrect") is False
  assert parse_verdict("INCORRECT") is False


@pytest.mark.parametrize(
  "reply",
  [
    "Not correct",
    "not correct.",
    "Correct? No.",
    "It is not correct",
    "Correct, but the year is wrong",
    "Not equivalent",
    "No",
  ],
)
def test_parse_verdict_rejects_negations_and_qualified_replies(reply):
  # The official evaluation accepts only the reply "Correct" (content.strip() == "Correct").
  assert parse_verdict(reply) is False


def test_not_correct_from_the_server_is_false(server):
  _Handler.script = ["not correct"]
  assert OpenAICompatibleJudge(server, "m", timeout=5).judge("q", "a", "a") is False


def test_slow_body_cannot_hold_a_call_past_its_timeout(server):
  # Each byte arrives well within the socket timeout; the whole answer would take about 40 s.
  _Handler.script = ["dribble"]
  judge = OpenAICompatibleJudge(server, "m", timeout=2, retries=0)
  start = time.monotonic()
  with pytest.raises(JudgeError, match="failed after 1 attempts"):
    judge.judge("q", "a", "a")
  assert time.monotonic() - start < 20  # a 2 s call timeout against a ~40 s answer; 10x for a loaded machine
