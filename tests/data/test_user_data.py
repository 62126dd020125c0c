"""Datasets of your own without code: JSONL / Parquet question-answer files (field names configurable, several
answers), records with their own system prompt, verl records with any prompt; local or gs://; errors name the
file, line or row, and field; and a short RL run from a user JSONL."""

import json
import os
import sys

import pytest

from aepo_jax.data import RecordError, build_messages, load_records, system_prompt
from aepo_jax.data.prompts import CODE_SEARCH

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def _parquet(path, records):
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq.write_table(pa.Table.from_pylist(records), path)
  return str(path)


def test_question_answer_jsonl_with_several_answers(tmp_path):
  path = _jsonl(
    tmp_path / "mine.jsonl",
    [
      {"question": "Capital of France?", "answer": ["Paris", "paris, France"], "topic": "geo"},
      {"question": "6 times 7?", "answer": 42},
      {"question": "Largest planet?", "answer": "Jupiter"},
    ],
  )
  exs = load_records(path)
  assert [e.answers for e in exs] == [["Paris", "paris, France"], ["42"], ["Jupiter"]]
  assert [e.id for e in exs] == ["mine:1", "mine:2", "mine:3"] and {e.source for e in exs} == {"mine"}
  assert {e.family for e in exs} == {"qa"} and exs[0].metadata == {"topic": "geo"}
  assert build_messages(exs[0], "compact") == [
    {"role": "system", "content": system_prompt("compact")},
    {"role": "user", "content": "Capital of France?"},
  ]
  assert load_records(path, family="math")[1].family == "math"


def test_parquet_with_configured_field_names_and_own_system_prompts(tmp_path):
  path = _parquet(
    tmp_path / "mine.parquet",
    [
      {"problem": "1+1?", "solutions": ["2", "two"], "instruction": "Be terse."},
      {"problem": "2+2?", "solutions": ["4"], "instruction": None},  # no prompt of its own: the template's
      {"problem": "3+3?", "solutions": ["6"], "instruction": CODE_SEARCH.replace("\\b", "\x08")},  # ARPO's
    ],
  )
  exs = load_records(path, question_key="problem", answer_key="solutions", system_key="instruction")
  assert [(e.id, e.question, e.answers) for e in exs] == [
    ("mine:0", "1+1?", ["2", "two"]),
    ("mine:1", "2+2?", ["4"]),
    ("mine:2", "3+3?", ["6"]),
  ]
  assert [build_messages(e, "math")[0]["content"] for e in exs] == [
    "Be terse.",
    system_prompt("math"),
    system_prompt("math"),
  ]


