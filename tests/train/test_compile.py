"""`launch/compile.py`: the shipped pod configs' RL step compiled with XLA:TPU for real slices on this CPU host.

The configs are compiled with 2 of their layers (the memory of the rest scales with depth; compile time does
not), so the suite stays fast; the full 40-layer figures are in each config's docstring and the README. Needs
libtpu (`pip install -e ".[tpu]"`): skipped without it, except where AEPO_JAX_REQUIRE_LIBTPU=1 (.ci/run sets it),
so CI never skips these.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if importlib.util.find_spec("libtpu") is None:
  if os.environ.get("AEPO_JAX_REQUIRE_LIBTPU") == "1":
    raise RuntimeError("libtpu is not installed but AEPO_JAX_REQUIRE_LIBTPU=1: pip install -e \".[tpu]\"")
  pytest.skip("libtpu is not installed (pip install -e \".[tpu]\")", allow_module_level=True)


def _compile(config, topology, *overrides):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # the tests' fake CPU devices are irrelevant to a TPU compile
  out = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "launch", "compile.py"),
      f"--config={config}",
      f"--topology={topology}",
      "--config.model.overrides.num_layers=2",
      *overrides,
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=1200,
  )
  report = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else None
  return out, report


@pytest.mark.slow
def test_aepo_gaia_fits_v5p_64():
  _fits("v5p:4x4x2", 32, 95.0)


def _fits(topology, chips, hbm):
  out, report = _compile("configs/aepo_gaia.py", topology)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert report["topology"] == topology and report["chips"] == chips and report["hbm_gb"] == hbm
  assert set(report["programs"]) == {"update", "logprob", "prefill", "decode"} and report["fits"] is True
  for name, p in report["programs"].items():
    assert 0 < p["peak_gb"] <= hbm, (name, p)
    assert (
      abs(p["peak_gb"] - (p["argument_gb"] + p["output_gb"] - p["alias_gb"] + p["temp_gb"] + p["resident_gb"])) < 0.05
    )
  # The training state stays on the chips during rollouts; the engine's programs run on one host's 4 chips.
  assert report["programs"]["decode"]["resident_gb"] > 0 and report["programs"]["update"]["resident_gb"] == 0
  assert "program   chips" in out.stdout and "KV cache sharding" in out.stdout
  # Training and scoring attention on TPU is splash attention: its forward, and in the update its backward kernels.
  programs = report["programs"]
  assert programs["update"]["attention"] == programs["logprob"]["attention"] == "splash", programs
  assert {"splash_mha_fwd_segmented_residuals", "splash_mha_dq_segmented_no_residuals"} <= set(
    programs["update"]["kernels"]
  ) and any(k.startswith("splash_mha_dkv_segmented") for k in programs["update"]["kernels"])
  assert any(k.startswith("splash_mha_fwd_segmented") for k in programs["logprob"]["kernels"])
  assert not any(k.startswith("splash_") for k in programs["logprob"]["kernels"] if "fwd" not in k)
  assert all(
    line.rstrip().endswith("splash") for line in out.stdout.splitlines() if line.startswith(("update ", "logprob "))
  )
  # The engine on TPU: a paged KV pool sized by tokens (not slots x length), decode through the Pallas
  # paged-attention kernel; prefill reads its window of pages with XLA's attention.
  assert report_rollout_line(out.stdout).endswith("(paged, 393,216 tokens per host)")
  assert programs["decode"]["attention"] == "paged_attention", programs
  assert programs["decode"]["kernels"] == ["paged_flash_attention_kernel_inline_seq_dim"]
  assert programs["prefill"]["attention"] == "xla"
  assert "per layer (kv_heads, pages, page_size, head_dim): P('tensor'," in out.stdout
  # What the programs move (aepo_jax/train/_hlo.py): decode writes its KV pools in place (no copy of a pool-sized
  # buffer; a relayout of each layer's pool used to cost two ~200 MB copies per layer and step), and the update's
  # LM head gathers its weight once per micro-batch instead of once per chunk (2 layers: ~378 GB of collective
  # results per chip per step before, ~8 GB after, on v5p:4x4x2).
  assert programs["decode"]["large_copy_gb"] == 0, programs["decode"]
  assert 0 < programs["update"]["collective_gb"] < 40, programs["update"]["collectives_gb"]
  assert report["headroom"] == 0.05


def report_rollout_line(stdout: str) -> str:
  return next(line for line in stdout.splitlines() if line.startswith("rollouts: ")).rstrip()


@pytest.mark.slow
def test_a_step_that_does_not_fit_exits_non_zero_and_names_the_knobs():
  """Qwen3-14B's rollout weights and cache on one v5e host (4 chips of 16 GB) cannot fit."""
  out, report = _compile(
    "configs/aepo_gaia.py", "v5e:2x2", "--programs=decode", "--config.model.overrides.num_layers=40"
  )
  assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
  assert report["fits"] is False and report["programs"]["decode"]["peak_gb"] > 16
  assert "does not fit: decode needs" in out.stdout and "rollout.kv_tokens" in out.stdout


def test_unknown_topology_is_a_clear_error():
  out, _ = _compile("configs/aepo_gaia.py", "v9z:1x1", "--programs=update")
  assert out.returncode != 0 and "cannot describe TPU topology 'v9z:1x1'" in out.stderr
