"""Checks of a config against the world, before any device is claimed: `--dry_run` and the start of `run()`.

`validate()` checks values against each other; this checks them against what the run will find: files and
directories exist (local, and gs:// with one stat each under a shared deadline; a local data file is read with
the configured field names), the model and tokenizer
resolve to something loadable without a download, backend names are known, URLs are well-formed, API keys
are set. With `probe=True` (the main job at start-up) it also asks a retrieval server for GET /health.
Each problem names the key and the fix.

  problems = preflight(config)       # [] when the config can start
  check(config, probe=False)         # raises PreflightError listing every problem
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Callable, Optional
from urllib.parse import urlparse

from aepo_jax.train._config import did_you_mean
from aepo_jax.train._preflight_model import _gs_fs, _is_gs, _model, _tokenizer

GS_TIMEOUT_S = 20.0
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_NEVER_TRAIN = ("gaia", "hle", "gaia_test", "hle_test")


class PreflightError(ValueError):
  """The config cannot run here; the message lists each problem with its key and fix."""


class _Problems:
  """Problems found so far, plus gs:// checks that run concurrently under one deadline."""

  def __init__(self, gs_timeout_s: float):
    self.items: list[str] = []
    self.parts: list[str] = []  # the checklist part each item belongs to
    self.part = ""  # the part now being checked
    self._remote: list[tuple[str, str, Callable]] = []
    self._remote_parts: list[str] = []
    self._timeout = gs_timeout_s

  def add(self, msg: str, part: Optional[str] = None):
    self.items.append(msg)
    self.parts.append(self.part if part is None else part)

  def remote(self, key: str, path: str, fn: Callable[[], Optional[str]]):
    """`fn()` returns a problem or None; it may raise (reported) or hang (reported at the deadline)."""
    bucket = str(path)[len("gs://") :].split("/")[0]
    if not _BUCKET.fullmatch(bucket):  # e.g. the shipped configs' placeholder: no need to wait for GCS to say so
      self.add(
        f"{key}={path!r}: {bucket!r} is not a GCS bucket name (lowercase letters, digits, '-', '_', '.'); "
        f"set --config.{key}=gs://<your bucket>/..."
      )
      return
    self._remote.append((key, path, fn))
    self._remote_parts.append(self.part)

  def finish(self) -> list[str]:
    results: dict[int, Optional[str]] = {}

    def work(i, key, path, fn):
      try:
        results[i] = fn()
      except Exception as e:  # noqa: BLE001 -- any failure to read it is the problem to report
        results[i] = (
          f"{key}: cannot read {path} ({type(e).__name__}: {str(e)[:200]}); check the path and this "
          "machine's GCS credentials (gcloud auth application-default login, or the VM's service account)."
        )

    # Daemon threads: a stat stuck probing for credentials must not keep the process alive at exit.
    threads = [threading.Thread(target=work, args=(i, *r), daemon=True) for i, r in enumerate(self._remote)]
    for t in threads:
      t.start()
    deadline = time.monotonic() + self._timeout
    for t in threads:
      t.join(max(0.0, deadline - time.monotonic()))
    for i, (key, path, _) in enumerate(self._remote):
      if i not in results:
        self.add(
          f"{key}: could not check {path} within {self._timeout:g} s (no network or GCS credentials on "
          "this machine?); run the dry run where the job runs, or fix the path.",
          self._remote_parts[i],
        )
      elif results[i]:
        self.add(results[i], self._remote_parts[i])
    return self.items


