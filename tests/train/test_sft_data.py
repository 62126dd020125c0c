"""Cold-start SFT examples are the rollout's own prompt followed by the demo's turn, with tool results masked.

The prompt an SFT example starts with must be token for token the prompt the rollout gives the policy
(`_wiring.prompt_ids`): a demo that also carried its answer inside the prompt taught the model to copy
(training loss near zero, nothing learnt), which is how the embedded default once failed.
"""

import os

import pytest

from aepo_jax.train import load_config
from aepo_jax.train import _inputs, _wiring

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  from aepo_jax.testing import tiny_tokenizer

  tok_dir = tiny_tokenizer(tmp_path_factory.mktemp("tok"))
  config = load_config(
    os.path.join(ROOT, "configs", "testing", "tiny_rl.py"),
    overrides={"model.tokenizer": tok_dir, "data.suite.mix": (0.4, 0.4, 0.2), "data.suite.tool_demo_fraction": 0.5},
    num_devices=None,
  )
  model_cfg, _, tok = _inputs.load_model(config)
  return config, model_cfg, tok


def test_sft_example_is_rollout_prompt_then_turn_with_tool_results_masked(setup):
  config, model_cfg, tok = setup
  suite = _inputs._suite(config)
  examples = _inputs.sft_examples(config, tok, model_cfg)
  assert len(examples) == len(suite.demos)
  eos = model_cfg.eos_token_ids[0]
  kinds = set()
  for demo, (tokens, mask) in zip(suite.demos, examples):
    prompt = _wiring.prompt_ids(config, tok, demo.example)
    assert tokens[: len(prompt)].tolist() == prompt  # the rollout's prompt, nothing more
    assert not mask[: len(prompt)].any()
    pos = len(prompt)
    for kind, text in demo.segments:
      ids = tok.encode_continuation(text)
      assert tokens[pos : pos + len(ids)].tolist() == ids
      assert (mask[pos : pos + len(ids)] == (kind == "model")).all()
      pos += len(ids)
    assert tokens[pos:].tolist() == [eos] and mask[pos] == 1 and pos + 1 == len(tokens)
    assert demo.response not in tok.decode(prompt)
    kinds.add(len(demo.segments) > 1)
  assert kinds == {True, False}  # tool-using and direct-answer demos both present


def test_tool_demo_fraction_changes_only_the_demos(setup):
  from aepo_jax.data import generate_suite

  a = generate_suite(3, 40, 8, tool_demo_fraction=1.0)
  b = generate_suite(3, 40, 8, tool_demo_fraction=0.25)
  assert [e.question for e in a.train + a.heldout] == [e.question for e in b.train + b.heldout]
  assert all(len(d.segments) > 1 for d in a.demos)
  direct = [d for d in b.demos if len(d.segments) == 1]
  assert 0.6 < len(direct) / len(b.demos) < 0.9
  for d in direct:
    assert d.response == f"<think> I know this. </think> <answer> \\boxed{{{d.example.answers[0]}}} </answer>"
  with pytest.raises(ValueError, match="tool_demo_fraction"):
    generate_suite(3, 4, 2, tool_demo_fraction=1.5)


def test_suite_directories_of_killed_processes_are_swept(tmp_path):
  """A run killed before its atexit leaves its generated corpus behind; the next run removes those of dead
  processes and nothing else."""
  import subprocess

  dead = subprocess.Popen(["true"])
  dead.wait()
  stale = tmp_path / f"aepo_jax_suite_{dead.pid}_abc"
  live = tmp_path / f"aepo_jax_suite_{os.getppid()}_def"
  other = tmp_path / "aepo_jax_suite_notapid"
  for d in (stale, live, other):
    (d / "corpus").mkdir(parents=True)
  _inputs._sweep_stale_suites(str(tmp_path))
  assert not stale.exists() and live.exists() and other.exists()


def test_the_generated_suite_belongs_to_the_run_scope(monkeypatch):
  monkeypatch.setattr(_inputs, "_SUITES", {})  # suites cached outside any scope by earlier tests stay theirs
  config = load_config("configs/testing/tiny_rl.py")
  with _inputs.run_scope():
    suite = _inputs._suite(config)
    assert _inputs._suite(config) is suite  # shared within the run
    corpus_dir = suite.corpus_path.parent
    assert corpus_dir.exists()
  assert not corpus_dir.exists() and not _inputs._SUITES
