"""Config schema, validation messages, experiment files and the command-line overrides."""

import ast
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from aepo_jax.train import ConfigError, base_config, from_json, load_config, mesh_shape, set_key, to_json, validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPERIMENTS = sorted(
  p
  for p in glob.glob(os.path.join(ROOT, "configs", "**", "*.py"), recursive=True)
  if os.path.basename(p) != "common.py"
)


def _error(config, **kw) -> str:
  with pytest.raises(ConfigError) as e:
    validate(config, **kw)
  return str(e.value)


def test_base_config_is_valid_and_locked():
  c = validate(base_config(), num_devices=8)
  with pytest.raises(AttributeError, match="rollout_n"):
    c.rollout_n = 3  # a typo at the top level cannot add a key


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_experiment_config_loads_and_validates(path):
  config = load_config(path, num_devices=8)
  with open(path) as f:
    doc = ast.get_docstring(ast.parse(f.read())) or ""
  for part in ("Command", "Hardware", "Time", "Expected"):
    assert part in doc, f"{path}: the docstring must say {part}"
  assert config.workdir
  if config.model.name.startswith("gs://"):  # a pod config: the slice it was compiled for, and per-chip peaks
    assert "launch/compile.py" in doc and "v5p:4x4x2" in doc, f"{path}: the docstring must give its compile"
    assert re.search(r"update\s+(step\s+)?\d+\.\d+", doc), f"{path}: the docstring must give the per-chip peaks"


def test_aepo_gaia_paper_vs_released_is_explicit():
  paper = load_config(os.path.join(ROOT, "configs/aepo_gaia.py"), num_devices=8)
  released = load_config(os.path.join(ROOT, "configs/aepo_gaia.py"), "released", num_devices=8)
  # spec §2.6: the released script disabled dynamic rollouts and (silently) the entropy-aware advantage.
  assert paper.rollout.enable_dynamic_rollouts and paper.algo.entropy_advantage_coef == 0.2
  assert not released.rollout.enable_dynamic_rollouts and released.algo.entropy_advantage_coef == 0.0
  # the official deep-search script values (spec §1.7, §2.4)
  for c in (paper, released):
    assert (c.data.prompts_per_step, c.train.ppo_mini_batch_size, c.rollout.n, c.rollout.initial_rollouts) == (
      64,
      8,
      12,
      6,
    )
    assert (c.rollout.beam_size, c.rollout.branch_probability, c.rollout.entropy_weight) == (2, 0.5, 0.2)
    assert (c.tools.call_limit, c.tools.retry_count, c.optim.lr, c.train.epochs) == (6, 4, 1e-6, 5)
    assert (c.rollout.max_prompt_len, c.rollout.max_response_len) == (2000, 6192)
    assert (c.algo.clip_low, c.algo.clip_high, c.algo.clip_c, c.algo.kl.coef) == (0.2, 0.2, 3.0, 0.0)
    assert c.data.train == "hard_search_1k" and tuple(c.data.val) == ("gaia_test", "hle_test")
  with pytest.raises(ValueError, match="paper"):
    load_config(os.path.join(ROOT, "configs/aepo_gaia.py"), "papper")


def test_reasoning_config_values():
  c = load_config(os.path.join(ROOT, "configs/aepo_reasoning.py"), num_devices=8)
  assert (c.data.prompts_per_step, c.train.ppo_mini_batch_size, c.rollout.n, c.rollout.initial_rollouts) == (
    128,
    16,
    16,
    8,
  )
  assert (c.rollout.max_prompt_len, c.rollout.max_response_len, c.train.epochs, c.tools.call_limit) == (
    1536,
    4096,
    2,
    6,
  )
  assert c.data.train == "train_10k"


def test_unknown_key_gets_did_you_mean():
  c = base_config()
  c.unlock()
  c.rollout.initial_rollout = 4
  assert "'rollout.initial_rollout' does not exist; did you mean 'rollout.initial_rollouts'?" in _error(c)
  with pytest.raises(ConfigError, match="did you mean 'train.ppo_epochs'"):
    set_key(base_config(), "train.ppo_epoch", 2)
  with pytest.raises(ConfigError, match="did you mean 'optim'"):
    set_key(base_config(), "optimizer.lr", 2)


def test_model_override_typo():
  c = base_config()
  c.model.overrides.num_layer = 2
  assert "model.overrides.num_layer is not a ModelConfig field; did you mean 'num_layers'?" in _error(c)


