"""`train.compile_cache`: the run's persistent XLA compilation cache (aepo_jax/parallel/_compile_cache.py).

The folder each setting gives, then the main job (`launch/tpu_pod.py`, tiny SFT and RL with tools) run
twice with one cache folder: the second run reads its programs from it and gives the first run's metrics, bit for bit.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from aepo_jax.parallel import compile_cache_folder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_folder_of_each_setting(monkeypatch):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.delenv("JAX_ENABLE_COMPILATION_CACHE", raising=False)
  assert compile_cache_folder("auto", "/runs/a") == "/runs/a/compile_cache"
  assert compile_cache_folder("auto", "gs://bucket/runs/a") == "gs://bucket/runs/a/compile_cache"
  assert compile_cache_folder("", "/runs/a") is None
  assert compile_cache_folder("gs://bucket/xla", "/runs/a") == "gs://bucket/xla"
  monkeypatch.setenv("JAX_ENABLE_COMPILATION_CACHE", "false")
  assert compile_cache_folder("auto", "/runs/a") is None  # switched off in the environment
  monkeypatch.setenv("JAX_ENABLE_COMPILATION_CACHE", "true")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")
  assert compile_cache_folder("auto", "/runs/a") is None  # the environment's folder stands
  assert compile_cache_folder("/mine", "/runs/a") == "/mine"  # an explicit folder wins


def test_a_folder_that_cannot_be_made_is_named_with_the_way_out(tmp_path):
  from aepo_jax.parallel import CompileCacheError, use_compile_cache

  blocker = tmp_path / "a_file"
  blocker.write_text("")
  with pytest.raises(CompileCacheError, match=r"train\.compile_cache='.*a_file/xla': cannot make the folder") as e:
    use_compile_cache(str(blocker / "xla"), str(tmp_path))
  assert "train.compile_cache='' to compile every program at each start" in str(e.value)


def _main_job(tmp_path, workdir, cache=None):
  """launch/tpu_pod.py on the tiny RL config; cache None: the default ('auto', <workdir>/compile_cache)."""
  from aepo_jax.testing import tiny_tokenizer

  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # only the config's folder
  out = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "launch", "tpu_pod.py"),
      "--config=configs/testing/tiny_rl.py",
      f"--config.workdir={workdir}",
      f"--config.model.tokenizer={tiny_tokenizer(tmp_path / 'tok')}",
      *([f"--config.train.compile_cache={cache}"] if cache else []),
      "--config.train.steps=1",
      "--config.eval.before_rl=False",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  line = re.search(r"compilation cache (\S+): (\d+) of (\d+) programs read from it", out.stdout + out.stderr)
  assert line and line.group(1) == str(cache or workdir / "compile_cache"), (out.stdout + out.stderr)[-3000:]
  with open(workdir / "metrics.jsonl") as f:
    records = [json.loads(x) for x in f]
  return int(line.group(2)), int(line.group(3)), records


def _timing(key: str) -> bool:
  """Times, memory and compile statistics (slot occupancy is measured over the rollout's wall time)."""
  return (
    key.startswith("perf/")
    or key in ("time", "wall_s")
    or re.search(r"_s($|_)|_seconds$", key) is not None
    or any(s in key for s in ("occupancy", "memory", "compile"))
  )


def _results(records):
  """Every logged number but `_timing` ones."""
  return [{k: v for k, v in r.items() if not _timing(k)} for r in records]


@pytest.mark.slow
def test_a_second_run_reads_its_programs_from_the_cache_and_gives_the_same_results(tmp_path):
  """Run a makes its cache where 'auto' puts it; run b, in another workdir, is given that folder."""
  hits, requests, first = _main_job(tmp_path, tmp_path / "a")
  cache = tmp_path / "a" / "compile_cache"
  assert hits == 0 and requests > 10 and os.listdir(cache), (hits, requests)
  hits, requests2, second = _main_job(tmp_path, tmp_path / "b", cache)
  assert requests2 == requests and hits == requests, (hits, requests2, requests)
  assert _results(second) == _results(first)
