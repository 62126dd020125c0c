"""The evaluation loop: questions through the agent loop (evaluation protocol, spec §2.5 / §4), n samples per
question, each answer scored and appended to a per-benchmark JSONL as soon as its batch finishes.

Protocol: sampling T=0.6, top_p=0.95, top_k=20, min_p=0, repetition_penalty=1.1 (vLLM semantics: every token
already in the row, prompt and tool results included); at most 4,096 tokens per generation call (a call that
reaches it ends the trajectory, as a finished call without a tool tag does; with `max_calls_per_turn` > 1, the
official engine's continuation, it is continued by up to that many calls in all); at most 5 python and 10 search calls
per trajectory, calls beyond get the official refusal text and the model continues (ToolSet mode 'eval'); tool
results are written `<result>{text}</result>`. The whole response (tool results included) is also bounded by
`max_response_len`, the engine's cache: the official runs are bounded only by the model's context.

Resume: the JSONL is the state. A rerun reads it, drops a torn last line (a kill mid-write), moves any other
unparsable line to `<jsonl>.bad` (reported by line number), re-scores examples whose judge call failed, and runs
only the (question id, sample) pairs that are missing, so an interrupted or damaged run ends with every pair
exactly once. Sampled runs draw from seeds derived from `seed` and the
batch index, so a resumed sampled run is a valid sample but not bit-identical to an uninterrupted one; greedy
runs (temperature 0) are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import time
from typing import Optional, Sequence

from aepo_jax.data import Example, build_messages
from aepo_jax.eval._scoring import Scorer, needs_rescore

_log = logging.getLogger("aepo_jax.eval")


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """Defaults are the official evaluation's (spec §2.5)."""

  n: int = 5  # samples per question (Pass@k needs n >= k)
  temperature: float = 0.6
  top_p: float = 0.95
  top_k: int = 20
  min_p: float = 0.0
  repetition_penalty: float = 1.1
  max_prompt_len: int = 2048
  max_tokens_per_call: int = 4096  # tokens one generation call may sample (0: only max_response_len bounds it)
  max_response_len: int = 8192  # response tokens including tool results (the KV cache holds prompt + this)
  python_limit: int = 5
  search_limit: int = 10
  batch_size: int = 8  # trajectories decoded together (engine slots)
  chunk_steps: int = 16
  seed: int = 0
  template: str = "code_search"  # system prompt (aepo_jax.data.TEMPLATES)
  # Scoring: 'project' (math-verify, the strict judge; _scoring.py) for library use and tests; launch/evaluate.py
  # and the paper configs default to 'official' (the official evaluator's metrics, judge and fallbacks).
  protocol: str = "project"
  # 'official' protocol only: when one generation call reaches max_tokens_per_call without closing a tool or
  # answer tag, generate again up to this many calls in all (the official inference engine: 4); 1 = no continuation.
  max_calls_per_turn: int = 1
  # Wall-clock seconds one answer may take (queued, decoding, tools); then it ends with the official timeout record:
  # its text so far + "\n[Timeout (exceeding Ns)]", prediction "Timeout" (scored wrong). The official SDS scripts:
  # 1,500 s (launch/evaluate.py's default under --protocol=official). 0: no limit.
  sample_timeout_s: float = 0.0

  def __post_init__(self):
    from aepo_jax.eval._scoring import PROTOCOLS

    if self.protocol not in PROTOCOLS:
      raise ValueError(f"EvalSettings.protocol={self.protocol!r} must be one of {PROTOCOLS}.")
    if self.sample_timeout_s < 0:
      raise ValueError(f"EvalSettings.sample_timeout_s={self.sample_timeout_s} must be >= 0 (0: no limit).")
    if self.max_calls_per_turn < 1:
      raise ValueError(f"EvalSettings.max_calls_per_turn={self.max_calls_per_turn} must be >= 1 (1: no continuation).")
    for key in ("n", "max_prompt_len", "max_response_len", "batch_size", "chunk_steps"):
      if getattr(self, key) < 1:
        raise ValueError(f"EvalSettings.{key}={getattr(self, key)} must be >= 1.")
    if self.max_tokens_per_call < 0:
      raise ValueError(f"EvalSettings.max_tokens_per_call={self.max_tokens_per_call} must be >= 0 (0: no cap).")
    if not 0.0 <= self.min_p <= 1.0 or not self.repetition_penalty > 0:
      raise ValueError(
        f"min_p={self.min_p} must be in [0, 1] (0 = off) and repetition_penalty="
        f"{self.repetition_penalty} > 0 (1 = off)."
      )
    if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
      raise ValueError(
        f"sampling temperature={self.temperature} (>= 0, 0 = greedy), top_p={self.top_p} (in (0, 1]) "
        f"and top_k={self.top_k} (>= 0, 0 = off) are out of range."
      )
    from aepo_jax.data import TEMPLATES

    if self.template not in TEMPLATES:
      raise ValueError(f"template {self.template!r} is unknown; choose one of {sorted(TEMPLATES)}.")

  def rollout_settings(self):
    """The evaluation protocol as `aepo_jax.rollout.RolloutSettings`: policy 'none', one trajectory per call, the
    tokenizer's end of turn ends a trajectory, tool results written as the official evaluation writes them. The
    per-tool limits live in the ToolSet (refusal text, the model continues); the loop's own total-call cap, which
    ends a trajectory, is out of reach (a refused call still costs tokens)."""
    from aepo_jax.rollout import RolloutSettings, SamplingParams

    return RolloutSettings(
      max_slots=self.batch_size,
      max_prompt_len=self.max_prompt_len,
      max_response_len=self.max_response_len,
      sampling=SamplingParams(self.temperature, self.top_p, self.top_k, self.min_p, self.repetition_penalty),
      tokenizer_eos=True,
      chunk_steps=self.chunk_steps,
      result_mode="eval",
      max_tokens_per_call=self.max_tokens_per_call,
      max_calls_per_turn=self.max_calls_per_turn,
      sample_timeout_s=self.sample_timeout_s,
    )


