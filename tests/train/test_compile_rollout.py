"""`launch/compile.py` compiles the trainer's own rollout engine: both are built by `aepo_jax.rollout.build_engine`
from `rollout_settings(config)`, so the stop sequences (the tool tags through the run's tokenizer), EOS ids,
sampling, slots, cache length and entropy settings agree; only what the platform resolves ('auto' KV layout:
paged on TPU, dense on CPU) may differ."""

import importlib.util
import os

import jax
import pytest

from aepo_jax.parallel import local_mesh
from aepo_jax.rollout import describe_engine
from aepo_jax.testing import tiny_tokenizer
from aepo_jax.train import _compile, _inputs, _wiring, load_sibling

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLATFORM_RESOLVED = ("kv_layout", "page_size", "num_pages")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  tiny_rl = load_sibling(os.path.join(ROOT, "configs", "testing", "x.py"), "tiny_rl")
  config = tiny_rl.get_config()
  config.model.tokenizer = tiny_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=320)
  config.rollout.temperature = 0.7  # not the defaults, so a dropped setting shows
  config.rollout.top_k = 5
  config.rollout.entropy_window = 7
  model_cfg, _, tokenizer = _inputs.load_model(config)
  tools = _wiring.make_toolset(config)
  trainer = _wiring.make_rollout(config, model_cfg, tokenizer, tools)
  return config, trainer


def _same(a: dict, b: dict):
  for key in PLATFORM_RESOLVED:
    a.pop(key), b.pop(key)
  assert a == b


def test_compile_builds_the_trainers_engine_on_cpu(run):
  config, trainer = run
  mesh = local_mesh({k: int(v) for k, v in config.rollout.mesh.items()})
  engine, source = _compile.rollout_engine(config, _compile.model_config(config), mesh, hosts=1)
  assert source == "tokenizer"
  ours, theirs = describe_engine(engine), describe_engine(trainer.engine)
  assert ours["stop_sequences"] and len(ours["stop_sequences"]) >= 2  # </python> and </search> at least
  assert ours["sampling"]["temperature"] == 0.7 and ours["sampling"]["top_k"] == 5
  assert ours["entropy_window"] == 7 and ours["max_slots"] == config.rollout.max_slots
  assert ours["eos_ids"] == [2]  # the model's (tiny_rl's eos_id), as the trainer's
  assert ours == theirs  # same platform: everything, the KV layout included


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (pip install -e '.[tpu]')")
def test_compile_builds_the_trainers_engine_on_a_tpu_host(run):
  config, trainer = run
  devices = _compile.topology_devices("v5e:2x2")
  host = _compile.host_devices("v5e:2x2", devices)
  mesh = local_mesh({k: int(v) for k, v in config.rollout.mesh.items()}, host)
  engine, source = _compile.rollout_engine(config, _compile.model_config(config), mesh, hosts=1)
  assert source == "tokenizer" and engine.mesh.devices.flat[0].platform == "tpu"
  _same(describe_engine(engine), describe_engine(trainer.engine))
  report = _compile.compile_plan(config, "v5e:2x2", programs=("decode",))
  assert report["rollout"]["stop_sequences"] == "tokenizer"
  assert report["rollout"]["slots"] == trainer.engine.max_slots and report["programs"]["decode"].peak_gb > 0
  assert jax.default_backend() == "cpu"  # compiled for the slice on this CPU host


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (pip install -e '.[tpu]')")
def test_compile_compiles_every_program_of_the_run_on_two_hosts(run):
  """The tiny run (SFT then RL) on v5p:2x2x2 (2 hosts of 4 chips, a mesh across them): by default every program it
  runs, the weight copy onto each host's rollout devices included; its output per chip is the rollout copy. (No
  weight_cast: the tiny run rolls out in its float32; aepo_gaia's test compiles the bf16 cast.)"""
  config, trainer = run
  report = _compile.compile_plan(config, "v5p:2x2x2")
  programs = report["programs"]
  expected = {"sft", "update", "logprob", "weight_copy", "prefill", "decode"}
  assert set(programs) == expected | ({"decode_compact"} if trainer.engine.compact_slots else set()), set(programs)
  assert report["rollout"]["hosts"] == 2 and programs["weight_copy"].devices == 8
  copy = programs["weight_copy"]
  # Each chip holds its host's rollout copy (TPU tiles pad the tiny model's small dimensions: more, never less).
  assert report["rollout"]["weights_gb"] <= copy.output_gb < 4 * report["rollout"]["weights_gb"]
  assert copy.hbm_gb > 0  # (the tiny run's training mesh replicates its weights: no collective is needed)
  for name, p in programs.items():
    assert p.peak_gb > 0 and p.hbm_gb > 0, name
  assert 0 < report["rollout"]["decode_hbm_ratio"]
