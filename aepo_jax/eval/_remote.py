"""The agent loop against a served policy: any OpenAI-compatible server (`launch/serve.py`, vLLM, SGLang) in place of
the engine, with the tools, protocol and records of evaluating a checkpoint directly.

  rollouts = RemoteRollouts("http://127.0.0.1:8000/v1", "my-model", tokenizer, tools, settings.rollout_settings())
  traj = rollouts(None, prompt_ids, seed=0)       # Trajectories, as `aepo_jax.rollout.Rollouts` returns them
  Evaluator(Policy(None, None, tokenizer, rollouts.source), tools, scorer, settings, rollouts=rollouts)

Each trajectory is a sequence of `POST {url}/completions` requests, as the local agent loop (`AgentLoop`) makes
generation calls: the prompt goes as TOKEN IDS (the prompt and every token of the response so far, tool results
included), so nothing is re-tokenised; the stop strings are the tools' closing tags (`</python>`, ...: the ToolSet's
tags) with `include_stop_str_in_output` and `skip_special_tokens=false`; `max_tokens` is the call's budget
(min(max_tokens_per_call, the room left in max_response_len)). A request that stops at a closing tag is parsed
(`tools.parse_tool_call` of the whole text), submitted to the same ToolSet (mode 'eval': per-tool limits and refusal
text, a call's own CallState), and its result written by `tools.format_result` in the settings' result_mode and
appended as token ids (`tokenizer.encode_continuation`) before the next request. The trajectory's stop reasons are
the local loop's: 'eos' (the server ended the text: end of turn), 'length' (max_response_len reached, or a tool
result that does not fit), 'call_tokens' (a call reached max_tokens_per_call; with max_calls_per_turn > 1 it is
first continued by further calls until the turn has written `</answer>` or used its calls), 'call_limit' (the loop's
own max_tool_calls; EOS appended), 'empty_tool_call', 'stop_sequence' (a closing tag with no call to parse).

Token-exact when the server returns the generated token ids (`return_token_ids`: this project's server and vLLM >=
0.10.2 answer each choice with `token_ids`, which end with the token that completed the stop string, or with the EOS
token). A server that does not (SGLang, older vLLM) is read from its text: the text is encoded with
`encode_continuation`, the stop string appended when the server left it out (`stop_reason`, SGLang's
`matched_stop`), and at an end of turn the EOS id the server names, else the tokenizer's `eos_id`. That can differ from what the model sampled (another tokenisation of the same
text; a closing tag that ends inside a token), so such runs are exact in text but not necessarily in tokens; the
rollout's stats say how many requests came back with ids (`rollout/remote_token_ids`).

Sampling is `settings.sampling` sent as vLLM's fields (temperature 0 is greedy); the prompts of one call go as
concurrent requests (at most `settings.max_slots` at once), each trajectory on its own. Connection errors, timeouts,
HTTP 429 and 5xx are retried; what still fails raises `PolicyServerError`, one line naming the URL and the fix.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import threading
import time
from typing import Optional, Sequence

import numpy as np

_log = logging.getLogger("aepo_jax.eval")
_RETRY_STATUS = (429, 500, 502, 503, 504)


class PolicyServerError(RuntimeError):
  """The served policy could not be reached or refused a request; the message names the URL and the fix."""


def _base(url: str) -> str:
  return url.rstrip("/")


def _headers(api_key: Optional[str]) -> dict:
  headers = {"Content-Type": "application/json", "Accept": "application/json"}
  if api_key:
    headers["Authorization"] = f"Bearer {api_key}"
  return headers


def _server_message(body: bytes) -> str:
  """The OpenAI error message of an error body, else its first characters."""
  try:
    message = json.loads(body)["error"]["message"]
    if isinstance(message, str):
      return message
  except (ValueError, KeyError, TypeError):
    pass
  return body[:300].decode(errors="replace")


def _fix(url: str, model: str) -> str:
  return (
    f"start the server (python launch/serve.py ..., vllm serve ..., or SGLang) so that it serves {model!r} at {url}, "
    "or fix --policy_url / --policy_model"
  )


def probe_policy_server(url: str, model: str, *, api_key: Optional[str] = None, timeout_s: float = 10.0) -> None:
  """Checks that `GET {url}/models` answers and lists `model`; raises PolicyServerError naming the fix."""
  from aepo_jax.tools import http_request

  where = _base(url) + "/models"
  try:
    status, body = http_request("GET", where, headers=_headers(api_key), timeout_s=timeout_s)
  except (OSError, ValueError) as e:
    raise PolicyServerError(
      f"the policy server at {url} did not answer GET {where} ({e}); {_fix(url, model)}."
    ) from None
  if status in (401, 403):
    raise PolicyServerError(
      f"the policy server at {url} refused the API key (HTTP {status}); give its key with --policy_api_key or "
      "$AEPO_JAX_POLICY_API_KEY."
    )
  if status >= 400:
    raise PolicyServerError(
      f"the policy server at {url} answered GET {where} with HTTP {status} ({_server_message(body)}); "
      f"{_fix(url, model)} (the URL is the OpenAI base, e.g. http://127.0.0.1:8000/v1)."
    )
  try:
    served = [str(m["id"]) for m in json.loads(body)["data"]]
  except (ValueError, KeyError, TypeError):
    raise PolicyServerError(
      f"{where} did not answer an OpenAI model list; is {url} an OpenAI-compatible base URL (e.g. .../v1)?"
    ) from None
  if model not in served:
    raise PolicyServerError(f"the policy server at {url} serves {served}, not {model!r}; fix --policy_model.")


@dataclasses.dataclass
class _Row:
  """One trajectory on the host: response ids, which of them the model generated, how it ended."""

  tokens: list = dataclasses.field(default_factory=list)
  mask: list = dataclasses.field(default_factory=list)
  stop_reason: str = ""
  num_tool_calls: int = 0
  requests: int = 0
  with_ids: int = 0

  def append(self, ids, mask: int) -> None:
    self.tokens.extend(int(t) for t in ids)
    self.mask.extend([mask] * len(ids))


class RemoteRollouts:
  """`aepo_jax.rollout.Rollouts`' face (`weights`, `__call__(weights, prompt_ids, seed)` -> Trajectories,
  `describe`) over an OpenAI-compatible server; see the module docstring.

  url: the OpenAI base URL (http://HOST:PORT/v1). model: the served model name. tokenizer: the policy's (its
  `decode`, `encode_continuation`, `eos_id`). tools: the evaluation ToolSet. settings: `RolloutSettings` (policy
  'none'; `EvalSettings.rollout_settings()`). api_key: sent as `Authorization: Bearer`. timeout_s: per request
  (one generation call, up to max_tokens_per_call tokens); retries: further attempts after a connection error,
  timeout, 429 or 5xx.
  """

  def __init__(
    self,
    url: str,
    model: str,
    tokenizer,
    tools,
    settings,
    *,
    api_key: Optional[str] = None,
    timeout_s: float = 600.0,
    retries: int = 2,
    backoff_s: float = 1.0,
  ):
    from aepo_jax.tools import format_result, parse_tool_call, trajectory_steps

    if not url or not model:
      raise ValueError(
        f"RemoteRollouts needs the server's OpenAI base URL and model name (got {url!r}, {model!r}), "
        "e.g. http://127.0.0.1:8000/v1 and the name it serves."
      )
    if settings.policy != "none":
      raise ValueError(
        f"RemoteRollouts runs independent samples (rollout policy 'none'), not {settings.policy!r}: tree rollouts "
        "fork the engine's cache, which a server does not expose."
      )
    self.url, self.model, self.tokenizer, self.tools, self.settings = _base(url), model, tokenizer, tools, settings
    self.api_key, self.timeout_s, self.retries, self.backoff_s = api_key, timeout_s, retries, backoff_s
    self._parse, self._format, self._steps = parse_tool_call, format_result, trajectory_steps
    self.tool_tags = tuple(tools.tags) if tools is not None else ()
    self.result_tags = dict(getattr(tools, "result_tags", None) or {})
    self.stops = [f"</{t}>" for t in self.tool_tags]
    eos = getattr(tokenizer, "eos_id", None)
    self.eos_id = int(eos if eos is not None else tokenizer.eos_ids[0])
    pad = getattr(tokenizer, "pad_id", None)
    self.pad_id = int(pad if pad is not None else self.eos_id)
    self.source = f"served policy {model!r} at {self.url}"
    self._warned = False

  # ------------------------------------------------------------------------------------------------ face
  def weights(self, params):
    """Nothing to place: the server holds the weights."""
    return params

  def describe(self) -> dict:
    s = self.settings
    return {
      "policy_url": self.url,
      "policy_model": self.model,
      "stop": list(self.stops),
      "sampling": dataclasses.asdict(s.sampling),
      "max_response_len": s.max_response_len,
      "max_tokens_per_call": s.max_tokens_per_call,
      "max_calls_per_turn": s.max_calls_per_turn,
      "sample_timeout_s": s.sample_timeout_s,
      "max_tool_calls": s.max_tool_calls,
      "result_mode": s.result_mode,
      "tool_tags": list(self.tool_tags),
    }

  def __call__(self, weights, prompt_ids: Sequence[Sequence[int]], seed: int = 0, on_finished=None):
    """policy_config.n trajectories per prompt, rows prompt-major; `weights` is ignored; `on_finished()` is called
    as each trajectory ends."""
    prompts = [[int(t) for t in p] for p in prompt_ids]
    if not prompts or not all(prompts):
      raise ValueError("RemoteRollouts: no prompts, or an empty one.")
    n = self.settings.policy_config.n
    jobs = [(p, p * n + k) for p in range(len(prompts)) for k in range(n)]
    abort = threading.Event()
    pool = concurrent.futures.ThreadPoolExecutor(
      max_workers=min(len(jobs), self.settings.max_slots), thread_name_prefix="remote_rollout"
    )
    futures = [pool.submit(self._trajectory, prompts[p], seed, index, abort) for p, index in jobs]
    try:
      for f in concurrent.futures.as_completed(futures):
        f.result()  # the first failure raises at once
        if on_finished is not None:
          on_finished()
    except BaseException:
      abort.set()
      pool.shutdown(wait=False, cancel_futures=True)
      raise
    pool.shutdown(wait=True)
    rows = [f.result() for f in futures]
    return self._assemble([prompts[p] for p, _ in jobs], [p for p, _ in jobs], rows)

  # ------------------------------------------------------------------------------------------------ one trajectory
  def _trajectory(self, prompt: list, seed: int, index: int, abort: threading.Event) -> _Row:
    from aepo_jax.tools import CallState

    s = self.settings
    cap, limit = s.max_tokens_per_call, s.max_response_len
    row, state = _Row(), CallState()
    turn_start, turn_calls = 0, 1  # where the open turn (text up to a tool call or the end) began; its calls
    deadline = time.monotonic() + s.sample_timeout_s if s.sample_timeout_s else None
    while True:
      if abort.is_set():
        raise PolicyServerError(f"the rollout against {self.url} was abandoned after another request failed.")
      if deadline is not None and time.monotonic() > deadline:  # checked between requests and tool calls
        row.stop_reason = "timeout"
        return row
      room = limit - len(row.tokens)
      budget = min(room, cap) if cap else room
      ids, finish, stop = self._complete(prompt + row.tokens, budget, self._seed(seed, index, row.requests), row)
      row.append(ids, mask=1)
      if finish == "tool":
        text = self.tokenizer.decode(prompt + row.tokens)
        call = self._parse(text, self.tool_tags)
        if call is None or not text.rstrip().endswith(f"</{call.tag}>"):
          row.stop_reason = "stop_sequence"
          return row
        if row.num_tool_calls >= s.max_tool_calls:
          return self._limit(row)
        steps = (
          self._steps(row.tokens, row.mask, self.tokenizer.decode) if self.tools.wants_trajectory(call.tag) else None
        )
        try:
          out = self.tools.submit(call, state, trajectory=steps).result(
            timeout=None if deadline is None else max(deadline - time.monotonic(), 0.0)
          )
        except concurrent.futures.TimeoutError:  # the tool's thread finishes on its own; its result is unused
          row.stop_reason = "timeout"
          return row
        if out.info.get("limit_reached"):
          return self._limit(row)
        if out.info.get("empty_call"):  # the official rollout ends the copy silently (spec §1.2 2.3)
          row.stop_reason = "empty_tool_call"
          return row
        row.num_tool_calls += 1
        result = self._encode(self._format(out.text, s.result_mode, self.result_tags.get(out.tag, "result")))
        room = limit - len(row.tokens)
        row.append(result[:room], mask=0)
        if len(result) >= room:  # no room left to generate: truncated at L
          row.stop_reason = "length"
          return row
        turn_start, turn_calls = len(row.tokens), 1
        continue
      if finish == "eos":
        row.stop_reason = "eos"
        return row
      if cap and len(row.tokens) < limit:  # the call's cap, not L
        written = self.tokenizer.decode(row.tokens[turn_start:])
        if turn_calls < s.max_calls_per_turn and "</answer>" not in written:
          turn_calls += 1  # the official engine's continuation: the same turn, a fresh cap
          continue
        row.stop_reason = "call_tokens"
        return row
      row.stop_reason = "length"
      return row

  def _limit(self, row: _Row) -> _Row:
    """A call over the loop's max_tool_calls: EOS appended, the trajectory ends (the local loop's rule)."""
    if len(row.tokens) < self.settings.max_response_len:
      row.append([self.eos_id], mask=1)
    row.stop_reason = "call_limit"
    return row

  def _seed(self, seed: int, index: int, call: int) -> int:
    return (int(seed) * 1_000_003 + index * 92_821 + call * 7_919 + 17) % (2**31 - 1)

  def _encode(self, text: str) -> list:
    tok = self.tokenizer
    if hasattr(tok, "encode_continuation"):
      return [int(t) for t in tok.encode_continuation(text)]
    return [int(t) for t in tok.encode(text, add_special_tokens=False)]

  # ------------------------------------------------------------------------------------------------ HTTP
  def _complete(self, ids: list, max_tokens: int, seed: int, row: _Row) -> tuple:
    """One generation call: (generated ids, 'tool' | 'eos' | 'length', the stop string or None)."""
    sp = self.settings.sampling
    greedy = sp.temperature <= 0
    body = {
      "model": self.model,
      "prompt": ids,
      "max_tokens": int(max_tokens),
      "temperature": 0.0 if greedy else float(sp.temperature),
      "top_p": 1.0 if greedy else float(sp.top_p),
      "top_k": -1 if greedy or not sp.top_k else int(sp.top_k),
      "min_p": 0.0 if greedy else float(sp.min_p),
      "repetition_penalty": float(sp.repetition_penalty),
      "seed": int(seed),
      "n": 1,
      "stop": list(self.stops),
      "include_stop_str_in_output": True,
      "skip_special_tokens": False,
      "return_token_ids": True,
    }
    if not self.stops:
      del body["stop"]
    choice = self._post(body)
    row.requests += 1
    try:
      text = str(choice.get("text") or "")
      finish = choice.get("finish_reason")
      stop = choice.get("stop_reason", choice.get("matched_stop"))  # vLLM and ours; SGLang's name
      token_ids = choice.get("token_ids")
    except AttributeError:
      raise PolicyServerError(f"{self.url}/completions answered a choice that is not an object: {choice!r}") from None
    tool_stop = stop if isinstance(stop, str) and stop in self.stops else None
    if finish == "stop" and tool_stop is None and stop is None:  # servers without stop_reason: the text tells
      tool_stop = next((s for s in self.stops if text.endswith(s)), None)
    if isinstance(token_ids, list) and all(isinstance(t, int) for t in token_ids):
      row.with_ids += 1
      out = [int(t) for t in token_ids]
    else:
      self._warn_text()
      if tool_stop is not None and not text.endswith(tool_stop):  # a server that leaves the stop string out
        text += tool_stop
      out = self._encode(text)
      if finish == "stop" and tool_stop is None and (stop is None or isinstance(stop, int)):
        out.append(self.eos_id if stop is None else int(stop))  # the end of turn the server did not write out
    if finish == "stop":
      return out, ("tool" if tool_stop is not None else "eos"), tool_stop
    if finish == "length":
      return out, "length", None
    raise PolicyServerError(
      f"{self.url}/completions answered finish_reason={finish!r}; expected 'stop' or 'length' (an OpenAI-compatible "
      "completions server)."
    )

  def _warn_text(self) -> None:
    if not self._warned:
      self._warned = True
      _log.warning(
        "%s answers without token_ids (return_token_ids); reading its text back with encode_continuation: the text "
        "is the server's, the token ids may differ from those it sampled.",
        self.url,
      )

  def _post(self, body: dict) -> dict:
    from aepo_jax.tools import http_request

    where = f"{self.url}/completions"
    data = json.dumps(body).encode()
    last = None
    for attempt in range(self.retries + 1):
      if attempt:
        time.sleep(self.backoff_s * 2 ** (attempt - 1))
      try:
        status, payload = http_request(
          "POST", where, data=data, headers=_headers(self.api_key), timeout_s=self.timeout_s
        )
      except TimeoutError:
        last = f"no answer within {self.timeout_s:g} s"
        continue
      except (OSError, ValueError) as e:
        last = str(e) or type(e).__name__
        continue
      if status in _RETRY_STATUS:
        last = f"HTTP {status}: {_server_message(payload)}"
        continue
      if status in (401, 403):
        raise PolicyServerError(
          f"the policy server at {self.url} refused the API key (HTTP {status}); give its key with "
          "--policy_api_key or $AEPO_JAX_POLICY_API_KEY."
        )
      if status >= 400:
        raise PolicyServerError(
          f"the policy server at {self.url} refused a completion (HTTP {status}: {_server_message(payload)}); check "
          f"--policy_model={self.model!r}, and that the server's context holds max_prompt_len + max_response_len "
          f"({self.settings.max_prompt_len} + {self.settings.max_response_len} tokens)."
        )
      try:
        choice = json.loads(payload)["choices"][0]
      except (ValueError, KeyError, IndexError, TypeError):
        raise PolicyServerError(
          f"{where} did not answer an OpenAI completion ({payload[:200].decode(errors='replace')!r}); is {self.url} "
          "an OpenAI-compatible base URL (e.g. .../v1)?"
        ) from None
      if not isinstance(choice, dict):
        raise PolicyServerError(f"{where} answered a choice that is not an object: {choice!r}")
      return choice
    raise PolicyServerError(
      f"the policy server at {self.url} failed {self.retries + 1} attempts of POST {where} ({last}); "
      f"{_fix(self.url, self.model)}."
    )

  # ------------------------------------------------------------------------------------------------ batch
  def _assemble(self, prompts: list, groups: list, rows: list):
    from aepo_jax.rollout import Trajectories

    total = [len(p) + len(r.tokens) for p, r in zip(prompts, rows)]
    t, b = max(total), len(rows)
    tokens = np.full((b, t), self.pad_id, np.int32)
    loss, attn = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    for i, (p, r) in enumerate(zip(prompts, rows)):
      tokens[i, : len(p)] = p
      tokens[i, len(p) : total[i]] = r.tokens
      loss[i, len(p) : total[i]] = r.mask
      attn[i, : total[i]] = 1
    requests = sum(r.requests for r in rows)
    return Trajectories(
      tokens_bt=tokens,
      prompt_len_b=np.asarray([len(p) for p in prompts], np.int32),
      response_len_b=np.asarray([len(r.tokens) for r in rows], np.int32),
      loss_mask_bt=loss,
      attention_mask_bt=attn,
      sampler_logprob_bt=np.zeros((b, t), np.float32),
      sampler_entropy_bt=np.zeros((b, t), np.float32),
      group_id_b=np.asarray(groups, np.int32),
      parent_b=np.full((b,), -1, np.int32),
      fork_pos_b=np.full((b,), -1, np.int32),
      num_tool_calls_b=np.asarray([r.num_tool_calls for r in rows], np.int32),
      stop_reason_b=[r.stop_reason for r in rows],
      response_text=[self.tokenizer.decode(r.tokens) for r in rows],
      kind_b=["global"] * b,
      stats={
        "rollout/remote_requests": float(requests),
        "rollout/remote_token_ids": float(sum(r.with_ids for r in rows)) / max(requests, 1),
      },
    )