# The prediction of an answer that ran past EvalSettings.sample_timeout_s (the official `process_sample_wrap`: the
# sample's prediction is only set when it finishes, so a timed-out one records "Timeout").
TIMEOUT_PREDICTION = "Timeout"

_CALLS: dict = {}


def _call_pattern() -> re.Pattern:
  """`<tag>input</tag> <result_tag>result</result_tag>` for every registered tool (plug-ins included)."""
  from aepo_jax.tools import all_call_tags

  pairs = all_call_tags()
  if pairs not in _CALLS:
    calls = "|".join(re.escape(c) for c in dict.fromkeys(c for c, _ in pairs))
    results = "|".join(re.escape(r) for r in dict.fromkeys(r for _, r in pairs))
    _CALLS[pairs] = re.compile(rf"<({calls})>(.*?)</\1>\s*<({results})>(.*?)</\3>", re.DOTALL)
  return _CALLS[pairs]


def tool_calls_from_text(text: str) -> list[dict]:
  """[{tool, input, result}] in order, from an evaluation response (results are `<result>..</result>`); tool: the
  call tag of a registered tool."""
  return [
    {"tool": m.group(1), "input": m.group(2).strip(), "result": m.group(4)} for m in _call_pattern().finditer(text)
  ]


def read_records(path: str, *, repair: bool = True) -> list[dict]:
  """The JSONL records of `path`. Two kinds of bad line:

  - a torn last line (no final newline: a kill mid-write) is dropped and, with `repair`, cut off the file;
  - any other line that is not a JSON object (damage: a flipped byte, an editor) is skipped and reported by line
    number; with `repair` it is moved to `<path>.bad` (kept for inspection) and the file rewritten without it.
  Records lost either way are missing pairs, which `Evaluator.run` evaluates again.
  """
  if not os.path.exists(path):
    return []
  with open(path, "rb") as f:
    *complete, torn = f.read().split(b"\n")  # json.dumps escapes newlines inside records
  out, kept, bad = [], [], []
  for number, line in enumerate((body + b"\n" for body in complete), 1):
    try:
      record = json.loads(line)
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
      record = None
    if isinstance(record, dict):
      out.append(record)
      kept.append(line)
    else:
      bad.append((number, line))
  if bad:
    where = ", ".join(str(n) for n, _ in bad[:10]) + (f" (and {len(bad) - 10} more)" if len(bad) > 10 else "")
    _log.warning(
      "%s: skipped %d unparsable line(s) (line %s)%s; their examples are evaluated again.",
      path,
      len(bad),
      where,
      f", moved to {path}.bad" if repair else "",
    )
  if repair and (bad or torn):
    if bad:
      with open(path + ".bad", "ab") as f:
        f.writelines(line for _, line in bad)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
      f.writelines(kept)
    os.replace(tmp, path)
  return out


