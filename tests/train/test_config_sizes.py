"""Non-positive sizes are refused when the config is loaded (they used to pass --dry_run and fail, or not, deep
inside the model or the data pipeline); each error names the key."""

import os
import subprocess
import sys

import pytest

from aepo_jax.train import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "testing", "tiny_sft.py")


@pytest.mark.parametrize(
  "key,value,needle",
  [
    ("sft.batch_size", -8, "sft.batch_size=-8: demonstrations per step must be >= 1."),
    ("sft.batch_size", 0, "sft.batch_size=0: demonstrations per step must be >= 1."),
    ("sft.max_len", -1, "sft.max_len=-1: tokens per row must be >= 2"),
    ("sft.max_len", 0, "sft.max_len=0: tokens per row must be >= 2"),
    ("model.overrides.hidden_size", -32, "model.overrides.hidden_size=-32: must be a positive integer."),
    ("model.overrides.num_layers", 0, "model.overrides.num_layers=0: must be a positive integer."),
    ("model.overrides.vocab_size", 2.5, "model.overrides.vocab_size=2.5: must be a positive integer."),
    ("checkpoint.on_corrupt", "ignore", "checkpoint.on_corrupt='ignore': 'fallback' or 'stop'."),
  ],
)
def test_non_positive_sizes_are_refused(key, value, needle):
  with pytest.raises(ConfigError) as e:
    load_config(TINY, overrides={key: value})
  assert needle in str(e.value)


def test_dry_run_refuses_a_negative_batch_size():
  out = subprocess.run(
    [sys.executable, "launch/tpu_pod.py", f"--config={TINY}", "--config.sft.batch_size=-8", "--dry_run"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert out.returncode != 0 and "sft.batch_size=-8: demonstrations per step must be >= 1." in out.stderr


def test_the_tiny_config_still_loads():
  assert load_config(TINY).checkpoint.on_corrupt == "fallback"
