"""`launch/compile.py`: the shipped pod configs' RL step compiled with XLA:TPU for real slices on this CPU host.

aepo_gaia is compiled at full depth (40 layers) on v5p:4x4x2 for the programs that move the most (the update, the
policy's copy to every host's rollout devices, decode); the other tests compile 2 layers (the memory of the rest
scales with depth; the per-layer programs' compile time does too), so the suite stays fast. Needs
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


def _compile(config, topology, *overrides, layers=2):
  """(the finished process, its JSON report) of launch/compile.py; layers=None: the config's full depth."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false")  # each program compiles once
  env.pop("XLA_FLAGS", None)  # the tests' fake CPU devices are irrelevant to a TPU compile
  out = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "launch", "compile.py"),
      f"--config={config}",
      f"--topology={topology}",
      *([f"--config.model.overrides.num_layers={layers}"] if layers else []),
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


RUN_PROGRAMS = {"update", "logprob", "weight_cast", "weight_copy", "prefill", "decode", "decode_compact"}


def _consistent(report, hbm):
  for name, p in report["programs"].items():
    assert 0 < p["peak_gb"] <= hbm, (name, p)
    assert (
      abs(p["peak_gb"] - (p["argument_gb"] + p["output_gb"] - p["alias_gb"] + p["temp_gb"] + p["resident_gb"])) < 0.05
    )
    assert p["hbm_gb"] > 0, (name, p)


@pytest.mark.slow
def test_aepo_gaia_at_full_depth_on_v5p_64():
  """Qwen3-14B (40 layers) on v5p:4x4x2, through the run's constructors: the RL update with the trainer's optimizer,
  the policy's bf16 cast and its copy onto every host's rollout devices (8 hosts), and decode."""
  out, report = _compile(
    "configs/aepo_gaia.py", "v5p:4x4x2", "--programs=update,weight_cast,weight_copy,decode", layers=None
  )
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert report["topology"] == "v5p:4x4x2" and report["chips"] == 32 and report["hbm_gb"] == 95.0
  assert set(report["programs"]) == {"update", "weight_cast", "weight_copy", "decode"} and report["fits"] is True
  _consistent(report, 95.0)
  programs, ro = report["programs"], report["rollout"]
  assert {"splash_mha_fwd_segmented_residuals", "splash_mha_dq_segmented_no_residuals"} <= set(
    programs["update"]["kernels"]
  ) and any(k.startswith("splash_mha_dkv_segmented") for k in programs["update"]["kernels"])
  # The LM head gathers its weight once per micro-batch, not once per chunk: ~25 GB of collective results per chip
  # per update at 40 layers (the per-chunk gathers alone were ~3.7 TB by shape arithmetic).
  assert 0 < programs["update"]["collective_gb"] < 60, programs["update"]["collectives_gb"]
  # Every host's chips receive the bf16 policy (14.8B parameters over a host's 4 chips on tensor: ~7.4 GB each).
  assert ro["hosts"] == 8 and programs["weight_copy"]["output_gb"] == pytest.approx(ro["weights_gb"], rel=0.02)
  assert programs["weight_copy"]["collective_gb"] > 0 and programs["weight_cast"]["output_gb"] > 0
  # The copy runs leaf by leaf (device_put's reshard): temporaries of one stacked weight at a time, never all of them.
  assert programs["weight_copy"]["temp_gb"] < 0.5 * programs["weight_copy"]["output_gb"], programs["weight_copy"]
  # Decode writes in place through the Pallas paged-attention kernel: no copy of a KV pool, and one step moves
  # within 1.3x of what it must (the rollout weights and the KV pool, each read once).
  assert programs["decode"]["kernels"] == ["paged_flash_attention_kernel_inline_seq_dim"]
  pool = "[" + ",".join(str(d) for d in ro["kv_pool_shape"]) + "]"
  assert not [c for c in programs["decode"]["large_copies"] if c[0].endswith(pool)], programs["decode"]
  # Nor of the stacked q_proj (10 heads per chip): decode reads it where it lies (0.52 GB each way per call before).
  assert not [c for c in programs["decode"]["large_copies"] if c[0] == "bf16[40,5120,10,128]"], programs["decode"]
  assert ro["decode_steps"] == 1 and 1.0 <= ro["decode_hbm_ratio"] <= 1.3, ro
  assert report_rollout_line(out.stdout).endswith("(paged, 393,216 tokens per host)")
  assert "decode: " in out.stdout and "x the bound" in out.stdout


def _fits(topology, chips, hbm):
  """aepo_gaia's run (2 layers) on `topology`: every program it runs, by default."""
  out, report = _compile("configs/aepo_gaia.py", topology)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert report["topology"] == topology and report["chips"] == chips and report["hbm_gb"] == hbm
  assert set(report["programs"]) == RUN_PROGRAMS and report["fits"] is True  # no SFT: aepo_gaia starts from one
  _consistent(report, hbm)
  # The training state stays on the chips during rollouts; the engine's programs run on one host's chips.
  assert report["programs"]["decode"]["resident_gb"] > 0 and report["programs"]["update"]["resident_gb"] == 0
  assert "program         chips" in out.stdout and "KV cache sharding" in out.stdout
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
  # The engine on TPU: a paged KV pool sized by tokens (not slots x length), decode (both variants) through the
  # Pallas paged-attention kernel; prefill reads its window of pages with XLA's attention.
  assert report_rollout_line(out.stdout).endswith("tokens per host)") and "(paged, " in report_rollout_line(out.stdout)
  for name in ("decode", "decode_compact"):
    assert programs[name]["kernels"] == ["paged_flash_attention_kernel_inline_seq_dim"], programs[name]
    assert programs[name]["large_copy_gb"] == 0, programs[name]  # the KV pools are written in place
  assert programs["prefill"]["attention"] == "xla"
  assert "per layer (kv_heads, pages, page_size, head_dim): P('tensor'," in out.stdout
  assert report["rollout"]["compact_slots"] == -(-report["rollout"]["slots"] // 4)
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
