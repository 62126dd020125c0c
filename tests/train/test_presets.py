"""Every paper config against the spec's table of what the released scripts ran (spec §1.5, §1.7, §2.4, §2.6),
and the defaults of base_config and PolicyConfig against each other."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from aepo_jax.rollout import PolicyConfig
from aepo_jax.train import _wiring, base_config, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The scripts' values (spec §1.7 table; §2.4 table for AEPO), every key a run reads. top_k 0 is verl's -1.
_COMMON = {
  "rollout.beam_size": 2,
  "rollout.branch_probability": 0.5,
  "rollout.entropy_weight": 0.2,
  "optim.lr": 1e-6,
  "optim.weight_decay": 0.01,
  "optim.grad_clip": 1.0,
  "optim.schedule": "constant",
  "optim.warmup_steps": 0,
  "algo.clip_low": 0.2,
  "algo.clip_high": 0.2,
  "algo.clip_c": 3.0,
  "algo.agg": "token-mean",
  "algo.advantage": "grpo",
  "algo.kl.coef": 0.0,
  "algo.kl.use_in_reward": False,
  "rollout.temperature": 1.0,
  "rollout.top_p": 1.0,
  "rollout.top_k": 0,
  "rollout.repetition_penalty": 1.0,
  "rollout.min_p": 0.0,
  "train.ppo_epochs": 1,
  "eval.temperature": 0.0,
  "reward.name": "deep_research",
  "rollout.entropy_window": 20,
  "rollout.topk_entropy": 10,
}
_DEEP = {
  "data.train": "hard_search_1k",
  "data.val": ("gaia_test", "hle_test"),
  "rollout.max_prompt_len": 2000,
  "tools.call_limit": 6,
  "train.epochs": 5,
}
_REASONING = {
  "data.train": "train_10k",
  "data.val": ("valid",),
  "rollout.max_prompt_len": 1536,
  "rollout.max_response_len": 4096,
  "train.epochs": 2,
  "data.prompts_per_step": 128,
  "train.ppo_mini_batch_size": 16,
  "rollout.n": 16,
  "rollout.initial_rollouts": 8,
}
SCRIPTS = {
  "ARPO_7B_Reasoning": {**_COMMON, **_REASONING, "tools.call_limit": 3, "tools.retry_count": 3},
  "ARPO_8B_Deepsearch": {
    **_COMMON,
    **_DEEP,
    "data.prompts_per_step": 128,
    "train.ppo_mini_batch_size": 16,
    "rollout.n": 16,
    "rollout.initial_rollouts": 8,
    "rollout.max_response_len": 10000,
    "tools.retry_count": 3,
  },
  "ARPO_14b_Deepsearch": {
    **_COMMON,
    **_DEEP,
    "data.prompts_per_step": 64,
    "train.ppo_mini_batch_size": 8,
    "rollout.n": 12,
    "rollout.initial_rollouts": 6,
    "rollout.max_response_len": 6192,
    "tools.retry_count": 3,
  },
  "AEPO_Qwen3_14B_DeepResearch": {
    **_COMMON,
    **_DEEP,
    "data.prompts_per_step": 64,
    "train.ppo_mini_batch_size": 8,
    "rollout.n": 12,
    "rollout.initial_rollouts": 6,
    "rollout.max_response_len": 6192,
    "tools.retry_count": 4,
  },
  "AEPO_Qwen25_7B_DeepResearch": {**_COMMON, **_REASONING, "tools.call_limit": 6, "tools.retry_count": 4},
}
# No AEPO 8B script was released: ARPO's 8B script with the AEPO yaml's retries.
SCRIPTS["AEPO_8B (ARPO_8B_Deepsearch values)"] = {**SCRIPTS["ARPO_8B_Deepsearch"], "tools.retry_count": 4}
# What the released code switches on and off (spec §1.2 quirks, §1.5 aggregation, §2.1-§2.3, §2.6).
RELEASED_ARPO = {
  "rollout.policy": "arpo",
  "rollout.mode": "faithful",
  "rollout.entropy_estimator": "official",
  "algo.loss": "arpo",
  "algo.aggregation": "verl",
  "algo.verl_dynamic_bsz": True,
  "algo.attribution": "soft",
  "algo.entropy_advantage_coef": 0.0,
  "algo.preserve_high_clip_grad": False,
}
RELEASED_AEPO = {
  "rollout.policy": "aepo",
  "rollout.mode": "faithful",
  "rollout.entropy_estimator": "official",
  "rollout.enable_dynamic_rollouts": False,
  "rollout.consecutive_penalty": 0.05,
  "rollout.premonitor_beta": 0.5,
  "rollout.probe_tokens": 50,
  "rollout.penalize_refills": True,
  "algo.loss": "aepo",
  "algo.aggregation": "verl",
  "algo.verl_dynamic_bsz": True,
  "algo.attribution": "soft",
  "algo.entropy_advantage_coef": 0.0,
  "algo.preserve_high_clip_grad": True,
}
# config file, model variant or None, the script it reproduces, the model's shape, AEPO or ARPO
CASES = [
  ("aepo_gaia.py", None, "AEPO_Qwen3_14B_DeepResearch", "qwen3-14b", RELEASED_AEPO),
  ("arpo_gaia.py", None, "ARPO_14b_Deepsearch", "qwen3-14b", RELEASED_ARPO),
  ("aepo_reasoning.py", None, "AEPO_Qwen25_7B_DeepResearch", "qwen2.5-7b", RELEASED_AEPO),
  ("arpo_gaia_8b.py", None, "ARPO_8B_Deepsearch", "qwen3-8b", RELEASED_ARPO),
  # no AEPO 8B / QwQ / 3B / Llama script was released: the nearest script's values (stated in each docstring)
  ("aepo_gaia_8b.py", None, "AEPO_8B (ARPO_8B_Deepsearch values)", "qwen3-8b", RELEASED_AEPO),
  ("aepo_gaia_qwq32b.py", None, "AEPO_Qwen3_14B_DeepResearch", "qwq-32b", RELEASED_AEPO),
  ("arpo_gaia_qwq32b.py", None, "ARPO_14b_Deepsearch", "qwq-32b", RELEASED_ARPO),
  ("arpo_reasoning.py", "qwen2.5-7b", "ARPO_7B_Reasoning", "qwen2.5-7b", RELEASED_ARPO),
  ("arpo_reasoning.py", "qwen2.5-3b", "ARPO_7B_Reasoning", "qwen2.5-3b", RELEASED_ARPO),
  ("arpo_reasoning.py", "llama-3.1-8b", "ARPO_7B_Reasoning", "llama-3.1-8b", RELEASED_ARPO),
]


def _get(config, dotted):
  node = config
  for part in dotted.split("."):
    node = node[part]
  return tuple(node) if isinstance(node, (list, tuple)) else node


def _load(name, *variants):
  arg = ",".join(v for v in variants if v)
  return load_config(os.path.join(ROOT, "configs", name), arg or None, num_devices=32)


def _diff(config, want):
  return {k: (_get(config, k), v) for k, v in want.items() if _get(config, k) != v}


@pytest.mark.parametrize("name,model,script,shape,switches", CASES, ids=[f"{c[0]}:{c[1] or ''}" for c in CASES])
def test_released_preset_is_the_script(name, model, script, shape, switches):
  c = _load(name, model, "released")
  assert _diff(c, SCRIPTS[script]) == {}
  assert _diff(c, switches) == {}
  assert c.model.shape == shape and not c.sft.enabled
  # The cold-start SFT the checkpoint came from (spec §2.4): LLaMA-Factory's cutoff, lr and schedule.
  assert (c.sft.max_len, c.sft.lr, c.sft.schedule, c.sft.warmup_frac) == (15000, 7e-6, "cosine", 0.1)


@pytest.mark.parametrize("name,model,script,shape,switches", CASES, ids=[f"{c[0]}:{c[1] or ''}" for c in CASES])
def test_paper_variant_differs_only_in_the_documented_switches(name, model, script, shape, switches):
  paper, released = _load(name, model), _load(name, model, "released")
  changed = {k for k, (a, b) in ((k, (_get(paper, k), _get(released, k))) for k in _flat_keys(paper)) if a != b}
  allowed = {"rollout.mode", "algo.aggregation", "algo.verl_dynamic_bsz"}
  # the released LLaMA-Factory cold-start recipe (common.released_sft): 16 per step, unpacked, results trained
  allowed |= {"sft.batch_size", "sft.packed_rows", "sft.mask_results", "sft.steps"}
  if switches is RELEASED_AEPO:
    allowed |= {"rollout.enable_dynamic_rollouts", "algo.entropy_advantage_coef"}
    assert paper.rollout.enable_dynamic_rollouts and paper.algo.entropy_advantage_coef == 0.2
  assert changed == allowed
  assert (paper.rollout.mode, paper.algo.aggregation) == ("corrected", "global")
  cold = _load(name, model, "released", "cold_start")
  assert cold.sft.enabled and cold.mode == "both" and cold.sft.source.endswith((".jsonl", ".parquet"))
  assert (cold.sft.batch_size, cold.sft.packed_rows, cold.sft.mask_results) == (16, 0, False)
  assert (paper.sft.batch_size, paper.sft.packed_rows, paper.sft.mask_results) == (64, 32, True)
  if name.endswith(("gaia.py", "8b.py", "32b.py")):  # deep search starts from the SFT checkpoint, not the base
    assert cold.model.name != released.model.name and released.model.name.endswith("-SFT")


def _flat_keys(c, prefix=""):
  for k, v in c.items():
    if hasattr(v, "items") and f"{prefix}{k}" != "model.overrides":
      yield from _flat_keys(v, f"{prefix}{k}.")
    else:
      yield f"{prefix}{k}"


@pytest.mark.parametrize("name", ["arpo_gaia.py", "aepo_gaia.py", "arpo_gaia_8b.py"])
def test_calls3_is_the_paper_snapshot_call_limit_and_nothing_else(name):
  """The presets follow the deep-search yaml after the 'fix tool call limit' commit (6 calls); ':calls3' is the yaml
  uploaded with the ARPO paper (3 calls), every other value the same (spec §1.7)."""
  later, early = _load(name, None, "released"), _load(name, None, "released", "calls3")
  assert (later.tools.call_limit, early.tools.call_limit) == (6, 3)
  changed = {k for k in _flat_keys(later) if _get(later, k) != _get(early, k)}
  assert changed == {"tools.call_limit"}


SETTING_KEYS = (
  "model.shape",
  "data.train",
  "data.prompts_per_step",
  "rollout.n",
  "rollout.max_prompt_len",
  "rollout.max_response_len",
  "tools.call_limit",
  "train.ppo_mini_batch_size",
  "optim.lr",
)


@pytest.mark.parametrize(
  "baseline,model,paper_config",
  [
    ("grpo_gaia.py", None, "arpo_gaia.py"),
    ("grpo_gaia.py", "qwen3-8b", "arpo_gaia_8b.py"),
    ("dapo_gaia.py", "qwq-32b", "arpo_gaia_qwq32b.py"),
    ("grpo_reasoning.py", None, "arpo_reasoning.py"),
    ("dapo_reasoning.py", "qwen2.5-3b", "arpo_reasoning.py:qwen2.5-3b"),
    ("reinforce_pp_reasoning.py", "llama-3.1-8b", "arpo_reasoning.py:llama-3.1-8b"),
  ],
)
def test_baselines_run_on_the_setting_of_the_paper_config_of_their_model(baseline, model, paper_config):
  """A baseline differs from ARPO on the same model only in the method: same data, budget, lengths, call limit."""
  name, _, arg = paper_config.partition(":")
  ours, theirs = _load(baseline, model), _load(name, arg or None)
  assert {k: _get(ours, k) for k in SETTING_KEYS} == {k: _get(theirs, k) for k in SETTING_KEYS}
  assert ours.rollout.policy == "none" and ours.rollout.initial_rollouts == ours.rollout.n
  assert ours.algo.loss != "arpo" and not ours.algo.preserve_high_clip_grad and ours.algo.entropy_advantage_coef == 0


def test_unknown_variant_names_the_choices():
  with pytest.raises(ValueError, match=r"unknown variant 'relased'.*'released'"):
    _load("aepo_gaia.py", "relased")
  with pytest.raises(ValueError, match="name one model"):
    _load("arpo_reasoning.py", "qwen2.5-3b", "llama-3.1-8b")


def test_base_config_and_policy_config_defaults_agree():
  ours = _wiring.policy_config(base_config())
  assert ours == PolicyConfig(), {
    f.name: (getattr(ours, f.name), getattr(PolicyConfig(), f.name))
    for f in dataclasses.fields(PolicyConfig)
    if getattr(ours, f.name) != getattr(PolicyConfig(), f.name)
  }
  c = base_config()
  # The defaults that are not the code's say so (docstrings), and `released` turns them into the code's.
  assert (c.rollout.mode, c.rollout.entropy_estimator, c.algo.aggregation) == ("corrected", "exact", "global")
  for doc in (PolicyConfig.__doc__, base_config.__doc__):
    assert "corrected" in doc and "exact" in doc and "released" in doc


def test_dry_run_prints_the_released_switches():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "launch/tpu_pod.py"),
      "--config=configs/aepo_gaia.py:released",
      "--config.model.name=smollm2-135m-instruct",
      "--dry_run",
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=env,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  printed = json.loads(out.stdout.strip().splitlines()[-1])
  assert printed["rollout"]["mode"] == "faithful"
  for key, want in RELEASED_AEPO.items():
    node = printed
    for part in key.split("."):
      node = node[part]
    assert node == want, key


@pytest.mark.parametrize(
  "key,value,needle",
  [
    (
      "algo.aggregation",
      "verll",
      "algo.aggregation='verll' is not registered; did you mean 'verl'? (known: global, verl)",
    ),
    ("algo.attribution", "hrad", "algo.attribution='hrad' is not registered; did you mean 'hard'?"),
    (
      "rollout.policy",
      "aepoo",
      "rollout.policy='aepoo' is not registered; did you mean 'aepo'? (known: aepo, arpo, none)",
    ),
    ("rollout.mode", "faithfull", "rollout.mode='faithfull' is not registered; did you mean 'faithful'?"),
    ("algo.agg", "token_mean", "algo.agg='token_mean' is not registered; did you mean 'token-mean'?"),
    ("rollout.repetition_penalty", 0.0, "rollout.repetition_penalty=0.0: must be a finite number > 0"),
    ("rollout.min_p", 1.5, "rollout.min_p=1.5: must be in [0, 1]"),
    ("eval.judge_url", "http://127.0.0.1:9/v1", "eval.judge_url and eval.judge_model go together"),
    ("eval.pass_k", -1, "eval.pass_k=-1 at temperature"),
    ("sft.source", "traces.json", "sft.source='traces.json': use 'suite', 'synthetic' or a .jsonl / .parquet"),
  ],
)
def test_choices_come_from_the_registries(key, value, needle):
  from aepo_jax.train import ConfigError, set_key, validate

  c = base_config()
  c.sft.enabled = True
  set_key(c, key, value)
  with pytest.raises(ConfigError) as e:
    validate(c)
  assert needle in str(e.value)


def test_the_trainer_builds_its_update_step_with_the_configured_aggregation(tmp_path, monkeypatch):
  from aepo_jax.testing import tiny_tokenizer
  from aepo_jax.train import _step, run

  class Built(Exception):
    pass

  def spy(*args, **kw):
    raise Built(kw["aggregation"])

  monkeypatch.setattr(_step, "make_update_step", spy)
  config = load_config(
    os.path.join(ROOT, "configs", "testing", "tiny_rl.py"),
    overrides={
      "workdir": str(tmp_path / "run"),
      "model.tokenizer": tiny_tokenizer(tmp_path / "tok"),
      "mode": "rl",
      "sft.enabled": False,
      "algo.aggregation": "verl",
    },
    num_devices=None,
  )
  with pytest.raises(Built, match="verl"):
    run(config)
