"""launch/export_hf.py: a training checkpoint exports to a directory that transformers loads as is (model,
tokenizer, chat template) with the project's logits; the base model's generation_config.json is carried over;
gs:// in and out go through the bucket; a missing checkpoint is an error that creates nothing."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from aepo_jax import model as model_lib
from aepo_jax import checkpoint as _checkpoint
from aepo_jax.train import _config, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "train"))
from test_checkpoint_gcs import BUCKET, gcs_emulator  # noqa: E402,F401  (the emulator fixture)

TOL = 1e-5  # max |logit difference|, float32 on both sides (observed about 2e-7 on logits of size ~1)
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 6 times 7?"}]
SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}


def _export_module():
  spec = importlib.util.spec_from_file_location("export_hf_cli", os.path.join(ROOT, "launch", "export_hf.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def export_cli():
  return _export_module()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  from aepo_jax.testing import tiny_tokenizer

  return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _save_run(workdir, config, model_cfg, params, step=2, ocdbt=True):
  """What the trainer writes: state {'params'}, meta {'config', 'model_config'}."""
  ckpt = _checkpoint.Checkpointer(f"{workdir}/checkpoints/rl", async_save=False, ocdbt=ocdbt)
  ckpt.save(
    step,
    {"params": params},
    {"config": _config.to_json(config), "model_config": _checkpoint.model_config_to_json(model_cfg)},
    force=True,
  )
  ckpt.close()
  return workdir


def _tiny_run(tmp_path, tok_dir, **overrides):
  """A checkpoint of configs/testing/tiny_rl.py (random init, model.tokenizer = the tiny tokenizer)."""
  from aepo_jax.train import _inputs

  config = load_config(
    os.path.join(ROOT, "configs", "testing", "tiny_rl.py"),
    num_devices=None,
    overrides={"workdir": str(tmp_path / "run"), "model.tokenizer": tok_dir, **overrides},
  )
  model_cfg, params, _ = _inputs.load_model(config)
  params = jax.device_get(params)
  return _save_run(config.workdir, config, model_cfg, params), model_cfg, params


def _check_loads_as_is(out, model_cfg, params, tokenizer_dir):
  """AutoModelForCausalLM logits == ours; AutoTokenizer encodes and renders the chat template as we do."""
  import torch
  import transformers

  hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  tokens = np.random.RandomState(0).randint(3, model_cfg.vocab_size, (2, 9)).astype(np.int32)
  with torch.no_grad():
    ref = hf(torch.tensor(tokens)).logits.numpy()
  ours = np.asarray(model_lib.forward(model_cfg, params, tokens))
  assert np.abs(ours - ref).max() <= TOL
  theirs = transformers.AutoTokenizer.from_pretrained(out)
  mine = model_lib.Tokenizer.from_dir(tokenizer_dir)
  text = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
  assert text == mine.render_chat(MESSAGES, add_generation_prompt=True)
  assert theirs(text, add_special_tokens=False)["input_ids"] == mine.encode(text, add_bos=False)
  assert theirs.eos_token == mine.eos_token
  return hf


def test_tiny_run_from_its_workdir(tmp_path, tok_dir, export_cli):
  workdir, model_cfg, params = _tiny_run(tmp_path, tok_dir)
  out = str(tmp_path / "hf")
  info = export_cli.export(workdir, out, max_shard_bytes=40_000)  # several shards + index
  assert info["step"] == 2 and info["tokenizer"] == tok_dir and info["generation_config"] is None
  assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
  assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
  from aepo_jax.data import system_prompt

  assert info["template"] == "compact"  # tiny_rl's data.template: the system prompt it trained with, shipped
  assert open(os.path.join(out, "system_prompt.txt")).read() == system_prompt("compact")
  hf = _check_loads_as_is(out, model_cfg, params, tok_dir)
  assert hf.generation_config.eos_token_id == [2] and hf.generation_config.pad_token_id == 0
  _, back = model_lib.load_hf(out)  # lossless in float32
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), params, back)


def test_named_model_run_ships_the_bundled_tokenizer_and_generation_config(tmp_path, export_cli):
  """A run of the embedded default names 'smollm2-135m-instruct': the export carries that model's tokenizer,
  chat template and generation_config.json (a tiny checkpoint with SmolLM2's vocabulary stands in for it)."""
  base = model_lib.pretrained_dir("smollm2-135m-instruct")
  config = _config.base_config()  # model.name = the bundled SmolLM2, init = pretrained
  model_cfg = model_lib.preset(
    "smollm2-135m", num_layers=2, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8
  )
  params = jax.device_get(model_lib.init_params(model_cfg, jax.random.PRNGKey(1)))
  workdir = _save_run(str(tmp_path / "run"), config, model_cfg, params, step=5)
  out = str(tmp_path / "hf")
  info = export_cli.export(f"{workdir}/checkpoints/rl/5", out, dtype="float32")
  assert info["tokenizer"] == base and info["generation_config"] == f"{base}/generation_config.json"
  _check_loads_as_is(out, model_cfg, params, base)
  with open(os.path.join(base, "generation_config.json")) as f, open(os.path.join(out, "generation_config.json")) as g:
    assert json.load(g) == json.load(f)


def _hf_base(tmp_path, tok_dir):
  """A local HF model directory as users bring one: weights, tokenizer with the chat template in
  chat_template.jinja (the transformers >= 4.43 layout), and sampling defaults in generation_config.json."""
  from aepo_jax.testing import tiny_hf_checkpoint

  base = tiny_hf_checkpoint("qwen3", str(tmp_path / "base"))
  shutil.copy(os.path.join(tok_dir, "tokenizer.json"), base)
  with open(os.path.join(tok_dir, "tokenizer_config.json")) as f:
    tok_cfg = json.load(f)
  with open(os.path.join(base, "chat_template.jinja"), "w") as f:
    f.write(tok_cfg.pop("chat_template"))
  with open(os.path.join(base, "tokenizer_config.json"), "w") as f:
    json.dump(tok_cfg, f)
  with open(os.path.join(base, "generation_config.json"), "w") as f:
    json.dump({"bos_token_id": 1, "eos_token_id": [2, 0], **SAMPLING}, f)
  return base


def test_hf_directory_run_carries_sampling_defaults_and_chat_template_file(tmp_path, tok_dir, export_cli):
  base = _hf_base(tmp_path, tok_dir)
  config = _config.base_config()
  config.model.name = base
  model_cfg, params = model_lib.load_hf(base)
  params = jax.device_get(params)
  workdir = _save_run(str(tmp_path / "run"), config, model_cfg, params)
  out = str(tmp_path / "hf")
  export_cli.export(f"{workdir}/checkpoints/rl", out, dtype="bfloat16")
  assert "chat_template.jinja" in os.listdir(out)
  with open(os.path.join(out, "generation_config.json")) as f:  # the base's, pad_token_id added from config.json
    assert json.load(f) == {"bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 0, **SAMPLING}
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  import transformers

  gen = transformers.GenerationConfig.from_pretrained(out)
  assert (gen.temperature, gen.top_p, gen.top_k, gen.do_sample) == (0.6, 0.95, 20, True)
  theirs = transformers.AutoTokenizer.from_pretrained(out)
  assert theirs.apply_chat_template(
    MESSAGES, tokenize=False, add_generation_prompt=True
  ) == model_lib.Tokenizer.from_dir(base).render_chat(MESSAGES)


def test_missing_checkpoint_is_an_error_that_creates_nothing(tmp_path, tok_dir, export_cli):
  missing = tmp_path / "runs" / "typo"
  with pytest.raises(export_cli.ExportError, match="does not exist"):
    export_cli.export(str(missing), str(tmp_path / "out"))
  assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()
  with pytest.raises(export_cli.ExportError, match="neither config.json"):
    export_cli.export(str(tmp_path), str(tmp_path / "out"))  # exists, but holds no checkpoint
  workdir, _, _ = _tiny_run(tmp_path, tok_dir)
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "x").write_text("x")
  with pytest.raises(export_cli.ExportError, match="not empty; choose a new directory or pass --overwrite"):
    export_cli.export(workdir, str(tmp_path / "full"))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "launch", "export_hf.py"),
      f"--checkpoint={missing}",
      f"--output={tmp_path / 'out'}",
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=180,
  )
  assert proc.returncode != 0 and f"--checkpoint={str(missing)!r} does not exist" in proc.stderr, proc.stderr[-2000:]
  assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


