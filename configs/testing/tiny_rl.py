"""A tiny random-init model through the whole main job: SFT on the suite's demos, then RL with real tools.

Command:  python launch/tpu_pod.py --config=configs/testing/tiny_rl.py --config.workdir=/tmp/tiny_rl \
              --config.model.tokenizer=DIR      # DIR: aepo_jax.testing.tiny_tokenizer(DIR)
Hardware: any CPU. Data/model: the generated suite, a 2-layer random model, the tiny byte-level tokenizer.
Time: about a minute, most of it compilation. Used by tests/train/test_rl_loop.py.
Expected: every phase runs and writes its metrics and checkpoints; nothing is learnt (the model is random).
"""

from aepo_jax.train import base_config, load_sibling

tiny_sft = load_sibling(__file__, "tiny_sft")


def get_config(arg=None):
  del arg
  c = tiny_sft.tiny_model(base_config(), vocab_size=320, eos_id=2)  # the tiny tokenizer's ids
  c.mode = "both"
  c.data.train = "suite"
  c.data.val = ("suite",)
  c.data.template = "compact"
  c.data.suite.n_train = 16
  c.data.suite.n_heldout = 4
  c.data.suite.mix = (0.5, 0.5, 0.0)
  c.data.suite.top_k = 1
  c.data.prompts_per_step = 2
  c.tools.names = ("python", "search")
  c.tools.python_timeout = 10.0
  c.tools.search_backend = "local"
  c.tools.search_topk = 1
  c.tools.call_limit = 2
  c.sft.enabled = True
  c.sft.source = "suite"
  c.sft.steps = 2
  c.sft.batch_size = 8
  c.sft.micro_batch_size = 8
  c.sft.max_len = 512
  c.sft.lr = 1e-3
  c.rollout.policy = "aepo"
  c.rollout.n = 4
  c.rollout.initial_rollouts = 2
  c.rollout.beam_size = 2
  c.rollout.enable_dynamic_rollouts = False
  c.rollout.max_prompt_len = 240
  c.rollout.max_response_len = 32
  c.rollout.decode_chunk = 8
  c.rollout.max_slots = 8
  c.algo.loss = "aepo"
  c.optim.lr = 1e-3
  c.train.steps = 2
  c.train.ppo_mini_batch_size = 2
  c.train.micro_batch_size = 8  # rows split over up to 8 devices (the tests use 8 fake ones)
  c.eval.batch_size = 4
  c.checkpoint.every_steps = 1
  c.checkpoint.keep = 2
  c.metrics.tensorboard = False
  c.metrics.progress = False
  return c
