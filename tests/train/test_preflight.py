"""Preflight: `--dry_run` (and the start of `run()`) fails on mistakes that would otherwise surface only after the
model has loaded and SFT has run, naming the key and the fix; a config that can run passes."""

import glob
import json
import os
import subprocess
import sys
import time

import pytest

from aepo_jax.train import base_config, load_config
from aepo_jax.train._preflight import PreflightError, check, preflight

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "testing", "tiny_rl.py")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  from aepo_jax.testing import tiny_tokenizer

  return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _tiny(tok_dir, **overrides):
  return load_config(TINY, overrides={"model.tokenizer": tok_dir, **overrides}, num_devices=None)


def _dry_run(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(
    [sys.executable, os.path.join(ROOT, "launch", "tpu_pod.py"), f"--config={TINY}", *args, "--dry_run"],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=env,
    timeout=180,
  )


# --------------------------------------------------------------------------------------------- the command line
def test_dry_run_passes_a_config_that_can_run(tok_dir, tmp_path):
  out = _dry_run(f"--config.model.tokenizer={tok_dir}", f"--config.workdir={tmp_path}/run")
  assert out.returncode == 0, out.stderr[-2000:]
  assert json.loads(out.stdout.strip().splitlines()[-1])["model"]["tokenizer"] == tok_dir
  # A readable checklist before the JSON: every part checked, each OK, and the verdict.
  lines = out.stdout.splitlines()
  for part in ("model", "tokenizer", "data", "reward", "workdir", "tools"):
    assert any(line.startswith(f"  OK       {part}: ") for line in lines), (part, out.stdout[:2000])
  assert "verdict: ready to run" in lines


@pytest.mark.parametrize(
  "overrides,expected",
  [
    (
      ["--config.model.init=pretrained", "--config.model.name=Qwen/Qwen3-0.6B"],
      [
        "model.name='Qwen/Qwen3-0.6B' looks like a Hugging Face Hub id",
        "nothing is downloaded at run time",
        "hf download Qwen/Qwen3-0.6B --local-dir Qwen3-0.6B",
        "--config.model.name=<that directory>",
      ],
    ),
    (["--config.data.train=/nonexistent/prompts.jsonl"], ["data.train='/nonexistent/prompts.jsonl' does not exist"]),
    (
      ["--config.tools.search_backend=cache"],
      ["tools.search_backend='cache' is unknown; did you mean 'replay'?", "known: bing, brave, local, replay"],
    ),
    (
      ["--config.tools.search_backend=retrieval", "--config.tools.search_url=localhost:8000"],
      ["tools.search_url='localhost:8000' is not an http(s) URL"],
    ),
  ],
  ids=["hub_id", "missing_data_file", "unknown_search_backend", "bad_url"],
)
def test_dry_run_fails_naming_the_key(tok_dir, tmp_path, overrides, expected):
  out = _dry_run(f"--config.model.tokenizer={tok_dir}", f"--config.workdir={tmp_path}/run", *overrides)
  assert out.returncode != 0 and "the config cannot run here" in out.stderr, out.stderr[-2000:]
  for text in expected:
    assert text in out.stderr, (text, out.stderr[-2000:])
  assert "Traceback" not in out.stderr
  assert "verdict: cannot run here (1 problem)" in out.stdout and "  1 PROBLEM" in out.stdout, out.stdout[:2000]
  assert not os.path.exists(tmp_path / "run")  # a dry run writes nothing


# --------------------------------------------------------------------------------------------- preflight()
def test_model_names_and_directories(tok_dir, tmp_path):
  assert preflight(_tiny(tok_dir)) == []
  [p] = preflight(_tiny(tok_dir, **{"model.name": "smollm2-135", "model.init": "random"}))
  assert p.startswith("model.name='smollm2-135' is not a preset") and "did you mean 'smollm2-135m'?" in p
  empty = tmp_path / "hf"
  empty.mkdir()
  [p] = preflight(_tiny(tok_dir, **{"model.name": str(empty), "model.init": "pretrained"}))
  assert f"model.name={str(empty)!r} is a directory without config.json" in p
  [p] = preflight(_tiny(tok_dir, **{"model.name": "no/such/dir/here", "model.init": "pretrained"}))
  assert "is neither a bundled model (smollm2-135m-instruct), a local Hugging Face directory" in p
  # The random-init tiny model needs a tokenizer for RL; an empty model.tokenizer says how to give one.
  [p] = preflight(_tiny(tok_dir, **{"model.tokenizer": ""}))
  assert p.startswith("model.tokenizer is empty") and "--config.model.tokenizer=" in p
  [p] = preflight(_tiny(tok_dir, **{"model.tokenizer": str(empty)}))
  assert p.startswith("model.tokenizer: ") and "tokenizer.json does not exist" in p


def test_hf_directory_with_config_but_no_tokenizer(tok_dir, tmp_path):
  from aepo_jax.testing import tiny_hf_checkpoint

  path = tiny_hf_checkpoint("qwen3", str(tmp_path / "qwen3"))
  for name in ("tokenizer.json", "tokenizer_config.json"):
    if os.path.exists(os.path.join(path, name)):
      os.remove(os.path.join(path, name))
  c = _tiny(tok_dir, **{"model.name": path, "model.init": "pretrained", "model.tokenizer": "", "model.overrides": {}})
  assert preflight(c) == [
    f"model.name={path!r} has no tokenizer.json; set model.tokenizer to a directory (local or "
    "gs://) that holds the model's tokenizer."
  ]
  c = _tiny(tok_dir, **{"model.name": path, "model.init": "pretrained", "model.overrides": {}})
  assert preflight(c) == []  # model.tokenizer given


def test_data_sources(tok_dir, tmp_path):
  good = tmp_path / "qa.jsonl"
  good.write_text('{"question": "1+1?", "answer": "2"}\n')
  assert preflight(_tiny(tok_dir, **{"data.train": str(good), "data.val": (str(good), "valid")})) == []
  problems = preflight(
    _tiny(
      tok_dir,
      **{
        "data.train": "gaia_test",
        "data.val": ("valid", "mystery", "x.parquet"),
        "data.family": "code",
        "data.template": "nope",
      },
    )
  )
  assert any(p.startswith("data.train='gaia_test': GAIA and HLE are evaluation sets") for p in problems)
  assert any(p.startswith("data.val[1]='mystery' is not a data source") for p in problems)
  assert any(p.startswith("data.val[2]='x.parquet' does not exist") for p in problems)
  assert any(p.startswith("data.family='code'") for p in problems)
  assert any(p.startswith("data.template='nope' is unknown") for p in problems)
  assert preflight(_tiny(tok_dir, **{"data.train": "valid"})) == []  # an ARPO RL file by name
  # A field-name mistake shows in the dry run, not when RL starts after SFT.
  [p] = preflight(_tiny(tok_dir, **{"data.train": str(good), "data.fields.answer": "solution"}))
  assert p.startswith(f"data.train={str(good)!r}: {good}:1: field 'solution': missing") and "data.fields.answer" in p


def test_search_backends_keys_and_probe(tok_dir, tmp_path, monkeypatch):
  monkeypatch.delenv("SERPER_API_KEY", raising=False)
  [p] = preflight(_tiny(tok_dir, **{"tools.search_backend": "serper"}))
  assert p.startswith("tools.search_backend='serper' needs the API key in $SERPER_API_KEY")
  [p] = preflight(_tiny(tok_dir, **{"tools.search_backend": "retrieval"}))
  assert p.startswith("tools.search_backend='retrieval' needs tools.search_url=")
  [p] = preflight(_tiny(tok_dir, **{"tools.search_backend": "local", "tools.search_corpus": str(tmp_path / "c")}))
  assert p.startswith("tools.search_corpus=") and "does not exist" in p
  assert preflight(_tiny(tok_dir, **{"tools.search_backend": "replay"})) == []  # ARPO's search_cache.json
  dead = _tiny(tok_dir, **{"tools.search_backend": "retrieval", "tools.search_url": "http://127.0.0.1:9"})
  assert preflight(dead) == []  # syntax only without probe
  [p] = preflight(dead, probe=True)
  assert p.startswith("tools.search_url='http://127.0.0.1:9' did not answer GET /health")
  with pytest.raises(PreflightError, match="tools.search_url"):
    check(dead, probe=True)


def test_a_gs_path_that_hangs_is_reported_at_the_deadline(tok_dir, monkeypatch):
  from aepo_jax.train import _preflight, _preflight_model

  class Hanging:
    def exists(self, path):
      time.sleep(30)

  for module in (_preflight, _preflight_model):  # the data and the model checks
    monkeypatch.setattr(module, "_gs_fs", lambda: Hanging())
  t0 = time.monotonic()
  problems = preflight(
    _tiny(tok_dir, **{"model.init": "pretrained", "model.name": "gs://bkt/m", "workdir": "gs://bkt/run"}),
    gs_timeout_s=0.5,
  )
  assert time.monotonic() - t0 < 20  # at the 0.5 s deadline, not after the 30 s hang (slack: loaded machine)
  assert sorted(p.split(":")[0] for p in problems) == ["model.name", "workdir"]
  assert all("could not check gs://bkt/" in p and "no network or GCS credentials" in p for p in problems)


@pytest.mark.parametrize(
  "path",
  sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "*.py")) if os.path.basename(p) != "common.py"),
  ids=os.path.basename,
)
def test_shipped_configs_pass_where_their_gs_paths_exist(path, monkeypatch):
  """Every experiment config names backends, templates and sources the runtime accepts; its gs:// paths
  (placeholders here) stand for directories that exist."""
  from aepo_jax import model as model_lib
  from aepo_jax.train import _preflight, _preflight_model

  class Everything:
    def exists(self, path):
      return True

    def cat(self, path):
      return json.dumps(model_lib.to_hf_config(model_lib.preset("qwen3-0.6b"))).encode()

  for module in (_preflight, _preflight_model):  # the data and the model checks
    monkeypatch.setattr(module, "_gs_fs", lambda: Everything())
  config = load_config(path, num_devices=None)
  if "YOUR_BUCKET" in config.model.name:  # the placeholder is reported at once (not a bucket name) ...
    assert [p.split("=")[0] for p in preflight(config)] == ["model.name"]
    config.model.name = config.model.name.replace("YOUR_BUCKET", "my-bucket")  # ... and a real bucket passes
  assert preflight(config) == []


