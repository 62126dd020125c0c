"""Settings shared by the experiment configs: the official ARPO/AEPO script values (spec §1.7, §2.4).

Not an experiment itself. Each configs/*.py loads this file with `load_common()` and then states what it
changes, so the values of a run stay readable in its own file.
"""
import importlib.util
import pathlib

from aepo_jax.train import base_config


def load_sibling(name: str):
  """Import configs/<name>.py by path (configs/ is a folder of files, not a package)."""
  spec = importlib.util.spec_from_file_location(f"configs_{name}", pathlib.Path(__file__).with_name(f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def deep_search_14b():
  """Qwen3-14B deep search: AEPO_Qwen3_14B_DeepResearch.sh / ARPO 14B script (ppo_trainer_dr.yaml)."""
  c = base_config()
  # The cold-start SFT checkpoint of Qwen3-14B (ARPO-SFT-54K; spec §2.4) as a Hugging Face directory.
  c.model.name = "gs://YOUR_BUCKET/models/Qwen3-14B-SFT"
  c.model.init = "pretrained"
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "float32"
  c.model.remat = True
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 4  # 64 chips -> fsdp 16 x tensor 4
  c.data.train = "hard_search_1k"  # 1,071 prompts
  c.data.val = ("gaia_test", "hle_test")  # 103 + 100
  c.data.template = "code_search"
  c.data.prompts_per_step = 64  # train_batch_size
  c.tools.names = ("python", "search")
  c.tools.search_backend = "cache"  # replay ARPO's search_cache.json; use 'http' for a live retrieval server
  c.tools.call_limit = 6
  c.tools.retry_count = 4
  c.tools.python_timeout = 120.0
  c.rollout.n = 12
  c.rollout.initial_rollouts = 6
  c.rollout.beam_size = 2
  c.rollout.branch_probability = 0.5
  c.rollout.entropy_weight = 0.2
  c.rollout.max_prompt_len = 2000
  c.rollout.max_response_len = 6192
  c.rollout.temperature, c.rollout.top_p, c.rollout.top_k = 1.0, 1.0, 0
  c.reward.name = "deep_research"
  c.algo.advantage = "grpo"
  c.algo.clip_low, c.algo.clip_high, c.algo.clip_c = 0.2, 0.2, 3.0
  c.algo.agg = "token-mean"
  c.algo.kl.name, c.algo.kl.coef, c.algo.kl.use_in_reward = "low_var_kl", 0.0, False  # effectively no KL (§1.5)
  c.optim.lr = 1e-6
  c.optim.weight_decay = 0.01
  c.optim.grad_clip = 1.0
  c.optim.schedule = "constant"
  c.optim.warmup_steps = 0
  c.train.epochs = 5
  c.train.steps = 0  # = 5 epochs * ceil(1071 / 64) = 85 steps
  c.train.ppo_mini_batch_size = 8  # prompts -> 8 optimizer steps per rollout step
  c.train.micro_batch_size = 16  # sequences; a multiple of data*fsdp (16 on 64 chips): 6 micro-batches per update
  c.train.ppo_epochs = 1
  c.train.eval_every = 5
  c.eval.temperature = 0.0
  c.sft.enabled = False  # the released runs start from an SFT checkpoint trained elsewhere
  c.checkpoint.every_steps = 5
  c.checkpoint.best_metric = "eval/accuracy"
  return c


def baseline_14b(loss: str, clip_low: float, clip_high: float, clip_c: float):
  """A baseline of AEPO's comparison (spec §3) on the deep-search setting: plain group sampling (policy
  'none', all n samples global), the given loss and clip values, no AEPO-specific terms."""
  c = deep_search_14b()
  c.rollout.policy = "none"
  c.rollout.initial_rollouts = c.rollout.n
  c.rollout.enable_dynamic_rollouts = False
  c.algo.loss = loss
  c.algo.entropy_advantage_coef = 0.0
  c.algo.preserve_high_clip_grad = False
  c.algo.clip_low, c.algo.clip_high, c.algo.clip_c = clip_low, clip_high, clip_c
  return c


def reasoning_7b():
  """Qwen2.5-7B reasoning: AEPO_Qwen25_7B_DeepResearch.sh / ARPO 7B script (ppo_trainer.yaml)."""
  c = deep_search_14b()
  c.model.name = "gs://YOUR_BUCKET/models/Qwen2.5-7B-Instruct"
  c.data.train = "train_10k"  # 5k math + 5k QA
  c.data.val = ("valid",)  # 180
  c.data.prompts_per_step = 128
  c.tools.call_limit = 3
  c.rollout.n = 16
  c.rollout.initial_rollouts = 8
  c.rollout.max_prompt_len = 1536
  c.rollout.max_response_len = 4096
  c.train.epochs = 2
  c.train.ppo_mini_batch_size = 16
  return c
