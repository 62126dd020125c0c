"""RewardPool: a pathological item costs its timeout and no more; the pool keeps serving; a result only ever reaches
its own item; the trainer's scoring paths go through the process's shared pool."""

import time
import types

import ml_collections
import numpy as np
import pytest

from aepo_jax.data import Example
from aepo_jax.rewards import RewardPool, _pool, deep_research, math_equal

import _hostile_scorers as hs

GOOD = "<think> x </think> <answer> \\boxed{Paris} </answer>"


@pytest.fixture(scope="module")
def pool():
  with RewardPool(num_workers=2, timeout_s=2.0, memory_limit_mb=2048) as p:
    yield p


def test_scores_match_in_process(pool):
  items = [(GOOD, ["Paris"]), (GOOD, "Lyon"), ("junk", "x")]
  assert pool.map(deep_research, items) == [deep_research(*it) for it in items] == [1.0, 0.0, -1.0]


def test_hostile_items_cannot_hang_a_step(pool):
  evil = "a" * 64  # the naive regex would take ~2^64 steps
  t0 = time.monotonic()
  res = pool.map_results(hs.naive_regex_scorer, [("aaab",), (evil,)], timeout_s=1.5)
  assert [r.status for r in res] == ["ok", "timeout"]
  assert res[0].value == 1.0  # "aaab" matches quickly
  res = pool.map_results(hs.slow_scorer, [(0.01,), (60.0,)], timeout_s=1.5)
  assert [r.status for r in res] == ["ok", "timeout"]
  assert time.monotonic() - t0 < 20  # two timeouts plus worker restarts, never the 60 s sleep
  assert pool.stats["timeouts"] >= 2 and pool.stats["restarts"] >= 2


def test_sympy_blowup_is_cut_by_the_pool(pool):
  # math-verify's own guard is 5 s; the pool's 1.5 s deadline wins and the item gets the default.
  t0 = time.monotonic()
  out = pool.map(math_equal, [("10^{10^{9}}-1", "5"), ("025", "25")], timeout_s=1.5, default=False)
  assert out == [False, True]
  assert time.monotonic() - t0 < 15


def test_crash_error_and_memory_bomb_are_reported(pool):
  res = pool.map_results(hs.crashing_scorer, [()])
  assert res[0].status == "error" and "died" in res[0].error
  res = pool.map_results(hs.raising_scorer, [()])
  assert res[0].status == "error" and "ValueError: bad ground truth" in res[0].error
  res = pool.map_results(hs.memory_bomb_scorer, [()])
  assert res[0].status == "error" and "MemoryError" in res[0].error
  assert pool.map(deep_research, [(GOOD, "Paris")]) == [1.0]  # still serving


def test_items_run_in_parallel_workers(pool):
  pids = set(pool.map(hs.pid_scorer, [()] * 8))
  assert len(pids) == 2
  # Parallel means two calls' sleeps overlap in time (no wall-clock bound, which a loaded machine breaks).
  spans = pool.map(hs.interval_scorer, [(0.5,)] * 4)
  assert any(a[0] != b[0] and a[1] < b[2] and b[1] < a[2] for i, a in enumerate(spans) for b in spans[i + 1 :]), spans


def test_workers_stay_light(pool):
  assert pool.map(hs.heavy_modules_loaded, [()]) == [[]]  # spawn: nothing inherited from the trainer


def test_bad_arguments():
  with pytest.raises(ValueError, match="num_workers"):
    RewardPool(num_workers=0)


def test_no_stale_result_after_an_interrupted_map(pool):
  # The first item is in flight when pickling the second raises KeyboardInterrupt: the map stops there. Its
  # answer must never be handed to an item of a later map.
  with pytest.raises(KeyboardInterrupt):
    pool.map(hs.slow_scorer, [(0.3,), (hs.Unpicklable(KeyboardInterrupt()),)])
  time.sleep(0.5)  # the abandoned answer (1.0) has arrived by now
  assert pool.map(hs.echo, [("a",), ("b",), ("c",)]) == ["a", "b", "c"]


def test_unpicklable_item_fails_alone(pool):
  res = pool.map_results(hs.echo, [("a",), (lambda: 0,), ("c",)])
  assert [r.status for r in res] == ["ok", "error", "ok"] and [res[0].value, res[2].value] == ["a", "c"]
  assert "cannot send item 1" in res[1].error


@pytest.fixture()
def shared(monkeypatch, pool):
  """The process's shared pool, replaced by the module's test pool (1.5 s per item)."""
  monkeypatch.setattr(_pool, "_SHARED", pool)
  monkeypatch.setattr(pool, "timeout_s", 1.5)
  return pool


def _traj(texts, groups):
  return types.SimpleNamespace(
    response_text=list(texts), group_id_b=np.asarray(groups), response_len_b=np.asarray([len(t) for t in texts])
  )


def test_trainer_scoring_goes_through_the_shared_pool(shared):
  from aepo_jax.train import _objective

  prompts = [Example("m:0", "q", ["5", "6", "7"], "m", "math"), Example("q:0", "q", ["Paris"], "q", "qa")]
  hostile = "<think> x </think> <answer> \\boxed{10^{10^{9}}-1} </answer>"
  traj = _traj([hostile, GOOD], [0, 1])
  before = shared.stats["items"]
  start = time.monotonic()
  # DAPO's filter: in-process, math-verify's 5 s guard ran once per alias (over 15 s for this answer).
  assert _objective.correct_b(traj, prompts).tolist() == [0.0, 1.0]
  assert time.monotonic() - start < 5
  config = ml_collections.ConfigDict(
    {"reward": {"name": "deep_research", "timeout_s": 10.0}, "algo": {"overlong_buffer": 0}}
  )
  assert _objective.make_reward(config)(traj, prompts).tolist() == [0.0, 1.0]
  assert shared.stats["items"] == before + 4 and shared.stats["timeouts"] >= 1
