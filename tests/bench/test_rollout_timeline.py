"""bench/rollout_timeline.py: each engine call's time is exclusive of the calls nested in it, counts are added up per
rollout call, nothing outside a rollout call is recorded, and the report's derived rows follow from the recorded
ones."""

import time

import pytest
from bench_script import load

MOD = load("rollout_timeline")


def test_nested_calls_are_timed_exclusively_and_only_inside_a_rollout_call():
  tl = MOD.Timeline()
  inner = tl.timed("inner", lambda: time.sleep(0.3))

  def outer_fn():
    time.sleep(0.05)
    inner()
    return 7

  outer = tl.timed("outer", outer_fn, count=lambda args, kwargs, out: {"items": out})
  outer()  # outside a rollout call: not recorded
  assert tl.calls == []
  tl.begin()
  assert outer() == 7
  assert outer() == 7
  tl.end()
  (call,) = tl.calls
  assert call["items"] == 14
  assert call["inner_s"] >= 0.6
  # Its own 2 x 50 ms, not the inner 2 x 300 ms (bounds loose enough for a loaded machine's oversleeping).
  assert 0.1 <= call["outer_s"] < 0.45
  assert call["wall"] >= call["inner_s"] + call["outer_s"]


def test_report_rows_follow_from_the_recorded_ones():
  calls = [
    {
      "wall": 10.0,
      "decode_s": 6.0,
      "add_s": 1.0,
      "extend_s": 1.0,
      "tokens_decode": 600,
      "decode_steps": 100,
      "decode_calls": 8,
      "row_steps": 800,
      "tokens_add": 300,
      "tokens_extend": 100,
    },
    {
      "wall": 6.0,
      "decode_s": 4.0,
      "add_s": 0.0,
      "extend_s": 1.0,
      "tokens_decode": 400,
      "decode_steps": 100,
      "decode_calls": 12,
      "row_steps": 1200,
      "tokens_extend": 100,
    },
  ]
  m = MOD.summarize(calls)
  assert m["wall"] == 8.0 and m["decode_s"] == 5.0
  assert m["host_s"] == pytest.approx(8.0 - 5.0 - 0.5 - 1.0)
  faster = dict(m, wall=4.0)
  text = MOD.report({"a": dict(m, calls=2), "b": dict(faster, calls=2)})
  assert "| rows per decode step | 5 | 5 |" in text
  assert "| ms per decode step | 50 | 50 |" in text
  assert "| decode calls (chunks) per call | 10 | 10 |" in text
  assert "| rows computed per decode step (the calls' row sizes) | 10 | 10 |" in text  # 1000 row-steps / 100 steps
  # 1.5 s over 250 tokens a call: a call without a count (the second has no prompt tokens) counts 0
  assert "| ms per prefilled token (add + extend) | 6 | 6 |" in text
  assert "| sampled tokens per rollout second, vs arm 0 | 1.00x | 2.00x |" in text
  assert "arm 1: b (2 calls)" in text
