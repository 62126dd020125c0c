"""`eval.judge_checkpoint`: the trainer serves a judge model itself (aepo_jax.serve on 127.0.0.1) and points the
validation's OpenAI-compatible judge client at it."""

import pytest


def test_a_config_serves_its_judge(tmp_path):
  from aepo_jax import rewards
  from aepo_jax.testing import tiny_hf_checkpoint, tiny_tokenizer
  from aepo_jax.train import base_config
  from aepo_jax.train._validation import serve_judge

  ckpt = tiny_hf_checkpoint("qwen2", tmp_path / "judge", vocab_size=320)
  tiny_tokenizer(ckpt)  # the checkpoint's own tokenizer files, so it serves as is
  config = base_config()
  config.eval.judge_checkpoint = ckpt
  served, server = serve_judge(config)
  try:
    assert served.eval.judge_url == server.url + "/v1" and served.eval.judge_model == ckpt
    assert served.eval.judge_checkpoint == "" and config.eval.judge_checkpoint == ckpt  # the caller's is untouched
    judge = rewards.OpenAICompatibleJudge(served.eval.judge_url, served.eval.judge_model, timeout=120, retries=0)
    reply = judge.complete("Is 2 + 2 = 4? Answer Correct or Incorrect.")
    assert isinstance(reply, str)  # a random model's words, from our own server through the judge's client
  finally:
    server.shutdown(drain_s=1.0)


def test_judge_checkpoint_and_judge_url_exclude_each_other():
  from aepo_jax.train import ConfigError, base_config, validate

  config = base_config()
  config.eval.judge_checkpoint = "smollm2-135m-instruct"
  config.eval.judge_url, config.eval.judge_model = "http://127.0.0.1:9/v1", "m"
  with pytest.raises(ConfigError, match="eval.judge_checkpoint serves a judge here"):
    validate(config)