def test_verl_records_in_jsonl_keep_a_foreign_prompt(tmp_path):
  path = _jsonl(
    tmp_path / "verl.jsonl",
    [
      {
        "prompt": [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Gold?"}],
        "reward_model": {"ground_truth": ["doubloons", "gold"]},
        "ability": "qa",
        "data_source": "mine",
      },
      {"prompt": [{"role": "user", "content": "2+3?"}], "reward_model": {"ground_truth": "5"}, "ability": "math"},
    ],
  )
  a, b = load_records(path)
  assert (a.question, a.answers, a.family) == ("Gold?", ["doubloons", "gold"], "qa")
  assert build_messages(a, "compact")[0]["content"] == "You are a pirate."
  assert (b.family, build_messages(b, "compact")[0]["content"]) == ("math", system_prompt("compact"))


@pytest.mark.parametrize(
  "records,where,field,hint",
  [
    ([{"q": "x", "answer": "y"}], ":1:", "question", "name the question field with data.fields.question"),
    ([{"question": "x", "answer": "y"}, {"question": "z"}], ":2:", "answer", "data.fields.answer"),
    ([{"question": "x", "answer": {"a": 1}}], ":1:", "answer", "expected str, int or list"),
    ([{"question": "", "answer": "y"}], ":1:", "question", "non-empty string"),
    ([{"question": "x", "answer": "y", "system": 3}], ":1:", "system", "expected a string"),
    (
      [{"prompt": [{"role": "assistant", "content": "x"}], "reward_model": {"ground_truth": "y"}}],
      ":1:",
      "prompt",
      "expected [system, user]",
    ),
  ],
)
def test_bad_records_name_file_line_and_field(tmp_path, records, where, field, hint):
  path = _jsonl(tmp_path / "bad.jsonl", records)
  with pytest.raises(RecordError) as err:
    load_records(path)
  assert err.value.field == field and f"bad.jsonl{where} field {field!r}" in str(err.value)
  assert hint in str(err.value)


def test_bad_files(tmp_path):
  path = _parquet(tmp_path / "bad.parquet", [{"question": "x", "answer": ["y"]}, {"question": "z", "answer": []}])
  with pytest.raises(RecordError, match=r"bad.parquet row 1: field 'answer': empty list"):
    load_records(path)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_records(str(tmp_path / "missing.jsonl"))
  with pytest.raises(ValueError, match="expected a .jsonl or .parquet file"):
    load_records(str(tmp_path / "data.csv"))
  (tmp_path / "empty.jsonl").write_text("\n")
  with pytest.raises(ValueError, match="holds no records"):
    load_records(str(tmp_path / "empty.jsonl"))


sys.path.insert(0, os.path.join(ROOT, "tests", "train"))
from test_checkpoint_gcs import BUCKET, gcs_emulator  # noqa: E402,F401  (the emulator fixture)


def test_files_in_a_bucket(tmp_path, gcs_emulator):
  import fsspec

  fs = fsspec.filesystem("gs")
  fs.put(_jsonl(tmp_path / "a.jsonl", [{"question": "q", "answer": "a"}]), f"{BUCKET}/data/a.jsonl")
  fs.put(_parquet(tmp_path / "b.parquet", [{"question": "q", "answer": ["a", "b"]}]), f"{BUCKET}/data/b.parquet")
  assert load_records(f"gs://{BUCKET}/data/a.jsonl")[0].answers == ["a"]
  assert load_records(f"gs://{BUCKET}/data/b.parquet")[0].id == "b:0"
  with pytest.raises(FileNotFoundError, match=f"gs://{BUCKET}/data/c.jsonl"):
    load_records(f"gs://{BUCKET}/data/c.jsonl")


# ----------------------------------------------------------------------------------------------- from the config
QA = [
  {"problem": f"What is {a} plus {b}?", "solutions": [str(a + b), f"{a + b}.0"]}
  for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1)]
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  from aepo_jax.testing import tiny_tokenizer

  return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _config(tmp_path, tok_dir, path, **overrides):
  from aepo_jax.train import load_config

  return load_config(
    os.path.join(ROOT, "configs", "testing", "tiny_rl.py"),
    num_devices=None,
    overrides={
      "workdir": str(tmp_path / "run"),
      "model.tokenizer": tok_dir,
      "data.train": path,
      "data.val": (path,),
      "data.fields.question": "problem",
      "data.fields.answer": "solutions",
      "data.family": "math",
      **overrides,
    },
  )


def test_config_routes_a_file_source(tmp_path, tok_dir):
  from aepo_jax.train import _inputs

  path = _jsonl(tmp_path / "sums.jsonl", QA)
  exs = _inputs._examples(_config(tmp_path, tok_dir, path), path, "train")
  assert [e.answers for e in exs[:2]] == [["3", "3.0"], ["7", "7.0"]] and {e.family for e in exs} == {"math"}


@pytest.mark.slow
def test_rl_run_from_a_user_jsonl(tmp_path, tok_dir, monkeypatch):
  """tiny_rl (RL only) trains on the user's question/answer JSONL and validates on it: the rollouts' prompts
  are the file's questions in the configured template."""
  from aepo_jax.train import _wiring, read_metrics, run

  path = _jsonl(tmp_path / "sums.jsonl", QA)
  seen, prompt_ids = [], _wiring.prompt_ids

  def spy(config, tokenizer, example):
    seen.append((example.question, tuple(example.answers), build_messages(example, config.data.template)[0]))
    return prompt_ids(config, tokenizer, example)

  monkeypatch.setattr(_wiring, "prompt_ids", spy)
  config = _config(
    tmp_path,
    tok_dir,
    path,
    **{"mode": "rl", "sft.enabled": False, "eval.before_rl": False, "rollout.policy": "none", "train.steps": 2},
  )
  summary = run(config)
  assert summary["rl/steps"] == 2
  records = read_metrics(config.workdir)
  rl = [r for r in records if "reward/mean" in r]
  assert [r["step"] for r in rl] == [1, 2] and all(r["rollout/trajectories"] == 2 * 4 for r in rl)
  assert [r for r in records if "eval/sums/accuracy" in r], sorted(records[-1])
  expected = {(r["problem"], tuple(r["solutions"])) for r in QA}
  assert seen and {(q, a) for q, a, _ in seen} <= expected and len({q for q, _, _ in seen}) >= 4
  assert {m["content"] for _, _, m in seen} == {system_prompt("compact")}  # tiny_rl's template