# ---------------------------------------------------------------------------------------------------------
# Data.
# ---------------------------------------------------------------------------------------------------------
def _source(config, key: str, source, p: _Problems):
  from aepo_jax import data as data_lib

  source = str(source)
  if source == "suite":
    return
  if source in data_lib.ARPO_RL_FILES:
    path = data_lib.arpo_data_root() / "train" / f"{source}.parquet"
    if not path.exists():
      p.add(
        f"{key}={source!r}: {path} does not exist; set $AEPO_ARPO_DATA to the ARPO data folder (train/, eval/; "
        "docs/data.md) or give a .jsonl / .parquet path."
      )
    return
  if source in data_lib.BENCHMARKS:
    path = data_lib.arpo_data_root() / data_lib.BENCHMARKS[source].path
    if not path.exists():
      p.add(f"{key}={source!r}: {path} does not exist; set $AEPO_ARPO_DATA to the ARPO data folder (docs/data.md).")
    return
  if data_lib.is_data_file(source):
    if _is_gs(source):
      p.remote(
        key,
        source,
        lambda: (
          None if data_lib.data_file_exists(source) else f"{key}={source!r} does not exist; check the bucket and path."
        ),
      )
    elif not os.path.isfile(source):
      p.add(
        f"{key}={source!r} does not exist"
        + ("" if os.path.isabs(source) else f" (relative to {os.getcwd()})")
        + "; fix the path."
      )
    else:  # a local file is read whole (prompt sets are small): a wrong field name shows now, not after SFT
      f = config.data.fields
      try:
        data_lib.load_records(
          source,
          question_key=f.question,
          answer_key=f.answer,
          system_key=f.system,
          family=config.data.family if config.data.family in data_lib.FAMILIES else "qa",
        )
      except ValueError as e:
        p.add(f"{key}={source!r}: {e}")
    return
  p.add(
    f"{key}={source!r} is not a data source: use 'suite', an ARPO RL file ({', '.join(data_lib.ARPO_RL_FILES)}), "
    f"a benchmark ({', '.join(sorted(data_lib.BENCHMARKS))}) or a .jsonl / .parquet file (docs/data.md)."
  )


def _data(config, p: _Problems):
  from aepo_jax import data as data_lib

  d = config.data
  if config.mode != "sft":
    _source(config, "data.train", d.train, p)
    if str(d.train) in _NEVER_TRAIN:
      p.add(f"data.train={d.train!r}: GAIA and HLE are evaluation sets; train on hard_search_1k or your own file.")
  if isinstance(d.val, str):
    p.add(f"data.val={d.val!r} must be a tuple of sources: --config.data.val='(\"{d.val}\",)'.")
  else:
    for i, source in enumerate(d.val):
      _source(config, f"data.val[{i}]", source, p)
  if d.template not in data_lib.TEMPLATES:
    p.add(f"data.template={d.template!r} is unknown; choose one of {sorted(data_lib.TEMPLATES)}.")
  if d.family not in data_lib.FAMILIES:
    p.add(f"data.family={d.family!r}: use 'qa' or 'math'.")
  for k in ("question", "answer", "system"):
    if not isinstance(d.fields[k], str) or not d.fields[k]:
      p.add(f"data.fields.{k}={d.fields[k]!r}: give the record field name as a non-empty string.")
  src = str(config.sft.source)
  if (config.sft.enabled or config.mode == "sft") and src not in ("suite", "synthetic"):
    if not data_lib.is_data_file(src):
      p.add(f"sft.source={src!r}: use 'suite', 'synthetic' or a .jsonl / .parquet file of chat traces (docs/data.md).")
    elif _is_gs(src):
      p.remote(
        "sft.source",
        src,
        lambda: (
          None if data_lib.data_file_exists(src) else f"sft.source={src!r} does not exist; check the bucket and path."
        ),
      )
    else:
      _file("sft.source", src, p)


# ---------------------------------------------------------------------------------------------------------
# Tools, reward, workdir.
# ---------------------------------------------------------------------------------------------------------
def _url_problem(key: str, url: str) -> Optional[str]:
  u = urlparse(url)
  if u.scheme not in ("http", "https") or not u.netloc:
    return f"{key}={url!r} is not an http(s) URL; write it as http://HOST:PORT."
  try:
    u.port  # noqa: B018 -- raises on a malformed port
  except ValueError:
    return f"{key}={url!r} has a malformed port; write it as http://HOST:PORT."
  return None