def test_gs_checkpoint_to_gs_output_through_the_command_line(tmp_path, tok_dir, gcs_emulator):
  """Checkpoint in the bucket, export into the bucket (no ./gs:/ directory appears), then the bucket's files
  load in transformers."""
  import fsspec

  workdir, model_cfg, params = _tiny_run(tmp_path, tok_dir)
  remote_run = f"gs://{BUCKET}/export-run"
  _save_run(
    remote_run,
    load_config(
      os.path.join(ROOT, "configs", "testing", "tiny_rl.py"), num_devices=None, overrides={"model.tokenizer": tok_dir}
    ),
    model_cfg,
    params,
    step=4,
    ocdbt=False,
  )  # one zarr per leaf: see test_checkpoint_gcs.py
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "launch", "export_hf.py"),
      f"--checkpoint={remote_run}",
      f"--output=gs://{BUCKET}/export/hf",
      "--max_shard_mb=0.05",
    ],
    capture_output=True,
    text=True,
    env=env,
    cwd=str(tmp_path),
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"exported {remote_run}/checkpoints/rl/4 to gs://{BUCKET}/export/hf" in proc.stdout
  assert not (tmp_path / "gs:").exists()
  fs = fsspec.filesystem("gs")
  names = sorted(os.path.basename(p) for p in fs.ls(f"{BUCKET}/export/hf", refresh=True))
  assert {
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
  } <= set(names) and sum(n.endswith(".safetensors") for n in names) > 1
  local = tmp_path / "downloaded"
  fs.get(f"{BUCKET}/export/hf/", str(local), recursive=True)
  _check_loads_as_is(str(local), model_cfg, params, tok_dir)