def test_base_config_passes():
  assert preflight(base_config()) == []


from test_checkpoint_gcs import BUCKET, gcs_emulator  # noqa: E402,F401  (the emulator fixture)


def test_gs_paths_are_checked_against_the_bucket(tok_dir, gcs_emulator):
  import fsspec

  fs = fsspec.filesystem("gs")
  fs.pipe(f"{BUCKET}/data/qa.jsonl", b'{"question": "1+1?", "answer": "2"}\n')
  ok = _tiny(tok_dir, **{"data.train": f"gs://{BUCKET}/data/qa.jsonl", "workdir": f"gs://{BUCKET}/run"})
  assert preflight(ok) == []
  bad = _tiny(
    tok_dir,
    **{
      "data.train": f"gs://{BUCKET}/data/typo.jsonl",
      "workdir": "gs://no-such-bucket/run",
      "model.tokenizer": f"gs://{BUCKET}/tok",
    },
  )
  assert sorted(preflight(bad)) == [
    f"data.train='gs://{BUCKET}/data/typo.jsonl' does not exist; check the bucket and path.",
    f"model.tokenizer: gs://{BUCKET}/tok/tokenizer.json does not exist; the tokenizer directory needs tokenizer.json.",
    "workdir='gs://no-such-bucket/run': bucket gs://no-such-bucket does not exist or is not visible with this "
    "machine's credentials.",
  ]
