"""A tiny random-init model trained with SFT on the synthetic copy task: the config of the resume tests.

Command:  python launch/tpu_pod.py --config=configs/testing/tiny_sft.py --config.workdir=/tmp/tiny_sft
Hardware: any CPU. Data/model: none (random init, synthetic data).
Time: well under a minute, most of it compilation.
Expected: sft/nll falls from ln(256) = 5.55 to about 5.2 in 12 steps; rerunning the same command after a kill
  resumes from the last checkpoint and reaches bit-identical parameters (tests/train/test_resume.py).
"""

from aepo_jax.train import base_config


def tiny_model(c, *, vocab_size: int, eos_id: int):
  """A 2-layer random model of SmolLM2's architecture (also configs/testing/tiny_rl.py's)."""
  c.model.name = "smollm2-135m"
  c.model.init = "random"
  with c.model.overrides.unlocked():
    c.model.overrides.update(
      dict(
        num_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=vocab_size,
        pad_token_id=0,
        eos_token_ids=(eos_id,),
        bos_token_id=None,
      )
    )
  c.mesh.data = -1
  return c


def get_config(arg=None):
  c = tiny_model(base_config(), vocab_size=256, eos_id=1)
  c.mode = "sft"
  c.sft.enabled = True
  c.sft.source = "synthetic"
  c.sft.steps = 12
  c.sft.lr = 3e-3
  c.sft.batch_size = 8
  c.sft.micro_batch_size = 8
  c.sft.max_len = 32
  c.sft.warmup_frac = 0.0
  c.sft.schedule = "constant"
  c.checkpoint.every_steps = 3
  c.checkpoint.keep = 2
  c.checkpoint.best_metric = ""
  c.metrics.tensorboard = False
  c.metrics.progress = False
  c.data.val = ()
  return c
