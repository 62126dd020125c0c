"""launch/evaluate.py speaks absl flags like the other launchers: defaults in --help, errors before any model
loads, and the argparse spellings of earlier versions (--search-backend, --no-progress, --compare A B) still work."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def cli():
  spec = importlib.util.spec_from_file_location("evaluate_cli", os.path.join(ROOT, "launch", "evaluate.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_help_shows_every_flag_with_its_default():
  out = subprocess.run(
    [sys.executable, os.path.join(ROOT, "launch", "evaluate.py"), "--help"], capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0
  for flag, default in (
    ("benchmarks", "'math'"),
    ("k", "'1,5'"),
    ("temperature", "'0.6'"),
    ("top_p", "'0.95'"),
    ("top_k", "'20'"),
    ("min_p", "'0.0'"),
    ("repetition_penalty", "'1.1'"),
    ("max_tokens_per_call", "'4096'"),
    ("max_response_len", "'8192'"),
    ("max_prompt_len", "'2048'"),
    ("batch_size", "'8'"),
    ("seed", "'0'"),
    ("data_family", "'qa'"),
    ("compile_cache", "'auto'"),
  ):
    section = out.stdout.split(f"--{flag}:", 1)[1].split("\n  --", 1)[0]
    assert f"(default: {default})" in section, (flag, section)
  assert "--[no]progress" in out.stdout and "--[no]allow_unsandboxed" in out.stdout


def test_old_spellings_parse_to_the_absl_flags(cli):
  old = [
    "--checkpoint",
    "ck",
    "--search-backend",
    "replay",
    "--max-response-len",
    "64",
    "--top-p=0.5",
    "--no-progress",
    "--allow-unsandboxed",
    "--compare",
    "a",
    "b",
    "--output",
    "o",
  ]
  assert cli.parse(old) == []
  old_values = {
    k: cli.FLAGS[k].value
    for k in (
      "checkpoint",
      "search_backend",
      "max_response_len",
      "top_p",
      "progress",
      "allow_unsandboxed",
      "compare",
      "output",
    )
  }
  new = [
    "--checkpoint=ck",
    "--search_backend=replay",
    "--max_response_len=64",
    "--top_p=0.5",
    "--noprogress",
    "--allow_unsandboxed",
    "--compare=a,b",
    "--output=o",
  ]
  assert cli.parse(new) == []
  assert (
    {k: cli.FLAGS[k].value for k in old_values}
    == old_values
    == {
      "checkpoint": "ck",
      "search_backend": "replay",
      "max_response_len": 64,
      "top_p": 0.5,
      "progress": False,
      "allow_unsandboxed": True,
      "compare": ["a", "b"],
      "output": "o",
    }
  )
  cli.parse([])  # a new parse starts from the defaults
  assert cli.FLAGS["max_response_len"].value == 8192 and cli.FLAGS["progress"].value is True


def test_usage_errors(cli, capsys):
  assert cli.main(["--benchmark=gsm8k"]) == 2
  assert "Unknown command line flag 'benchmark'" in capsys.readouterr().err
  assert cli.main(["--benchmarks=gsm8k"]) == 2
  assert "give --checkpoint=PATH (evaluate) or --compare=RUN_DIR,RUN_DIR" in capsys.readouterr().err
  assert cli.main(["--checkpoint=x", "stray"]) == 2
  assert "unexpected arguments ['stray']" in capsys.readouterr().err
  assert cli.main(["--n=two"]) == 2
  assert "--n" in capsys.readouterr().err


def test_the_official_protocol_caps_each_set_at_500_questions_unless_told(cli):
  assert cli.question_limit(None, "official") == 500  # the official runs' cap per set
  assert cli.question_limit(None, "project") is None
  assert cli.question_limit(0, "official") is None  # --limit=0: every question
  assert cli.question_limit(20, "official") == 20


def test_the_official_protocol_browses_with_the_released_sds_browser_unless_told(cli):
  assert cli.browse_variant(None, "official", ["gaia", "hle"]) == "sds"
  assert cli.browse_variant(None, "official", ["xbench"]) == "sds_cn"  # infer_local_sds_cn.sh runs xbench alone
  assert cli.browse_variant(None, "official", ["xbench", "gaia"]) == "sds"
  assert cli.browse_variant(None, "project", ["xbench"]) == "project"  # today's browser unless asked
  assert cli.browse_variant("project", "official", ["gaia"]) == "project"
  assert cli.official_chinese(["xbench"], "official") and not cli.official_chinese(["xbench"], "project")
