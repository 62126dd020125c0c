"""Chaos: the tiny RL main job survives the faults of a real cluster, and its metrics say which steps they hit.

While `launch/tpu_pod.py --config=configs/testing/tiny_rl.py` runs 4 RL steps with the Python sandbox and a
retrieval server in its own process, the test SIGKILLs one sandboxed Python program in the middle of its call
(step 1), kills the retrieval server and starts it again on the same port a few seconds later (step 2), and
SIGTERMs the trainer (step 3), then reruns the same command. The run must finish with every RL step logged and
checkpointed exactly once, and each fault counted in the step it hit: `tools/python_crashes`,
`tools/search_http_retries` / `tools/search_failures`, `rollout/tool_failures`.

How the random tiny model is made to call tools (no fake model): its cold-start SFT data is a trace file in which
every suite prompt is answered by the same two calls, `<python>import time;time.sleep(2)</python>` (its real
result, `None`) and then `<search> city </search>`. 60 SFT steps make the model emit both calls in nearly every
rollout, at temperature 1 as configured. The program sleeps so that a sandbox is alive long enough to be found and
killed, and the searches come about two seconds after the sandboxes appear, so a server killed when they appear
is down when the searches arrive. The tools are the real ones.

The two fast tests below check the same counters on the tools alone. The chaos test takes about 2.5 minutes on
2 busy CPU cores (a compilation cache shared by the two trainer runs saves the second one's compile).
"""

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from aepo_jax import tools
from aepo_jax.tools._python import _BOOT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "testing", "tiny_rl.py")
STEPS = 4
SFT_STEPS = 60
SLEEP_CODE = "import time;time.sleep(2)"
# The server stays down this long: the searches that follow the 2 s program give up after the client's retries
# (about 3.5 s) well before it is back.
SERVER_DOWN_S = 10.0


# ---------------------------------------------------------------------------------------------------------
# Processes: finding a sandboxed program, the retrieval server.
# ---------------------------------------------------------------------------------------------------------
def _parent(pid: int) -> int:
  with open(f"/proc/{pid}/stat") as f:
    return int(f.read().rsplit(")", 1)[1].split()[1])


def _descends(pid: int, root: int) -> bool:
  try:
    while pid > 1:
      pid = _parent(pid)
      if pid == root:
        return True
  except (OSError, ValueError, IndexError):
    pass
  return False


def sandbox_programs(root: int) -> list:
  """PIDs of the Python tool's sandboxed programs (`python -I -c <boot code>`, inside bwrap or unshare) that run
  under process `root`."""
  boot = _BOOT.encode()
  out = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    except OSError:
      continue
    if argv[1:4] == [b"-I", b"-c", boot] and _descends(int(name), root):
      out.append(int(name))
  return out


def _wait_for(predicate, timeout: float, what: str):
  t0 = time.monotonic()
  while time.monotonic() - t0 < timeout:
    value = predicate()
    if value:
      return value
    time.sleep(0.02)
  raise AssertionError(f"no {what} within {timeout} s")


