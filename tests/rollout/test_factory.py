"""make_engine: the settings every engine user shares (stop strings, EOS ids, greedy settings, the mesh rule)."""

import jax
import pytest

from aepo_jax.parallel import make_mesh
from aepo_jax.rollout import SamplingParams, make_engine, stop_sequences_from_strings
from aepo_jax.testing import tiny_model_config

CFG = tiny_model_config(vocab_size=320, num_layers=1, eos_token_ids=(2,), pad_token_id=0)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  from aepo_jax.model import Tokenizer
  from aepo_jax.testing import tiny_tokenizer

  return Tokenizer.from_dir(tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def test_stop_strings_follow_the_explicit_sequences(tok):
  eng = make_engine(CFG, max_slots=2, max_len=32, tokenizer=tok, stop_strings=["</python>"], stop_sequences=[[7, 8]])
  assert eng.stop_sequences[0] == (7, 8)
  assert list(eng.stop_sequences[1:]) == [tuple(s) for s in stop_sequences_from_strings(tok, ["</python>"])]
  with pytest.raises(ValueError, match="need a tokenizer"):
    make_engine(CFG, max_slots=2, max_len=32, stop_strings=["</python>"])


def test_eos_ids_are_the_models_unless_the_tokenizers_are_asked_for(tok):
  assert make_engine(CFG, max_slots=1, max_len=8, tokenizer=tok).eos_ids == (2,)
  assert make_engine(CFG, max_slots=1, max_len=8, eos_ids=(5, 2)).eos_ids == (5, 2)
  both = make_engine(CFG, max_slots=1, max_len=8, tokenizer=tok, tokenizer_eos=True).eos_ids
  assert both == tuple(dict.fromkeys([*tok.eos_ids, 2]))


def test_greedy_drops_the_truncations_and_a_one_device_mesh_is_dropped():
  greedy = make_engine(CFG, max_slots=1, max_len=8, sampling=SamplingParams(0.0, 0.9, 20, 0.1, 1.1))
  assert greedy.sampling == SamplingParams(0.0, 1.0, 0, 0.0, 1.1)  # the penalty changes the argmax: kept
  sampled = SamplingParams(0.6, 0.95, 20, 0.0, 1.1)
  assert make_engine(CFG, max_slots=1, max_len=8, sampling=sampled).sampling == sampled
  one = make_mesh((1, 1, 1), devices=jax.devices()[:1])
  assert make_engine(CFG, max_slots=1, max_len=8, mesh=one).mesh is None
