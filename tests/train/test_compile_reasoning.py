"""`launch/compile.py` on a second shipped config with a different model family and mesh: ARPO reasoning on
Qwen2.5-3B (2 KV heads: training tensor 2 and a 2 x 2 rollout mesh per host, so the KV cache splits over a host's
chips), compiled with 2 of its layers for v5p-64 (its own file, so it compiles beside tests/train/test_compile.py
under `-n 2 --dist loadfile`)."""

import pytest

from test_compile import _compile  # noqa: F401  (skips the module without libtpu, as test_compile does)


@pytest.mark.slow
def test_arpo_reasoning_qwen25_3b_fits_v5p_64():
  out, report = _compile(
    "configs/arpo_reasoning.py:qwen2.5-3b", "v5p:4x4x2", "--programs=update,logprob,prefill,decode"
  )
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert report["fits"] is True and set(report["programs"]) == {"update", "logprob", "prefill", "decode"}
  assert "'tensor': 2" in out.stdout, out.stdout[:2000]  # the training mesh the config asks for
  # the 2 KV heads split over the rollout mesh's tensor axis: each chip holds part of the cache, not all of it
  cache_line = next(line for line in out.stdout.splitlines() if line.startswith("KV cache sharding"))
  assert "tensor" in cache_line, cache_line
  programs = report["programs"]
  assert programs["update"]["attention"] == programs["logprob"]["attention"] == "splash"
  assert programs["prefill"]["peak_gb"] < 95 and programs["decode"]["peak_gb"] < 95