def _write_records(path: str, records: list[dict]) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    for r in records:
      f.write(json.dumps(r, ensure_ascii=False) + "\n")
  os.replace(tmp, path)


class Evaluator:
  """One policy + tools + scorer; `run(name, examples, path)` evaluates one benchmark into a JSONL.

  By default the rollouts (engine, agent loop, policy 'none') are built from `settings.rollout_settings()` (the
  evaluation protocol). `rollouts` runs a caller's instead, any object called as `aepo_jax.rollout.Rollouts` is
  (`rollouts(weights, prompt_ids, seed=) -> Trajectories`): the trainer's validation, on its own engine, tools and
  result format, or `eval.RemoteRollouts`, a policy served over HTTP; `settings` then give only n, batch_size,
  max_prompt_len, template and seed.
  """

  def __init__(
    self,
    policy,
    tools,
    scorer: Scorer,
    settings: EvalSettings = EvalSettings(),
    *,
    mesh=None,
    show_progress: bool = True,
    rollouts=None,
  ):
    from aepo_jax.rollout import Rollouts

    self.policy, self.tools, self.scorer, self.settings = policy, tools, scorer, settings
    self.show_progress = show_progress
    if rollouts is None:
      tok = policy.tokenizer
      rollouts = Rollouts(
        policy.config, tok, tools, settings.rollout_settings(), mesh=mesh, pad_id=getattr(tok, "pad_id", None)
      )
    self.rollouts = rollouts

  def prompt_tokens(self, example: Example) -> list[int]:
    return self.policy.tokenizer.apply_chat_template(
      build_messages(example, self.settings.template), add_generation_prompt=True
    )

  def run(self, name: str, examples: Sequence[Example], path: Optional[str] = None) -> list[dict]:
    """Evaluates the missing (example, sample) pairs of one benchmark; returns all its records (path None: kept in
    memory only, nothing to resume)."""
    s = self.settings
    if path is not None:
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    by_id = {ex.id: ex for ex in examples}
    stored = read_records(path) if path is not None else []
    seen_all, kept = set(), []
    for r in stored:  # keep the first of any duplicate (defensive; the writer never makes them)
      if (r.get("id"), r.get("sample")) not in seen_all:
        seen_all.add((r.get("id"), r.get("sample")))
        kept.append(r)
    # Records of questions or samples outside this run (a larger --limit or --n before) stay in the file.
    unique = [r for r in kept if r.get("id") in by_id and r.get("sample", s.n) < s.n]
    stale = [r for r in unique if needs_rescore(r)]
    for r in stale:
      r.update(self._score(by_id[r["id"]], r["response"], r.get("stop_reason")))
    if path is not None and (stale or len(kept) != len(stored)):
      _write_records(path, kept)
    seen = {(r["id"], r["sample"]) for r in unique}
    todo = [(ex, k) for ex in examples for k in range(s.n) if (ex.id, k) not in seen]
    bar = self._bar(name, len(examples) * s.n, len(unique), unique)
    with open(path, "a") if path is not None else contextlib.nullcontext() as f:
      for b in range(0, len(todo), s.batch_size):
        batch = todo[b : b + s.batch_size]
        start = bar.n if bar is not None else 0
        live = (lambda: bar.update(1)) if bar is not None else None  # the bar moves as answers finish
        for rec in self._run_batch(name, batch, seed=s.seed * 1_000_003 + len(unique) + b, on_finished=live):
          if f is not None:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
          unique.append(rec)
        if bar is not None:  # answers the rollout did not report (too-long prompts, a caller's rollouts)
          bar.update(start + len(batch) - bar.n)
          bar.set_postfix(acc=f"{_mean(r['score'] for r in unique):.3f}")
    if bar is not None:
      bar.close()
    order = {(ex.id, k): i for i, (ex, k) in enumerate((ex, k) for ex in examples for k in range(s.n))}
    return sorted(unique, key=lambda r: order[(r["id"], r["sample"])])

  def _bar(self, name, total, done, records):
    if not self.show_progress:
      return None
    from tqdm import tqdm

    bar = tqdm(total=total, initial=done, desc=name, unit="ans", dynamic_ncols=True)
    if records:
      bar.set_postfix(acc=f"{_mean(r['score'] for r in records):.3f}")
    return bar

  def _run_batch(self, name: str, batch, seed: int, on_finished=None) -> list[dict]:
    s = self.settings
    prompts, runnable, out = [], [], {}
    for i, (ex, k) in enumerate(batch):
      ids = self.prompt_tokens(ex)
      if len(ids) > s.max_prompt_len:  # recorded as a wrong answer, not silently dropped
        out[i] = self._record(name, ex, k, "", stop_reason="prompt_too_long", prompt_len=len(ids))
      else:
        prompts.append(ids)
        runnable.append(i)
    if prompts:
      t0 = time.monotonic()
      kw = {"on_finished": on_finished} if on_finished is not None and _accepts(self.rollouts, "on_finished") else {}
      traj = self.rollouts(self.policy.params, prompts, seed=seed, **kw)
      dt = (time.monotonic() - t0) / len(prompts)
      for row, i in enumerate(runnable):
        ex, k = batch[i]
        out[i] = self._record(
          name,
          ex,
          k,
          traj.response_text[row],
          stop_reason=traj.stop_reason_b[row],
          prompt_len=int(traj.prompt_len_b[row]),
          response_len=int(traj.response_len_b[row]),
          num_tool_calls=int(traj.num_tool_calls_b[row]),
          seconds=dt,
        )
    return [out[i] for i in range(len(batch))]

  def _record(self, name, ex: Example, k: int, response: str, **extra) -> dict:
    rec = {
      "benchmark": name,
      "id": ex.id,
      "sample": k,
      "family": ex.family,
      "question": ex.question,
      "answers": list(ex.answers),
      "response": response,
      "tool_calls": tool_calls_from_text(response),
    }
    if extra.get("stop_reason") == "timeout":  # the official timeout record: text so far + the marker
      response = f"{response}\n[Timeout (exceeding {self.settings.sample_timeout_s:g}s)]"
      rec["response"] = response
    rec.update(extra)
    rec.update(self._score(ex, response, extra.get("stop_reason")))
    return rec

  def _score(self, ex: Example, response: str, stop_reason) -> dict:
    """The scorer's verdict; a timed-out answer's prediction is "Timeout", as the official record has it."""
    if stop_reason == "timeout":
      return self.scorer.score(ex, response, TIMEOUT_PREDICTION)
    return self.scorer.score(ex, response)  # (a caller's scorer may take no prediction)


def _mean(xs) -> float:
  xs = list(xs)
  return sum(xs) / len(xs) if xs else 0.0


def _accepts(fn, name: str) -> bool:
  """Whether `fn` takes the keyword `name` (a caller's rollouts object may not)."""
  import inspect

  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False
  return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
