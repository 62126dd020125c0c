"""bench/compile_table.py: a shipped config compiled at full depth through launch/compile.py, kept as JSON, and the
markdown page written from it (the one source of the compiled peaks the docs quote)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu ('.[tpu]')")


def test_the_table_compiles_a_shipped_config_and_writes_the_page(tmp_path):
  """aepo_gaia's bf16 cast of the 40-layer policy on v5p:2x2x1 (the cheapest program: seconds), then the page; a
  second call with the JSON there compiles nothing and writes the same page."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [
    sys.executable,
    os.path.join(ROOT, "bench", "compile_table.py"),
    "--configs=aepo_gaia",
    "--topologies=v5p:2x2x1",
    "--programs=weight_cast",
    f"--out={tmp_path / 'json'}",
    f"--table={tmp_path / 'compiled.md'}",
  ]
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  (name,) = os.listdir(tmp_path / "json")
  assert name == "aepo_gaia@v5p_2x2x1.json"
  report = json.loads((tmp_path / "json" / name).read_text())
  cast = report["programs"]["weight_cast"]
  # 14.8B float32 parameters over 4 chips: ~14.8 GB read, ~7.4 GB of bf16 written per chip (TPU tiles pad a little).
  assert 14.0 < cast["argument_gb"] < 16.0 and 7.0 < cast["output_gb"] < 8.0, cast
  assert cast["hbm_gb"] == pytest.approx(cast["argument_gb"] + cast["output_gb"], rel=0.02)
  page = (tmp_path / "compiled.md").read_text()
  assert "## aepo_gaia on v5p:2x2x1 (4 chips, 95 GB HBM each; compiled " in page
  assert "| weight_cast | " in page and "Result: " in page
  again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0 and (tmp_path / "compiled.md").read_text() == page
  assert "topology v5p:2x2x1" not in again.stdout  # nothing compiled the second time


def test_compiling_some_programs_again_replaces_only_their_rows():
  sys.path.insert(0, os.path.join(ROOT, "bench"))
  import compile_table

  def prog(peak):
    return {"peak_gb": peak, "collective_gb": 0.0, "large_copy_gb": 0.0, "compile_s": 1.0}

  old = {
    "hbm_gb": 95.0,
    "headroom": 0.05,
    "date": "2026-12-01",
    "programs": {"update": prog(27.0), "decode": prog(30.0)},
    "rollout": {"slots": 96, "decode_hbm_ratio": 1.08},
    "table": ["old"],
    "fits": True,
  }
  new = {
    "date": "2026-12-02",
    "programs": {"decode": prog(99.0)},
    "rollout": {"decode_hbm_ratio": 1.04},
    "table": ["new"],
  }
  out = compile_table.merge(old, new)
  assert out["programs"]["update"]["peak_gb"] == 27.0 and out["programs"]["decode"]["peak_gb"] == 99.0
  assert out["rollout"] == {"slots": 96, "decode_hbm_ratio": 1.04} and out["date"] == "2026-12-02"
  assert out["fits"] is False  # 99 GB does not fit in 95 GB less 5%
