"""load_hf / save_hf: both config.json forms, sharded checkpoints, the export round trip, and bad input."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from aepo_jax import model

TOL = 1e-4


def _tokens(b=2, t=10, seed=0):
  return np.random.RandomState(seed).randint(3, 320, (b, t)).astype(np.int32)


def _copy(src, dst):
  shutil.copytree(src, dst)
  return str(dst)


def _same_params(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_transformers4_and_5_config_forms_agree(tiny_checkpoint, tmp_path):
  path = tiny_checkpoint("llama_rope")
  with open(os.path.join(path, "config.json")) as f:
    v5 = json.load(f)
  assert "rope_parameters" in v5 and "rope_scaling" not in v5  # what transformers 5 writes
  old = _copy(path, tmp_path / "v4")
  v4 = dict(v5)
  params = dict(v4.pop("rope_parameters"))
  v4["rope_theta"] = params.pop("rope_theta")
  v4["rope_scaling"] = params
  with open(os.path.join(old, "config.json"), "w") as f:
    json.dump(v4, f)
  c5, p5 = model.load_hf(path)
  c4, p4 = model.load_hf(old)
  assert c4 == c5 and c5.rope_theta == 50000.0 and c5.rope_scaling_dict["rope_type"] == "llama3"
  _same_params(p4, p5)


def test_from_hf_config_defaults():
  c = model.from_hf_config(
    {
      "architectures": ["Qwen3ForCausalLM"],
      "vocab_size": 8,
      "hidden_size": 16,
      "intermediate_size": 8,
      "num_hidden_layers": 1,
      "num_attention_heads": 2,
      "eos_token_id": [5, 6],
      "rope_scaling": {"type": "linear", "factor": 2.0},
    }
  )
  assert (c.family, c.head_dim, c.num_kv_heads, c.qk_norm, c.attention_bias) == ("qwen3", 128, 2, True, False)
  assert c.eos_token_ids == (5, 6) and c.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}
  assert model.from_hf_config(model.to_hf_config(c)) == c


def test_sharded_checkpoint_with_index(tiny_checkpoint, tmp_path):
  from aepo_jax import testing

  path = testing.tiny_hf_checkpoint("qwen2", tmp_path / "sharded", max_shard_size="100KB")
  assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
  assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
  config, params = model.load_hf(path)
  single = testing.tiny_hf_checkpoint("qwen2", tmp_path / "single")
  _same_params(params, model.load_hf(single)[1])


@pytest.mark.parametrize("family,tie", [("llama_rope", True), ("qwen2", False), ("qwen3", True)])
def test_save_hf_round_trip_through_transformers(tiny_checkpoint, tmp_path, family, tie):
  import torch
  import transformers

  config, params = model.load_hf(tiny_checkpoint(family, tie))
  out = model.save_hf(config, params, str(tmp_path / "export"), max_shard_bytes=60_000)
  assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))  # several shards + index
  assert os.path.isfile(os.path.join(out, "generation_config.json"))
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert type(hf).__name__ == model.to_hf_config(config)["architectures"][0]
  tokens = _tokens()
  with torch.no_grad():
    ref = hf(torch.tensor(tokens)).logits.numpy()
  ours = np.asarray(model.forward(config, params, tokens))
  assert np.abs(ours - ref).max() <= TOL
  config2, params2 = model.load_hf(out)
  assert config2 == config
  _same_params(params, params2)  # the export is lossless


def test_save_hf_bfloat16(tiny_checkpoint, tmp_path):
  config, params = model.load_hf(tiny_checkpoint("qwen3"))
  out = model.save_hf(config, params, str(tmp_path / "bf16"), dtype="bfloat16")
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  _, p16 = model.load_hf(out)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-2, atol=1e-3), params, p16)


# ---------------------------------------------------------------------------------------------------- bad input
def test_missing_directory_and_config(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    model.load_hf(str(tmp_path / "nope"))
  with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
    model.load_hf(str(tmp_path))


def test_unknown_architecture(tiny_checkpoint, tmp_path):
  path = _copy(tiny_checkpoint("llama"), tmp_path / "ckpt")
  cfg_file = os.path.join(path, "config.json")
  with open(cfg_file) as f:
    cfg = json.load(f)
  cfg["architectures"] = ["MistralForCausalLM"]
  with open(cfg_file, "w") as f:
    json.dump(cfg, f)
  with pytest.raises(ValueError, match=r"config\.json.*MistralForCausalLM.*LlamaForCausalLM"):
    model.load_hf(path)


def test_missing_weights(tiny_checkpoint, tmp_path):
  path = _copy(tiny_checkpoint("llama"), tmp_path / "ckpt")
  os.remove(os.path.join(path, "model.safetensors"))
  with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights in"):
    model.load_hf(path)


def test_partial_checkpoint_names_tensor(tiny_checkpoint, tmp_path):
  from safetensors.numpy import load_file, save_file

  path = _copy(tiny_checkpoint("qwen2"), tmp_path / "ckpt")
  weights = os.path.join(path, "model.safetensors")
  tensors = load_file(weights)
  del tensors["model.layers.1.self_attn.k_proj.bias"]
  save_file(tensors, weights, metadata={"format": "pt"})
  with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias.*missing"):
    model.load_hf(path)


def test_missing_shard_listed_in_index(tmp_path):
  from aepo_jax import testing

  path = testing.tiny_hf_checkpoint("llama", tmp_path / "sharded", max_shard_size="100KB")
  shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[-1]
  os.remove(os.path.join(path, shard))
  with pytest.raises(FileNotFoundError, match=f"{shard}.*listed in.*index"):
    model.load_hf(path)


def test_mismatched_shape_names_tensor_and_shapes(tiny_checkpoint, tmp_path):
  path = _copy(tiny_checkpoint("llama"), tmp_path / "ckpt")
  cfg_file = os.path.join(path, "config.json")
  with open(cfg_file) as f:
    cfg = json.load(f)
  cfg["intermediate_size"] = 96
  with open(cfg_file, "w") as f:
    json.dump(cfg, f)
  expected = r"down_proj\.weight.*model\.safetensors has shape \[64, 128\] but config\.json implies \[64, 96\]"
  with pytest.raises(ValueError, match=expected):
    model.load_hf(path)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_names_file(tiny_checkpoint, tmp_path, damage):
  path = _copy(tiny_checkpoint("llama"), tmp_path / "ckpt")
  weights = os.path.join(path, "model.safetensors")
  data = open(weights, "rb").read()
  with open(weights, "wb") as f:
    f.write(b"\x00garbage" * 64 if damage == "garbage" else data[: len(data) // 2])
  with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
    model.load_hf(path)