def _probe(url: str) -> Optional[str]:
  from aepo_jax.tools import JsonClient

  try:
    JsonClient(timeout_s=5.0, retries=0).request("GET", url.rstrip("/") + "/health")
  except Exception as e:  # noqa: BLE001 -- any failure means the server is not usable
    return (
      f"tools.search_url={url!r} did not answer GET /health ({e}); start the server "
      "(python launch/retrieval_server.py ...) or fix the URL."
    )
  return None


def _tools(config, p: _Problems, probe: bool):
  from aepo_jax import tools as tools_lib
  from aepo_jax.tools import _web

  tc = config.tools
  try:
    tools_lib.import_plugins(tuple(tc.get("plugins", ())))
  except ImportError as e:
    p.add(str(e))
  known = tools_lib.registered_tools()
  for name in tc.names:
    if name not in known:
      p.add(
        f"tools.names has {name!r}, which is not a registered tool"
        + did_you_mean(name, known)
        + f" (registered: {', '.join(known)}; a plug-in's tools: name its module in tools.plugins)."
      )
  owner = {}
  for name in dict.fromkeys(n for n in tc.names if n in known):
    tag = tools_lib.tool_spec(name).call_tag
    if tag in owner:
      p.add(f"tools.names has {owner[tag]!r} and {name!r}, which both answer <{tag}>; keep one of them.")
    owner.setdefault(tag, name)
  if tc.search_url:
    problem = _url_problem("tools.search_url", tc.search_url)
    if problem:
      p.add(problem)
  if "search_backend" not in tools_lib.settings_read(n for n in tc.names if n in known):
    return  # no named tool reads the search settings
  if tc.search_mode == "browse":
    for key in ("summarizer_url",):
      problem = _url_problem(f"tools.browse.{key}", tc.browse[key]) if tc.browse[key] else None
      if problem:
        p.add(problem)
    if tc.browse.pages and not _is_gs(tc.browse.pages) and not os.path.exists(tc.browse.pages):
      p.add(f"tools.browse.pages={tc.browse.pages!r} does not exist; give a directory of pages or a corpus JSONL.")
  backends = sorted([*_web.WEB_BACKENDS, "local", "retrieval", "replay"])
  kind = tc.search_backend
  if kind not in backends:
    alias = {"cache": "replay", "http": "retrieval"}.get(kind)  # what the other name of the backend means
    p.add(
      f"tools.search_backend={kind!r} is unknown"
      + (f"; did you mean {alias!r}?" if alias else did_you_mean(kind, backends))
      + f" (known: {', '.join(backends)})."
    )
  elif kind == "retrieval":
    if not tc.search_url:
      p.add("tools.search_backend='retrieval' needs tools.search_url=http://HOST:PORT (launch/retrieval_server.py).")
    elif probe and not _url_problem("tools.search_url", tc.search_url):
      problem = _probe(tc.search_url)
      if problem:
        p.add(problem)
  elif kind == "local" and tc.search_corpus:
    _file("tools.search_corpus", tc.search_corpus, p)
  elif kind == "replay":
    if tc.search_corpus:
      _file("tools.search_corpus", tc.search_corpus, p)
    else:
      from aepo_jax.data import arpo_data_root

      cache = arpo_data_root() / "search_cache.json"
      if not cache.exists():
        p.add(
          f"tools.search_backend='replay' reads tools.search_corpus, default {cache}, which does not exist; set "
          "tools.search_corpus to a query -> result JSON file or $AEPO_ARPO_DATA to the ARPO data folder."
        )
  elif kind in _web.WEB_BACKENDS:
    env = _web.WEB_BACKENDS[kind].DEFAULT_KEY_ENV
    if not os.environ.get(env):
      p.add(f"tools.search_backend={kind!r} needs the API key in ${env} (on every host); export it before the run.")