@pytest.mark.parametrize(
  "key,value,needle",
  [
    ("rollout.initial_rollouts", 13, "rollout.initial_rollouts=13 must lie in [1, rollout.n=12]"),
    ("train.ppo_mini_batch_size", 7, "train.ppo_mini_batch_size=7 (prompts) must divide data.prompts_per_step=64"),
    ("train.micro_batch_size", 7, "train.micro_batch_size=7 (sequences) must divide ppo_mini_batch_size*n=96"),
    ("algo.clip_low", 1.5, "algo.clip_low=1.5"),
    ("algo.clip_high", 0.0, "algo.clip_high=0.0"),
    ("algo.clip_c", 0.5, "algo.clip_c=0.5: the dual clip must be > 1"),
    ("rollout.policy", "apro", "rollout.policy='apro'"),
    ("rollout.top_k", -1, "rollout.top_k=-1: use 0 for off"),
    ("rollout.entropy_estimator", "topk", "rollout.entropy_estimator='topk'"),
    ("optim.schedule", "cosine_decay", "optim.schedule='cosine_decay'"),
    ("workdir", "", "workdir is empty"),
    ("train.logit_fraction", 1.5, "train.logit_fraction=1.5: must be in [0, 1]"),
    ("rollout.kv_layout", "pages", "rollout.kv_layout='pages': use one of ('auto', 'dense', 'paged')"),
    ("rollout.page_size", 0, "rollout.page_size=0: must be >= 1"),
    ("rollout.kv_tokens", 1000, "rollout.kv_tokens=1000: 0 (every slot at full length) or at least one trajectory"),
  ],
)
def test_bad_values_name_the_key(key, value, needle):
  c = base_config()
  set_key(c, key, value)
  assert needle in _error(c)


def test_unknown_registry_names():
  c = base_config()
  c.algo.loss = "apeo"
  c.algo.entropy_advantage_coef = 0.0
  c.algo.advantage = "gpro"
  msg = _error(c)
  # 'apeo' is one swap from 'aepo' (two edits from 'arpo', which difflib alone would pick)
  assert "algo.loss='apeo' is not registered; did you mean 'aepo'?" in msg and "(known: aepo, arpo," in msg
  assert "algo.advantage='gpro' is not registered; did you mean 'grpo'?" in msg


def test_entropy_advantage_needs_aepo_loss():
  c = base_config()
  c.algo.loss = "grpo"
  assert "algo.entropy_advantage_coef=0.2 only acts with algo.loss='aepo'" in _error(c)


def test_mesh_shapes():
  assert mesh_shape(base_config().mesh, 8) == {"data": 8, "fsdp": 1, "tensor": 1}
  c = base_config()
  c.mesh.tensor = 3
  assert "do not divide the 8 devices" in _error(c, num_devices=8)
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 1
  assert "needs 4 devices but 8 are available" in _error(c, num_devices=8)
  c.mesh.data, c.mesh.fsdp = -1, -1
  assert "at most one of mesh.data/fsdp/tensor may be -1" in _error(c, num_devices=8)
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = -1, 1, 1
  c.train.micro_batch_size = 4
  assert "train.micro_batch_size=4 must be a multiple of the data-parallel size mesh.data*mesh.fsdp=8" in _error(
    c, num_devices=8
  )


def test_json_round_trip():
  c = load_config(os.path.join(ROOT, "configs/testing/tiny_sft.py"))
  back = from_json(to_json(c))
  assert to_json(back) == to_json(c)
  assert back.model.overrides.num_layers == 2 and tuple(back.data.val) == ()


def _cli(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(
    [sys.executable, os.path.join(ROOT, "launch/tpu_pod.py"), *args, "--dry_run"],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=env,
    timeout=120,
  )


def test_cli_overrides_and_errors():
  out = _cli(
    "--config=configs/aepo_gaia.py:released",
    "--config.model.name=smollm2-135m-instruct",
    "--config.rollout.n=8",
    "--config.rollout.initial_rollouts=4",
    "--config.train.ppo_mini_batch_size=4",
    "--config.train.micro_batch_size=16",
  )
  assert out.returncode == 0, out.stderr[-2000:]
  c = json.loads(out.stdout.strip().splitlines()[-1])
  assert c["rollout"]["n"] == 8 and c["rollout"]["enable_dynamic_rollouts"] is False
  bad = _cli("--config=configs/aepo_gaia.py", "--config.rollout.nn=8")
  assert bad.returncode != 0 and "'rollout.nn'" in bad.stderr and "did you mean 'rollout.n'" in bad.stderr
  bad = _cli("--config=configs/aepo_gaia.py", "--config.rollout.initial_rollouts=20")
  assert bad.returncode != 0 and "rollout.initial_rollouts=20 must lie in [1, rollout.n=12]" in bad.stderr
  assert bad.stderr.startswith("error: invalid config:") and "Traceback" not in bad.stderr, bad.stderr[-2000:]
  bad = _cli("--config=configs/aepo_gaia.py", "--config.rollout.policy=apeo")
  assert "rollout.policy='apeo' is not registered; did you mean 'aepo'?" in bad.stderr, bad.stderr[-2000:]
  assert "Traceback" not in bad.stderr


def test_partial_rollout_settings_are_checked():
  c = base_config()
  c.train.max_staleness = -1
  assert "train.max_staleness=-1" in _error(c, num_devices=8)
  c.train.max_staleness, c.algo.filter_groups = 1, True
  assert "not supported with partial rollouts" in _error(c, num_devices=8)
  c.algo.filter_groups = False
  validate(c, num_devices=8)
  c.train.hand_back = "fifo"
  assert "train.hand_back='fifo' is not registered (known: completion, admission)" in _error(c, num_devices=8)
  c.train.hand_back = "admission"
  validate(c, num_devices=8)
  c.train.staleness_ramp = True
  c.train.call_floor = -0.5
  assert "train.call_floor=-0.5: a number >= 0" in _error(c, num_devices=8)
  c.train.call_floor = 0.75
  validate(c, num_devices=8)