class RetrievalServer:
  """launch/retrieval_server.py in its own process, on a fixed port so that it can be killed and started again."""

  def __init__(self, corpus: str, index_dir: str, port: int):
    self.cmd = [
      sys.executable,
      os.path.join(ROOT, "launch", "retrieval_server.py"),
      "--corpus",
      corpus,
      "--index",
      index_dir,
      "--port",
      str(port),
    ]
    self.url, self.proc, self.ready_at = f"http://127.0.0.1:{port}", None, None

  def start(self) -> None:
    self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = self.proc.stdout.readline()  # READY http://...: the port is bound and the index loaded
    assert line.startswith("READY"), f"retrieval server did not start (exit {self.proc.poll()}): {line!r}"
    self.ready_at = time.monotonic()

  def kill(self) -> None:
    self.proc.kill()
    self.proc.wait()
    self.proc.stdout.close()

  def stop(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      self.kill()


# ---------------------------------------------------------------------------------------------------------
# The two counters on the tools alone (fast).
# ---------------------------------------------------------------------------------------------------------
def test_a_sandbox_killed_mid_call_is_a_crash_not_an_answer():
  toolset = tools.ToolSet({"python": tools.PythonTool(timeout_s=30)}, retry_count=3)
  try:
    fut = toolset.submit(tools.ToolCall("python", "import time\ntime.sleep(30)"), tools.CallState())
    pid = _wait_for(lambda: sandbox_programs(os.getpid()), 20, "sandboxed program")[0]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    out = fut.result(timeout=20)
    assert time.monotonic() - t0 < 20  # the call ends with its program, not at its 30 s limit (loaded CI: slack)
    assert not out.ok and out.info["crashed"] and out.info["retries"] == 0, out  # not run again
    assert "Process killed by SIGKILL" in out.text, out.text
    m = toolset.metrics()
    assert m["tools/python_crashes"] == 1 and m["tools/python_calls"] == 1 and m["tools/python_timeouts"] == 0, m
    assert "tools/python_failures" not in m, m
    toolset.reset_metrics()
    ok = toolset.execute(tools.ToolCall("python", "print(6 * 7)"), tools.CallState())
    assert ok.ok and ok.text == "42" and "tools/python_crashes" not in toolset.metrics()
  finally:
    toolset.shutdown()


def test_search_outage_and_restart_are_counted_per_step(tmp_path):
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text(
    "".join(
      json.dumps({"id": name, "contents": f"{name}\n{name} is a city on a river."}) + "\n"
      for name in ("Alba", "Brivo", "Corda", "Dumo")
    )
  )
  index = tools.RetrievalIndex(str(corpus), str(tmp_path / "index"))
  server, url = tools.serve_in_thread(index)
  port = server.server_address[1]
  backend = tools.RetrievalBackend(url, timeout_s=5, retries=2, backoff_s=0.05)
  toolset = tools.ToolSet({"search": tools.SearchTool(backend, topk=1)}, retry_count=1)
  try:
    assert toolset.execute(tools.ToolCall("search", "Corda"), tools.CallState()).text.startswith("Page 1: Corda is")
    assert toolset.metrics()["tools/search_http_retries"] == 0
    server.shutdown()
    server.server_close()  # the server is gone: connections are refused
    down = toolset.execute(tools.ToolCall("search", "Corda"), tools.CallState())
    assert not down.ok and down.text.startswith("Error: Tool(search) execution failed"), down
    m = toolset.metrics()
    assert m["tools/search_http_retries"] == 2 and m["tools/search_http_failures"] == 1, m
    assert m["tools/search_failures"] == 1 and m["tools/search_calls"] == 2, m
    toolset.reset_metrics()  # the next step starts from zero; the client's own totals keep counting
    server, _ = tools.serve_in_thread(index, port=port)  # restarted on the same port
    assert toolset.execute(tools.ToolCall("search", "Corda"), tools.CallState()).ok
    m = toolset.metrics()
    assert m["tools/search_http_retries"] == 0 and m["tools/search_http_failures"] == 0, m
    assert backend.metrics() == {"http_retries": 2.0, "http_failures": 1.0}
  finally:
    server.shutdown()
    server.server_close()
    toolset.shutdown()


# ---------------------------------------------------------------------------------------------------------
# The main job under faults (slow).
# ---------------------------------------------------------------------------------------------------------
def _write_traces(path, tok_dir) -> str:
  """The SFT traces (every train prompt answered by the sleep program, its result, then a search) and the
  suite's corpus path; the suite is generated here exactly as the trainer generates it."""
  from aepo_jax import data as data_lib
  from aepo_jax.train import _inputs, load_config

  config = load_config(CONFIG, overrides={"workdir": str(path.parent), "model.tokenizer": tok_dir}, num_devices=None)
  suite = _inputs._suite(config)
  answer = (
    f"<python>{SLEEP_CODE}</python>"
    + tools.format_result("None", "train")  # the program's real result
    + " <search> city </search>"
  )
  with open(path, "w") as f:
    for ex in suite.train:
      msgs = data_lib.build_messages(ex, config.data.template) + [{"role": "assistant", "content": answer}]
      f.write(json.dumps({"messages": msgs}) + "\n")
  return str(suite.corpus_path)


def _free_port() -> int:
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _rl_lines(workdir) -> list:
  """Every RL metrics line as written (read_metrics would fold a step logged twice into one)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    lines = [json.loads(line) for line in f.read().splitlines() if line.strip()]
  return [r for r in lines if "reward/mean" in r]


def _sft_steps(workdir) -> list:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r["step"] for r in map(json.loads, f) if "sft/nll" in r]


@pytest.mark.slow
def test_rl_job_survives_killed_server_sandbox_and_trainer(tmp_path):
  from aepo_jax.testing import tiny_tokenizer

  tok_dir = tiny_tokenizer(tmp_path / "tok")
  traces = tmp_path / "traces.jsonl"
  corpus = _write_traces(traces, tok_dir)
  server = RetrievalServer(corpus, str(tmp_path / "index"), _free_port())
  server.start()
  workdir = str(tmp_path / "run")
  cmd = [
    sys.executable,
    os.path.join(ROOT, "launch", "tpu_pod.py"),
    f"--config={CONFIG}",
    f"--config.workdir={workdir}",
    f"--config.model.tokenizer={tok_dir}",
    f"--config.sft.source={traces}",
    f"--config.sft.steps={SFT_STEPS}",
    "--config.sft.lr=0.01",
    "--config.sft.schedule=constant",
    "--config.sft.warmup_frac=0.0",
    "--config.sft.max_len=320",
    "--config.rollout.max_response_len=160",
    "--config.tools.search_backend=retrieval",
    f"--config.tools.search_url={server.url}",
    "--config.tools.python_timeout=5.0",  # a mis-sampled sleep(22) costs 5 s, not 22
    "--config.tools.retry_count=1",  # one try per call: a search during the outage fails, and says so
    f"--config.train.steps={STEPS}",
    "--config.checkpoint.every_steps=1",
    "--config.checkpoint.keep=10",
    "--config.eval.before_rl=False",
    "--config.eval.after_rl=False",
  ]
  # The restarted trainer takes its programs from the first run's compilation cache: a minute less.
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS="--xla_force_host_platform_device_count=1",
    JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
  )
  logs = []

  def launch():
    log = open(tmp_path / f"trainer{len(logs)}.log", "w+")
    logs.append(log)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

  def tail(i):
    logs[i].seek(0)
    return logs[i].read()[-6000:]

  hit = {}  # fault -> the RL step it hit (the step running when it struck: logged steps + 1)
  step_logged_at = {}  # step -> when its metrics line was first seen
  first_seen = {}  # sandboxed program -> when it was first seen
  restart, restarted = concurrent.futures.ThreadPoolExecutor(1), None
  trainer = launch()
  try:
    sft_done = os.path.join(workdir, "checkpoints", "sft", str(SFT_STEPS))
    deadline = time.monotonic() + 600
    while trainer.poll() is None:
      assert time.monotonic() < deadline, "the first run did not end:\n" + tail(0)
      time.sleep(0.05)
      done = len(_rl_lines(workdir))
      for k in range(1, done + 1):
        step_logged_at.setdefault(k, time.monotonic())
      if not os.path.isdir(sft_done):  # the start-up sandbox check and SFT run no tool call
        continue
      programs = sandbox_programs(trainer.pid)
      if not programs:
        continue
      now = time.monotonic()
      for pid in programs:
        first_seen.setdefault(pid, now)
      if "python" not in hit:
        # One program, mid-call: one alive for 0.3 s is sleeping (a mis-sampled program exits at once).
        sleeping = [pid for pid in programs if now - first_seen[pid] >= 0.3]
        try:
          if sleeping:
            os.kill(sleeping[0], signal.SIGKILL)
            hit["python"] = done + 1
        except ProcessLookupError:  # it ended after all: take the next one
          pass
      elif "server" not in hit and done + 1 > hit["python"]:
        server.kill()  # mid-rollout: the step's programs run, its searches follow
        hit["server"] = done + 1
        restarted = restart.submit(lambda: (time.sleep(SERVER_DOWN_S), server.start()))
      elif "trainer" not in hit and "server" in hit and done + 1 > hit["server"]:
        trainer.send_signal(signal.SIGTERM)  # preemption: save (this step, or in its rollout its start), exit
        hit["trainer"] = done + 1
        break
    assert trainer.wait(timeout=300) == 0, tail(0)
    assert hit.keys() == {"python", "server", "trainer"}, (hit, tail(0))
    assert hit["trainer"] < STEPS, hit  # the restart has steps left to run
    # The SIGTERMed step: finished and logged when the signal came after its rollout; abandoned when it came
    # during the rollout (noticed between decode chunks: the state at its start is saved, nothing of it logged).
    stopped = len(_rl_lines(workdir))
    if stopped == hit["trainer"] - 1:
      assert f"preempted during the rollout of RL step {hit['trainer']}" in tail(0), tail(0)
    else:
      assert stopped == hit["trainer"], tail(0)
    restarted.result(timeout=120)  # the server is back (the restarted trainer checks its /health first)
    trainer = launch()
    assert trainer.wait(timeout=300) == 0, tail(1)
    assert f"from step {stopped}" in tail(1), tail(1)
  finally:
    if trainer.poll() is None:
      trainer.kill()
      trainer.wait()
    restart.shutdown(wait=True)
    server.stop()
    for log in logs:
      log.close()

  # No step lost or repeated: each RL step logged once (raw lines) and checkpointed; SFT not run again.
  rl = {r["step"]: r for r in _rl_lines(workdir)}
  assert [r["step"] for r in _rl_lines(workdir)] == list(range(1, STEPS + 1))
  ckpts = sorted(int(p) for p in os.listdir(os.path.join(workdir, "checkpoints", "rl")) if p.isdigit())
  assert ckpts == list(range(1, STEPS + 1))
  assert _sft_steps(workdir) == list(range(1, SFT_STEPS + 1))

  # Each fault is counted in the step it hit, and only there.
  def count(step, key):
    return rl[step].get(key, 0.0)

  print(
    "faults hit",
    hit,
    {k: {m: v for m, v in r.items() if m.startswith(("tools/", "rollout/tool_failures"))} for k, r in rl.items()},
  )  # shown when an assertion below fails

  p, s = hit["python"], hit["server"]
  assert count(p, "tools/python_crashes") == 1, rl[p]
  assert count(p, "rollout/tool_failures") >= 1, rl[p]
  assert all(count(k, "tools/python_crashes") == 0 for k in rl if k != p), rl
  assert count(s, "tools/search_http_retries") > 0 and count(s, "tools/search_failures") > 0, rl[s]
  assert count(s, "rollout/tool_failures") >= 1, rl[s]
  assert all(count(k, "tools/search_http_retries") == 0 for k in rl if k < s), rl
  # Steps that began after the server was back met no outage (the step before them was logged after that).
  back = [k for k in rl if k > s and step_logged_at.get(k - 1, float("inf")) > server.ready_at]
  assert all(count(k, "tools/search_http_retries") == 0 and count(k, "tools/search_failures") == 0 for k in back), rl
  # The model really called both tools in every step (what makes the faults land mid-call).
  assert all(count(k, "tools/python_calls") > 0 and count(k, "tools/search_calls") > 0 for k in rl), rl