def _file(key: str, path: str, p: _Problems):
  if _is_gs(path):
    p.remote(key, path, lambda: None if _gs_fs().exists(path) else f"{key}={path!r} does not exist.")
  elif not os.path.exists(path):
    p.add(f"{key}={path!r} does not exist; fix the path.")


def _reward(config, p: _Problems):
  from aepo_jax import rewards as rewards_lib

  name = config.reward.name
  if not callable(getattr(rewards_lib, str(name), None)):
    p.add(f"reward.name={name!r} is not a function of aepo_jax.rewards; use 'deep_research'.")


def _workdir(config, p: _Problems):
  w = str(config.workdir)
  if _is_gs(w):
    bucket = w[len("gs://") :].split("/")[0]
    p.remote(
      "workdir",
      w,
      lambda: (
        None
        if _gs_fs().exists(bucket)
        else f"workdir={w!r}: bucket gs://{bucket} does not exist or is not visible with this machine's credentials."
      ),
    )
  elif os.path.exists(w) and not os.path.isdir(w):
    p.add(f"workdir={w!r} is a file; give a directory.")


# The parts of the check, in order: (name, what it checks), as the dry run's checklist lists them.
CHECKLIST = (
  ("model", "model.name / model.init resolve to weights on this machine or gs:// (nothing is downloaded)"),
  ("tokenizer", "the tokenizer and its chat template load"),
  ("data", "training and validation files exist and read with the configured fields"),
  ("reward", "the reward and judge settings (files, URLs, API keys)"),
  ("workdir", "the work directory is a directory or can be made"),
  ("tools", "tool backends are known, their URLs well-formed, their API keys set"),
)


def checklist(config, *, probe: bool = False, gs_timeout_s: float = GS_TIMEOUT_S) -> list[tuple[str, str, list]]:
  """[(part, what it checks, its problems)] in CHECKLIST order: what `--dry_run` prints before its verdict."""
  p = _Problems(gs_timeout_s)
  for part, fn in (("model", _model), ("tokenizer", _tokenizer), ("data", _data), ("reward", _reward)):
    p.part = part
    fn(config, p)
  p.part = "workdir"
  _workdir(config, p)
  p.part = "tools"
  _tools(config, p, probe)
  p.finish()
  return [(part, what, [m for m, q in zip(p.items, p.parts) if q == part]) for part, what in CHECKLIST]


def preflight(config, *, probe: bool = False, gs_timeout_s: float = GS_TIMEOUT_S) -> list[str]:
  """Every problem that would stop `config` after start-up, as 'key: what, fix' strings; [] when none.

  probe=True also asks services (a retrieval server's GET /health): the main job's start-up check.
  """
  return [m for _, _, problems in checklist(config, probe=probe, gs_timeout_s=gs_timeout_s) for m in problems]


def format_checklist(rows, config_name: str = "") -> str:
  """The checklist as lines a person reads: one line per part (OK or the number of problems), then the verdict."""
  lines = [f"dry run{f' of {config_name}' if config_name else ''}:", "  OK       config values agree (validate)"]
  for part, what, problems in rows:
    status = "OK" if not problems else f"{len(problems)} PROBLEM{'S' if len(problems) > 1 else ''}"
    lines.append(f"  {status:<9}{part}: {what}")
  bad = sum(len(problems) for _, _, problems in rows)
  lines.append("verdict: ready to run" if not bad else f"verdict: cannot run here ({bad} problem{'s' * (bad > 1)})")
  return "\n".join(lines)


def check(config, *, probe: bool = False, gs_timeout_s: float = GS_TIMEOUT_S):
  """Raise PreflightError listing every problem of `preflight(config)`."""
  problems = preflight(config, probe=probe, gs_timeout_s=gs_timeout_s)
  if problems:
    raise PreflightError("the config cannot run here:\n  " + "\n  ".join(problems))
  return config
