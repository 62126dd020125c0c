"""ARPO sources: every benchmark normalised, the backspace bug detected, malformed records named."""

import json
import subprocess
import sys

import pytest

from aepo_jax.data import (
  ARPO_RL_FILES,
  BENCHMARKS,
  Example,
  RecordError,
  arpo_data_root,
  load_arpo_parquet,
  load_benchmark,
  read_jsonl,
)
from aepo_jax.data.prompts import CODE_SEARCH, build_messages, fix_backspace_bug, has_backspace_bug, system_prompt

ROOT = arpo_data_root()
pytestmark = pytest.mark.skipif(not ROOT.exists(), reason=f"ARPO data not at {ROOT}")

# Sizes from shared/data/arpo/README.md.
SIZES = {
  "aime24": 30,
  "aime25": 30,
  "math500": 500,
  "gsm8k": 1319,
  "hotpotqa": 200,
  "2wiki": 200,
  "musique": 200,
  "bamboogle": 125,
  "webwalker": 200,
  "gaia": 103,
  "hle": 500,
  "xbench": 100,
  "simpleqa": 500,
}


def test_registry_has_the_14_sets():
  assert len(BENCHMARKS) == 14 and set(SIZES) | {"math"} == set(BENCHMARKS)


@pytest.mark.parametrize("name", sorted(SIZES))
def test_benchmark_normalised(name):
  exs = load_benchmark(name)
  assert len(exs) == SIZES[name]
  assert len({e.id for e in exs}) == len(exs)
  for e in exs:
    assert isinstance(e, Example) and e.question.strip() and e.answers
    assert all(isinstance(a, str) and a for a in e.answers)
    assert e.family == BENCHMARKS[name].family


def test_field_differences():
  assert load_benchmark("aime25")[0].answers == ["70"]  # int answer
  assert load_benchmark("gsm8k")[0].answers == ["18"]  # '#### 18'
  assert "#### 18" in load_benchmark("gsm8k")[0].metadata["solution"]
  assert load_benchmark("gaia")[0].question.startswith("I\u2019m researching")  # 'Question' key
  assert load_benchmark("gaia")[0].metadata["Level"] in (1, 2, 3, "1", "2", "3")
  assert len(load_benchmark("2wiki")[0].answers) == 8  # list of aliases
  assert load_benchmark("hle")[0].metadata["answer_type"] == "multipleChoice"
  assert sum(a.startswith("0") for e in load_benchmark("aime24") for a in e.answers) == 7


def test_missing_math_set_says_why():
  with pytest.raises(FileNotFoundError, match="not in the bundled ARPO snapshot"):
    load_benchmark("math")
  with pytest.raises(ValueError, match="unknown benchmark"):
    load_benchmark("mmlu")


@pytest.mark.parametrize("name", ARPO_RL_FILES)
def test_parquet_and_backspace_bug(name):
  exs = load_arpo_parquet(name)
  assert exs and all(len(e.answers) == 1 for e in exs)
  assert all(e.metadata["stored_prompt_backspace_bug"] for e in exs)  # every stored prompt is buggy
  families = {e.family for e in exs}
  assert families == ({"math", "qa"} if name in ("train_10k", "valid") else {"deep_search"})


def test_rebuilt_prompt_is_the_stored_one_fixed():
  import pyarrow.parquet as pq

  stored = pq.read_table(ROOT / "train" / "valid.parquet").to_pylist()[0]["prompt"][0]["content"]
  assert has_backspace_bug(stored) and "\x08oxed{" in stored
  assert fix_backspace_bug(stored) == CODE_SEARCH
  ex = load_arpo_parquet("valid")[0]
  msgs = build_messages(ex, "code_search")
  assert msgs[0]["content"] == CODE_SEARCH and not has_backspace_bug(msgs[0]["content"])
  assert "\\boxed{answer here}" in CODE_SEARCH and msgs[1] == {"role": "user", "content": ex.question}


def test_parquet_with_a_foreign_prompt_keeps_it_as_its_own(tmp_path):
  """A verl row whose system prompt is not ARPO's is used with that prompt (not rejected, not replaced)."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  rows = pq.read_table(ROOT / "train" / "valid.parquet").to_pylist()[:3]
  rows[2]["prompt"][0]["content"] = "You are a pirate."
  path = tmp_path / "bad.parquet"
  pq.write_table(pa.Table.from_pylist(rows), path)
  exs = load_arpo_parquet(path)
  assert [e.metadata.get("system_prompt") for e in exs] == [None, None, "You are a pirate."]
  assert build_messages(exs[2], "code_search")[0] == {"role": "system", "content": "You are a pirate."}
  assert build_messages(exs[0], "compact")[0]["content"] == system_prompt("compact")
  rows[1]["prompt"] = rows[1]["prompt"][:1] * 2  # [system, system]
  pq.write_table(pa.Table.from_pylist(rows), path)
  with pytest.raises(RecordError, match=r"bad.parquet row 1: field 'prompt'"):
    load_arpo_parquet(path)


@pytest.mark.parametrize(
  "lines,line,field",
  [
    (['{"question": "q", "answer": "a"}', '{"question": "q", "answer": '], 2, "<json>"),
    (['{"question": "q"}'], 1, "answer"),
    (['{"answer": "a"}'], 1, "question"),
    (['{"question": 3, "answer": "a"}'], 1, "question"),
    (['{"question": "q", "answer": {"x": 1}}'], 1, "answer"),
    (['{"question": "q", "answer": []}'], 1, "answer"),
    (['{"question": "q", "answer": ["a", null]}'], 1, "answer[1]"),
    (['{"question": "q", "answer": true}'], 1, "answer"),
    (['["q", "a"]'], 1, "<record>"),
  ],
)
def test_malformed_jsonl_names_file_line_field(tmp_path, lines, line, field):
  path = tmp_path / "broken.jsonl"
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(RecordError) as err:
    read_jsonl(path, name="broken", family="qa")
  assert (err.value.path, err.value.line, err.value.field) == (str(path), line, field)
  assert str(err.value).startswith(f"{path}:{line}: field {field!r}")


def test_gsm8k_without_marker(tmp_path):
  path = tmp_path / "g.jsonl"
  path.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
  with pytest.raises(RecordError, match="####"):
    read_jsonl(path, name="g", family="math", gsm8k_answer=True)


def test_data_and_rewards_never_import_jax():
  code = (
    "import sys, aepo_jax.data, aepo_jax.rewards, aepo_jax.data.tasks;"
    "from aepo_jax.data.tasks import generate_suite; generate_suite(0, 5, 2);"
    "assert 'jax' not in sys.modules, 'jax imported'"
  )
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
