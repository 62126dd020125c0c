"""Benchmark selection by name / family / 'all', and the requirement checks that run before compute."""

import pytest

from aepo_jax.data import BENCHMARKS
from aepo_jax.eval import load_examples, requirements_error, select_benchmarks


def test_select_by_name_family_and_all():
  assert select_benchmarks("gsm8k, math500,gsm8k") == ["gsm8k", "math500"]
  assert select_benchmarks("qa") == ["hotpotqa", "2wiki", "musique", "bamboogle"]
  assert select_benchmarks("deep_search") == ["webwalker", "gaia", "hle", "xbench", "simpleqa"]
  assert select_benchmarks("math") == ["aime24", "aime25", "math500", "gsm8k"]  # the unbundled MATH set is absent
  assert select_benchmarks(["aime24", "qa"])[:2] == ["aime24", "hotpotqa"]
  assert set(select_benchmarks("all")) == set(BENCHMARKS) - {"math"}
  assert select_benchmarks("MATH") == ["math"]


def test_unknown_name_lists_the_known_ones():
  with pytest.raises(ValueError) as e:
    select_benchmarks("gsm8k,gsm9k")
  msg = str(e.value)
  assert "'gsm9k'" in msg and "gsm8k" in msg and "webwalker" in msg and "deep_search" in msg
  with pytest.raises(ValueError, match="empty"):
    select_benchmarks(" , ")


def test_requirements():
  assert requirements_error(["gsm8k"], search_backend=None, judge=False) is None
  msg = requirements_error(["gaia", "gsm8k"], search_backend=None, judge=False)
  assert "['gaia']" in msg and "--search_backend=" in msg and "--judge_url=" in msg
  assert "search backend" in requirements_error(["hle"], search_backend="none", judge=True)
  assert requirements_error(["hle"], search_backend="retrieval", judge=True) is None
  assert "--search_backend=none" in requirements_error(["bamboogle"], search_backend=None, judge=False)
  assert requirements_error(["bamboogle"], search_backend="none", judge=False) is None


def test_load_examples_normalised_and_limited():
  gsm = load_examples("gsm8k", 3)
  assert len(gsm) == 3 and gsm[0].answers == ["18"] and gsm[0].family == "math"
  hle = load_examples("hle", 2)
  assert len(hle) == 2 and hle[0].family == "deep_search"
  assert len(load_examples("bamboogle")) == 125
