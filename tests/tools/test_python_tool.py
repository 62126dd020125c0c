"""The Python tool's normal behaviour: auto-printed last expression, result text, pool, start-up checks."""

import logging

import pytest

from aepo_jax.tools import (
  PythonLimits,
  PythonPool,
  PythonTool,
  SandboxUnavailableError,
  resolve_isolation,
  run_python,
  wrap_last_expression,
)
from aepo_jax.tools import _isolation


@pytest.mark.parametrize(
  "code, expected",
  [
    ("x = 2\nx * 21", "x = 2\nprint(x * 21)"),
    ("print(3)", "print(3)"),  # a final print is not wrapped (it would print None)
    ("x = 1", "x = 1"),
    ("a = 1; a + 1  # comment", "a = 1; print(a + 1)  # comment"),
    ("(1 +\n 2)", "(print(1 +\n 2))"),
    ("s = 'é'; s * 2", "s = 'é'; print(s * 2)"),  # byte offsets vs characters
    ("def f(:\n  pass", "def f(:\n  pass"),  # syntax errors pass through untouched
    ("for i in range(2):\n    i", "for i in range(2):\n    i"),  # only a top-level bare expression
  ],
)
def test_wrap_last_expression(code, expected):
  assert wrap_last_expression(code) == expected


def test_result_text_like_official_tool():
  ok = run_python("import math\nmath.factorial(10)", timeout_s=20)
  assert ok.text == "3628800" and ok.exit_code == 0 and ok.ok and ok.isolation in ("bwrap", "unshare")
  err = run_python("print('partial')\nraise ValueError('bad input')", timeout_s=20)
  # On error the model sees stderr (the traceback), not the partial stdout.
  assert err.exit_code == 1 and err.text.startswith("Traceback") and "ValueError: bad input" in err.text
  assert 'File "<python>", line 2' in err.text and "raise ValueError('bad input')" in err.text
  silent = run_python("x = 1", timeout_s=20)
  assert silent.text == "" and silent.exit_code == 0  # empty output: ToolSet retries, then reports it
  syntax = run_python("def f(:", timeout_s=20)
  assert "SyntaxError" in syntax.text and syntax.exit_code == 1


def test_scientific_packages_and_workdir_available():
  res = run_python(
    "import numpy as np, sympy, os\nopen('w.txt', 'w').write('ok')\n"
    "print(np.linalg.det(np.eye(3)), sympy.factorint(360), open('w.txt').read(), os.getcwd())",
    timeout_s=60,
  )
  assert res.exit_code == 0, res
  assert res.text == "1.0 {2: 3, 3: 2, 5: 1} ok /tmp"


def test_each_call_is_fresh():
  run_python("open('/tmp/state.txt', 'w').write('left over')", timeout_s=20)
  res = run_python("import os\nos.path.exists('/tmp/state.txt')", timeout_s=20)
  assert res.text == "False"


def test_pool_bounds_concurrency_and_runs_in_parallel():
  code = "import time\nt0 = time.time()\ntime.sleep(1)\nprint(t0, time.time())"
  with PythonPool(max_workers=2) as pool:
    results = pool.map([code] * 5, timeout_s=30)
  spans = [tuple(map(float, r.text.split())) for r in results]
  # Wall-clock intervals of the programs themselves: at most 2 overlap (the bound), and 2 do (parallel).
  overlap = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
  assert overlap == 2, spans


def test_python_tool_callable_and_limits():
  # 30 s where the limit is not under test: a loaded machine can take seconds to start a sandbox.
  tool = PythonTool(timeout_s=30, memory_mb=512)
  assert tool("1 + 1").text == "2"
  assert PythonTool(timeout_s=2, memory_mb=512)("while True: pass").timed_out
  tool = PythonTool(timeout_s=30, limits=PythonLimits(max_output_chars=10))
  assert tool("print('z' * 50)").text == "z" * 10 + "\n[... output truncated at 10 characters]"


def test_no_isolation_is_refused_without_the_flag(monkeypatch):
  monkeypatch.setattr(_isolation, "_probe_result", lambda mode: (False, f"{mode} refused (simulated)"))
  with pytest.raises(SandboxUnavailableError, match="allow_unsandboxed=True"):
    resolve_isolation("auto")
  with pytest.raises(SandboxUnavailableError, match="allow_unsandboxed=True"):
    PythonTool()
  with pytest.raises(SandboxUnavailableError):
    resolve_isolation("none")


def test_unsandboxed_runs_with_loud_warning(monkeypatch, caplog, capsys):
  monkeypatch.setattr(_isolation, "_probe_result", lambda mode: (False, f"{mode} refused (simulated)"))
  _isolation._warn_unsandboxed.cache_clear()
  with caplog.at_level(logging.WARNING):
    assert resolve_isolation("auto", allow_unsandboxed=True) == "none"
  assert "WITHOUT a sandbox" in caplog.text and "WITHOUT a sandbox" in capsys.readouterr().err
  monkeypatch.setenv("AEPO_FAKE_SECRET", "hunter2")
  res = run_python(
    "import os\nprint(os.environ.get('AEPO_FAKE_SECRET'))\nos.getcwd()",
    timeout_s=20,
    isolation="none",
    allow_unsandboxed=True,
  )
  # Even unsandboxed, the environment is scrubbed and the work dir is a fresh temporary one.
  assert res.isolation == "none" and res.stdout.splitlines()[0] == "None" and "aepo_py_" in res.stdout


def test_bad_arguments():
  with pytest.raises(TypeError, match="needs a str"):
    run_python(b"print(1)")
  with pytest.raises(ValueError, match="isolation='docker'"):
    run_python("1", isolation="docker")
  with pytest.raises(TypeError):
    run_python("1", not_a_limit=3)
