"""Run summaries (Pass@k per benchmark from the JSONL records) and the side-by-side comparison."""

import os

import pytest

from aepo_jax.eval import compare, load_summary, summarize_records, write_summary


def _records(outcomes, bench="gsm8k"):
  """outcomes[q] = per-sample 0/1."""
  return [
    {
      "benchmark": bench,
      "id": f"{bench}:{q}",
      "sample": k,
      "correct": bool(c),
      "score": float(c),
      "scorer": "math_verify",
      "extracted": "1" if c else "",
      "num_tool_calls": 1,
      "response_len": 10,
      "em": None,
      "f1": None,
      "judge_error": None,
    }
    for q, row in enumerate(outcomes)
    for k, c in enumerate(row)
  ]


def test_pass_at_k_from_records_matches_hand_computation():
  # q0: 2 of 4 correct; q1: 0 of 4; q2: 4 of 4.
  recs = _records([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
  s = summarize_records(recs[::-1], ks=[1, 2, 4])  # order of records does not matter
  # pass@1 = mean(c/n) = (0.5 + 0 + 1)/3; pass@2 for q0 = 1 - C(2,2)/C(4,2) = 5/6.
  assert s["pass@1"] == pytest.approx(1.5 / 3)
  assert s["pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3)
  assert s["pass@4"] == pytest.approx(2 / 3)
  assert s["best_of_4"] == pytest.approx(2 / 3) and s["best_of_2"] == pytest.approx(2 / 3)
  assert s["accuracy"] == pytest.approx(6 / 12) and s["num_questions"] == 3 and s["num_answers"] == 12
  lo, hi = s["pass@1_ci95"]
  assert 0 <= lo <= s["pass@1"] <= hi <= 1
  assert s["scorers"] == {"math_verify": 12} and s["judge_failures"] == 0 and s["no_answer"] == 6


def test_k_above_n_is_left_out():
  s = summarize_records(_records([[1, 0]]), ks=[1, 5])
  assert "pass@5" not in s and s["pass@1"] == 0.5


def _run(tmp_path, name, outcomes):
  d = tmp_path / name
  d.mkdir()
  write_summary(
    str(d),
    {"gsm8k": _records(outcomes), "bamboogle": _records(outcomes[::-1], "bamboogle")},
    ks=[1, 5],
    families={"gsm8k": "math", "bamboogle": "qa"},
    meta={"checkpoint": name},
  )
  return str(d)


def test_summary_files_and_compare_table_and_png(tmp_path):
  a = _run(tmp_path, "runA", [[1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
  b = _run(tmp_path, "runB", [[1, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
  sa = load_summary(a)
  assert sa["benchmarks"]["gsm8k"]["pass@1"] == pytest.approx(0.2)
  assert sa["benchmarks"]["gsm8k"]["family"] == "math"
  md_a = open(os.path.join(a, "summary.md")).read()
  assert "| gsm8k | math | 2 | 5 | 20.0 [" in md_a
  md, png = compare([a, b], str(tmp_path / "cmp"))
  assert "runA pass@1" in md and "runB pass@1" in md and "runB pass@5" in md
  row = next(line for line in md.splitlines() if line.startswith("| gsm8k"))
  assert row.split("|")[2:4] == [" 20.0 ", " 50.0 "]  # pass@1 of A, B
  assert os.path.getsize(png) > 1000 and open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  assert open(str(tmp_path / "cmp") + ".md").read() == md


def test_compare_names_a_directory_without_summary(tmp_path):
  with pytest.raises(FileNotFoundError, match="summary.json"):
    compare([str(tmp_path)])


def test_cli_compare(tmp_path, capsys):
  import importlib.util

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  spec = importlib.util.spec_from_file_location("evaluate_cli", os.path.join(root, "launch", "evaluate.py"))
  cli = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(cli)
  a = _run(tmp_path, "runA", [[1, 0, 0, 0, 0]])
  b = _run(tmp_path, "runB", [[1, 1, 0, 0, 0]])
  assert cli.main([f"--compare={a},{b}", f"--output={tmp_path / 'c'}"]) == 0
  out = capsys.readouterr().out
  assert "| gsm8k | 20.0 | 40.0 |" in out and os.path.exists(tmp_path / "c.png")
  assert cli.main(["--compare", a, str(tmp_path / "nothing")]) == 2  # the argparse spelling still works
  assert "summary.json" in capsys.readouterr().err
