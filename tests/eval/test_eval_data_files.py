"""A data file of your own as an evaluation benchmark: checked before compute, read with the configured field
names, reported under its file name, and scored against its answers."""

import importlib.util
import json
import os

import pytest

from aepo_jax.eval import EvalInputError, check_inputs, read_records, select_benchmarks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _file(tmp_path):
  path = tmp_path / "mine.jsonl"
  path.write_text(
    "".join(json.dumps({"problem": f"What is {i} plus 1?", "solutions": [str(i + 1)]}) + "\n" for i in range(3))
  )
  return str(path)


def test_selection_and_checks(orbax_ckpt, tmp_path):
  path = _file(tmp_path)
  assert select_benchmarks(f"gsm8k,{path}") == ["gsm8k", path]
  with pytest.raises(ValueError, match="would both be reported as 'mine'"):
    select_benchmarks(f"{path},{tmp_path}/other/mine.parquet")
  plan = check_inputs(orbax_ckpt, path)  # no search backend or judge needed for a data file
  assert plan.benchmarks == [path]
  with pytest.raises(EvalInputError, match="data file .*typo.jsonl.* does not exist"):
    check_inputs(orbax_ckpt, str(tmp_path / "typo.jsonl"))


def test_cli_evaluates_a_data_file(orbax_ckpt, tmp_path, capsys):
  spec = importlib.util.spec_from_file_location("evaluate_cli", os.path.join(ROOT, "launch", "evaluate.py"))
  cli = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(cli)
  out = str(tmp_path / "out")
  argv = [
    f"--checkpoint={orbax_ckpt}",
    f"--benchmarks={_file(tmp_path)}",
    "--n=1",
    "--k=1",
    "--temperature=0",
    "--max_prompt_len=256",
    "--max_response_len=8",
    "--batch_size=2",
    "--template=compact",
    "--noprogress",
    f"--output={out}",
  ]
  assert cli.main(argv + ["--question_field=question"]) == 2  # the file has no 'question' field
  err = capsys.readouterr().err
  assert "mine.jsonl:1: field 'question': missing" in err and "--question_field" in err
  assert cli.main(argv + ["--question_field=problem", "--answer_field=solutions", "--data_family=math"]) == 0
  recs = read_records(os.path.join(out, "mine.jsonl"))
  assert [(r["question"], r["family"]) for r in recs] == [(f"What is {i} plus 1?", "math") for i in range(3)]
  summary = json.load(open(os.path.join(out, "summary.json")))
  assert set(summary["benchmarks"]) == {"mine"} and summary["benchmarks"]["mine"]["num_answers"] == 3
