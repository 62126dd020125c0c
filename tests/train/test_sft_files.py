"""Cold-start SFT from trace files: LLaMA-Factory's sharegpt (JSONL) and alpaca (Parquet) forms, tool results inside
an assistant turn out of the loss, packing, the cutoff, and errors that name the line and the field."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aepo_jax import data
from aepo_jax.data import RecordError
from aepo_jax.train import _inputs, load_config, read_metrics, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "testing", "tiny_rl.py")

SYSTEM = "Answer with tools."
RESULT_1 = " <result>\nPage 1: Paris is the capital of France.\n</result>"
RESULT_2 = " <result>\n6\n</result>"
TURN = (
  "<think>look it up</think><search>capital of France</search>"
  + RESULT_1
  + "<python>print(2*3)</python>"
  + RESULT_2
  + "<answer>\\boxed{Paris}</answer>"
)
MODEL_TEXT = [
  "<think>look it up</think><search>capital of France</search>",
  "<python>print(2*3)</python>",
  "<answer>\\boxed{Paris}</answer>",
]


def _sharegpt_jsonl(path):
  records = [
    {
      "conversations": [
        {"from": "system", "value": SYSTEM},
        {"from": "human", "value": "Capital of France?"},
        {"from": "gpt", "value": TURN},
      ]
    },
    # the OpenAI form with the tool result as its own turn: folded into the assistant turn
    {
      "messages": [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": MODEL_TEXT[0]},
        {"role": "tool", "content": "Page 1: Paris is the capital of France."},
        {"role": "assistant", "content": "<answer>\\boxed{Paris}</answer>"},
      ]
    },
  ]
  with open(path, "w") as f:
    f.write("\n".join(json.dumps(r) for r in records) + "\n")
  return str(path)


def _alpaca_parquet(path, n=6):
  rows = [{"instruction": f"Capital of France? ({i})", "input": "", "output": TURN, "system": SYSTEM} for i in range(n)]
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  return str(path)


def test_both_forms_normalise_to_the_same_turns(tmp_path):
  share = list(data.read_traces(_sharegpt_jsonl(tmp_path / "t.jsonl")))
  alpaca = list(data.read_traces(_alpaca_parquet(tmp_path / "t.parquet", n=1)))
  assert share[0].messages == [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": TURN},
  ]
  assert alpaca[0].messages == [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Capital of France? (0)"},
    {"role": "assistant", "content": TURN},
  ]
  folded = share[1].messages[-1]  # the tool turn's place is kept: it stays untrained in every recipe
  span = (len(MODEL_TEXT[0]), len(MODEL_TEXT[0]) + len(RESULT_1))
  assert folded == {
    "role": "assistant",
    "content": MODEL_TEXT[0] + RESULT_1 + MODEL_TEXT[2],
    data.TRACE_OBSERVED: [span],
  }
  assert data.trace_segments(TURN) == [
    (MODEL_TEXT[0], True),
    (RESULT_1, False),
    (MODEL_TEXT[1], True),
    (RESULT_2, False),
    (MODEL_TEXT[2], True),
  ]
  # LLaMA-Factory's released recipe (sft.mask_results=False): results written inside the turn are trained, the
  # folded observation turn is not.
  assert data.trace_segments(TURN, mask_results=False) == [(TURN, True)]
  observed = folded[data.TRACE_OBSERVED]
  assert data.trace_segments(folded["content"], mask_results=False, observed=observed) == [
    (MODEL_TEXT[0], True),
    (RESULT_1, False),
    (MODEL_TEXT[2], True),
  ]


@pytest.mark.parametrize(
  "line,needle",
  [
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt"}]}, "conversations[1].value"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]}, "conversations[1].from"),
    (
      {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "x <result> y"}]},
      "has no closing '</result>'",
    ),
    ({"instruction": "q"}, "field 'output'"),
    ({"prompt": "q", "response": "a"}, "neither alpaca"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, "must start with a user turn"),
  ],
)
def test_a_malformed_record_names_its_line_and_field(tmp_path, line, needle):
  path = tmp_path / "bad.jsonl"
  good = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
  path.write_text(json.dumps(good) + "\n" + json.dumps(line) + "\n")
  with pytest.raises(RecordError) as e:
    list(data.read_traces(str(path)))
  assert e.value.line == 2 and f"{path}:2" in str(e.value) and needle in str(e.value)


def test_a_malformed_parquet_row_names_its_row(tmp_path):
  path = tmp_path / "bad.parquet"
  pq.write_table(
    pa.Table.from_pylist([{"instruction": "q", "output": "a"}, {"instruction": "q", "output": ""}]), str(path)
  )
  with pytest.raises(RecordError, match=r"bad.parquet row 1: field 'output'"):
    list(data.read_traces(str(path)))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  from aepo_jax.testing import tiny_tokenizer

  return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _config(tmp_path, tok_dir, source, **overrides):
  return load_config(
    CONFIG,
    overrides={
      "workdir": str(tmp_path / "run"),
      "model.tokenizer": tok_dir,
      "mode": "sft",
      "sft.source": source,
      "sft.steps": 2,
      "sft.batch_size": 8,
      "sft.packed_rows": 8,
      "sft.micro_batch_size": 8,
      "sft.max_len": 256,
      "checkpoint.every_steps": 2,
      **overrides,
    },
    num_devices=None,
  )


def test_trace_examples_mask_exactly_the_tool_results(tmp_path, tok_dir):
  config = _config(tmp_path, tok_dir, _sharegpt_jsonl(tmp_path / "t.jsonl"))
  model_cfg, _, tok = _inputs.load_model(config)
  eos = model_cfg.eos_token_ids[0]
  examples = _inputs.sft_examples(config, tok, model_cfg)
  assert len(examples) == 2
  tokens, mask = examples[0]
  prompt = tok.apply_chat_template(
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Capital of France?"}],
    add_generation_prompt=True,
  )
  assert tokens[: len(prompt)].tolist() == prompt and not mask[: len(prompt)].any()
  pos = len(prompt)
  for text, trained in data.trace_segments(TURN):
    ids = tok.encode_continuation(text)
    assert tokens[pos : pos + len(ids)].tolist() == ids
    assert (mask[pos : pos + len(ids)] == int(trained)).all(), text
    pos += len(ids)
  assert tokens[pos:].tolist() == [eos] and mask[pos] == 1
  # What the loss sees is the model's text and EOS; what it does not is the prompt and the two results.
  assert tok.decode(tokens[mask == 1][:-1].tolist()) == "".join(MODEL_TEXT)
  assert tok.decode(tokens[len(prompt) :][mask[len(prompt) :] == 0].tolist()) == RESULT_1 + RESULT_2
  # The cutoff keeps a prefix; a turn whose context alone passes it has nothing to learn and is dropped.
  cut = _inputs.trace_examples(str(tmp_path / "t.jsonl"), tok, eos, max_len=len(prompt) + 3)
  assert all(len(t) == len(prompt) + 3 for t, _ in cut)
  kept = _inputs.trace_examples(str(tmp_path / "t.jsonl"), tok, eos, max_len=len(prompt))
  assert len(kept) == 1 and kept[0][1].any()  # the first turn (longer system prompt) is dropped
  with pytest.raises(ValueError, match="raise sft.max_len"):
    _inputs.trace_examples(str(tmp_path / "t.jsonl"), tok, eos, max_len=2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sharegpt_jsonl", "alpaca_parquet"])
def test_tiny_sft_run_from_a_trace_file(tmp_path, tok_dir, kind):
  source = (
    _sharegpt_jsonl(tmp_path / "t.jsonl") if kind == "sharegpt_jsonl" else _alpaca_parquet(tmp_path / "t.parquet")
  )
  config = _config(tmp_path, tok_dir, source)
  summary = run(config)
  assert summary["sft/steps"] == 2 and np.isfinite(summary["sft/final_nll"])
  rows = [r for r in read_metrics(config.workdir) if "sft/nll" in r]
  assert len(rows) == 2 and all(r["sft/tokens"] > 0 for r in rows)
