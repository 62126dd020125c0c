"""The README's first command as a newcomer runs it: a fresh clone and a fresh venv under /tmp (no system
site-packages), no bubblewrap on PATH (the sandbox falls back to `unshare`), the embedded default shrunk through
`--config` overrides to its smallest useful sizes, end to end: SFT, evaluation, AEPO with the sandboxed Python tool and
local search, checkpoints, metrics. Packages come from the package index (or pip's cache)."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from aepo_jax.parallel._xla_flags import FAST_COMPILE_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The README command line with these overrides appended, every size at its smallest useful value (those of the
# quickstart notebook's CI size): 2 SFT steps on 2 sequences, 1 RL step of 2 prompts x 2 rollouts of 64 tokens on
# an engine of 4 slots, 2 held-out questions.
SHRINK = (
  "--config.sft.steps=2 --config.sft.batch_size=2 --config.sft.micro_batch_size=2 --config.train.steps=1 "
  "--config.data.suite.n_train=16 --config.data.suite.n_heldout=2 --config.eval.batch_size=2 "
  "--config.data.prompts_per_step=2 --config.rollout.n=2 --config.rollout.initial_rollouts=1 "
  "--config.rollout.max_response_len=64 --config.eval.max_response_len=64 --config.rollout.max_slots=0 "
  "--config.train.ppo_mini_batch_size=2 --config.train.micro_batch_size=4 --config.checkpoint.every_steps=1"
)


def _readme_command() -> str:
  with open(os.path.join(ROOT, "README.md")) as f:
    blocks = re.findall(r"```bash\n(.*?)\n```", f.read(), flags=re.S)
  main = blocks[0].strip()
  assert "launch/tpu_pod.py --config=configs/cpu_default.py" in main and "\n" not in main, main
  return main


def _path_without_bwrap(tmp_path) -> str:
  """A PATH directory holding every program of the image's PATH except bubblewrap."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for d in os.environ.get("PATH", "").split(os.pathsep):
    if not os.path.isdir(d) or "venv" in d:
      continue
    for name in os.listdir(d):
      src, dst = os.path.join(d, name), bin_dir / name
      if name != "bwrap" and not dst.exists() and os.access(src, os.X_OK) and os.path.isfile(src):
        os.symlink(src, dst)
  return str(bin_dir)


@pytest.mark.slow
def test_readme_main_command_in_a_fresh_clone_and_venv_without_bubblewrap(tmp_path):
  clone, venv, workdir = tmp_path / "aepo_jax", tmp_path / "venv", tmp_path / "run"
  subprocess.run(["git", "clone", "-q", "--depth=1", f"file://{ROOT}", str(clone)], check=True, timeout=120)
  # The working tree's uncommitted state is what is under test: overlay it on the clone.
  files = subprocess.run(
    ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.split()
  for f in files:
    if os.path.isfile(os.path.join(ROOT, f)):
      os.makedirs(os.path.dirname(clone / f), exist_ok=True)
      shutil.copy2(os.path.join(ROOT, f), clone / f)
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
  path = os.pathsep.join([str(venv / "bin"), _path_without_bwrap(tmp_path)])
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("PYTHON", "JAX_", "XLA_", "VIRTUAL_ENV")) and k != FAST_COMPILE_ENV  # as a user runs it
  }
  env.update(PATH=path, VIRTUAL_ENV=str(venv), PIP_DISABLE_PIP_VERSION_CHECK="1", HF_HUB_OFFLINE="1")
  # pip's --no-compile (its environment variable reads inverted: "0" turns byte-compilation off): the ~11,000
  # modules installed are not all compiled at install time; the run compiles those it imports.
  env["PIP_NO_COMPILE"] = "0"
  command = f"{_readme_command()} --config.workdir={workdir} {SHRINK}"
  out = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True, timeout=1800)
  log = out.stdout[-4000:] + out.stderr[-6000:]
  assert out.returncode == 0, log
  assert "python tool sandbox: unshare" in out.stderr, log  # bubblewrap hidden: the fallback works from /tmp
  records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  assert any("sft/nll" in r for r in records) and any("reward/mean" in r for r in records)
  assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 1]
  assert sorted(os.listdir(workdir / "checkpoints" / "rl")) == ["1"]
