"""Fixtures: a tiny tokenizer whose tool tags are single tokens, a tiny Llama, a scripted "bigram" policy that
follows the tool protocol deterministically, an Orbax checkpoint of the tiny model, and a local GCS emulator."""

import os
import shutil
import socket
import subprocess
import time

import jax
import pytest

from aepo_jax.model import ModelConfig, Tokenizer, init_params

from eval_helpers import _ids, bigram_params, free_port, save_checkpoint

TAGS = ["<python>", "</python>", "<result>", "</result>", "<answer>", "</answer>", "\\boxed{18}"]


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
  """The tiny ChatML BPE tokenizer plus the protocol tags (and one answer) as added single tokens."""
  from tokenizers import Tokenizer as HFTok

  from aepo_jax.testing import tiny_tokenizer

  path = tiny_tokenizer(tmp_path_factory.mktemp("tok"))
  tok = HFTok.from_file(os.path.join(path, "tokenizer.json"))
  tok.add_tokens(TAGS)
  tok.save(os.path.join(path, "tokenizer.json"))
  return path


@pytest.fixture(scope="session")
def tokenizer(tok_dir):
  return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="session")
def tiny_config(tokenizer):
  return ModelConfig(
    family="llama",
    vocab_size=tokenizer.vocab_size,
    hidden_size=64,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    eos_token_ids=(2,),
    pad_token_id=0,
  )


@pytest.fixture(scope="session")
def tiny_params(tiny_config):
  return jax.device_get(init_params(tiny_config, jax.random.PRNGKey(0)))


@pytest.fixture(scope="session")
def scripted(tiny_config, tiny_params, tokenizer):
  """Two scripted policies: 'answer' makes one python call then answers \\boxed{18} and stops (EOS);
  'loop' calls python forever (the eval limit must refuse calls 6, 7, ...)."""
  prompt = tokenizer.apply_chat_template([{"role": "user", "content": "q"}])
  last = prompt[-1]  # the generation prompt's final token
  py, py_end, res_end, ans, ans_end, box = _ids(
    tokenizer, "<python>", "</python>", "</result>", "<answer>", "</answer>", "\\boxed{18}"
  )
  one = tokenizer.encode_continuation("1")[0]
  eos = tokenizer.eos_id
  base = {last: py, py: one, one: py_end}
  return {
    "answer": bigram_params(
      tiny_config, tiny_params, tokenizer, {**base, res_end: ans, ans: box, box: ans_end, ans_end: eos}
    ),
    "loop": bigram_params(tiny_config, tiny_params, tokenizer, {**base, res_end: py}),
  }


@pytest.fixture(scope="session")
def orbax_ckpt(tmp_path_factory, tiny_config, tiny_params, tok_dir):
  """An Orbax checkpoint as the trainer writes it: state {'params'}, meta {model_config, config}."""
  root = tmp_path_factory.mktemp("run")
  save_checkpoint(str(root / "checkpoints" / "rl"), tiny_config, tiny_params, tok_dir)
  return str(root)


@pytest.fixture()
def gcs_emulator(tmp_path, monkeypatch):
  """`gcp-storage-emulator` on a free loopback port with bucket 'test-bucket' (docs/environment.md recipe)."""
  exe = shutil.which("gcp-storage-emulator")
  if exe is None:
    pytest.fail("gcp-storage-emulator is not installed (pip install gcp-storage-emulator).")
  port = free_port()
  url = f"http://127.0.0.1:{port}"
  proc = subprocess.Popen(
    [
      exe,
      "-d",
      str(tmp_path / "gcs"),
      "start",
      "--host",
      "127.0.0.1",
      "--port",
      str(port),
      "--default-bucket",
      "test-bucket",
    ],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  env = {
    "TENSORSTORE_GCS_HTTP_URL": url,
    "STORAGE_EMULATOR_HOST": url,
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    "NO_GCE_CHECK": "true",
    "GCE_METADATA_HOST": "127.0.0.1:9",
    "GCE_METADATA_IP": "127.0.0.1:9",
    "GCE_METADATA_ROOT": "127.0.0.1:9",
  }
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  deadline = time.time() + 30
  while time.time() < deadline:
    try:
      socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
      break
    except OSError:
      time.sleep(0.2)
  else:
    proc.kill()
    pytest.fail("gcp-storage-emulator did not start")
  yield "gs://test-bucket"
  proc.terminate()
  try:
    proc.wait(timeout=10)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
