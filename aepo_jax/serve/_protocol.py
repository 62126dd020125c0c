"""OpenAI request bodies (completions and chat completions, with vLLM's extra fields) -> a checked `GenRequest`,
and `ApiError`, which the HTTP layer turns into OpenAI's error schema.

Fields: prompt (string, list of strings, token ids, list of token-id lists) or messages; max_tokens /
max_completion_tokens; temperature (below 1e-5 is greedy, as vLLM); top_p; top_k (0 or -1 disable); min_p;
repetition_penalty; ignore_eos; stop; stop_token_ids; include_stop_str_in_output; skip_special_tokens; n;
best_of (= n);
seed; logprobs (completions: an int; chat: a bool with top_logprobs); echo; stream / stream_options;
return_tokens_as_token_ids; return_token_ids; chat_template_kwargs / add_generation_prompt (chat).
presence_penalty / frequency_penalty / logit_bias are accepted only at their neutral values. Other fields are
ignored, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from aepo_jax.rollout import SamplingParams

MAX_LOGPROBS = 20
_GREEDY_EPS = 1e-5


class ApiError(Exception):
  """An error answered with HTTP `status` and {"error": {"message", "type", "param", "code"}}."""

  def __init__(
    self,
    status: int,
    message: str,
    param: Optional[str] = None,
    type_: str = "invalid_request_error",
    code: Optional[str] = None,
    headers: Optional[dict] = None,
  ):
    super().__init__(message)
    self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
    self.headers = headers or {}

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: Optional[str] = None) -> ApiError:
  return ApiError(400, message, param)


@dataclasses.dataclass
class GenRequest:
  chat: bool
  prompts: list  # token-id lists, one per prompt
  n: int
  max_tokens: list  # per prompt
  sampling: SamplingParams
  seed: Optional[int]
  stop: tuple
  stop_token_ids: tuple
  include_stop: bool
  skip_special_tokens: bool
  logprobs: Optional[int]  # None: no log-probs; k: the token's and the top k
  echo: bool
  stream: bool
  include_usage: bool
  tokens_as_ids: bool
  return_token_ids: bool
  prompt_texts: list  # for echo


def _get(body, name, kind, default=None, *, check=None, why=""):
  value = body.get(name, default)
  if value is None:
    return default
  ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    value, ok = float(value), True
  if not ok or (check is not None and not check(value)):
    raise bad(f"'{name}' must be {why}; got {value!r}.", name)
  return value


def _token_list(value, vocab: int, param: str) -> list:
  if not value or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
    raise bad(f"'{param}' token ids must be a non-empty list of integers.", param)
  if min(value) < 0 or max(value) >= vocab:
    raise bad(f"'{param}' has token ids outside [0, {vocab}).", param)
  return [int(t) for t in value]


def _prompts(body, tokenizer, vocab: int):
  """(token lists, texts) of a completions `prompt`."""
  p = body.get("prompt")
  if p is None:
    raise bad("'prompt' is required.", "prompt")
  if isinstance(p, str):
    p = [p]
  if not isinstance(p, list) or not p:
    raise bad(
      "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists.", "prompt"
    )
  if all(isinstance(t, int) and not isinstance(t, bool) for t in p):
    p = [p]
  toks, texts = [], []
  for item in p:
    if isinstance(item, str):
      ids = tokenizer.encode(item)
      if not ids:
        raise bad("'prompt' is empty (no tokens); give at least one token.", "prompt")
      toks.append(ids)
      texts.append(item)
    elif isinstance(item, list):
      ids = _token_list(item, vocab, "prompt")
      toks.append(ids)
      texts.append(tokenizer.decode(ids))
    else:
      raise bad("'prompt' list entries must all be strings or all token-id lists.", "prompt")
  return toks, texts


def _chat_prompt(body, tokenizer):
  msgs = body.get("messages")
  if not isinstance(msgs, list) or not msgs:
    raise bad("'messages' must be a non-empty list of {'role', 'content'} objects.", "messages")
  out = []
  for i, m in enumerate(msgs):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
      raise bad(f"messages[{i}] must be an object with a string 'role'.", "messages")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text
      texts = []
      for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
          raise bad(
            f"messages[{i}].content parts must be {{'type': 'text', 'text': ...}}; this model reads text only.",
            "messages",
          )
        texts.append(part["text"])
      content = "".join(texts)
    elif content is None:
      content = ""
    elif not isinstance(content, str):
      raise bad(f"messages[{i}].content must be a string or a list of text parts.", "messages")
    out.append({**m, "content": content})
  kwargs = _get(body, "chat_template_kwargs", dict, {}, why="an object")
  gen = _get(body, "add_generation_prompt", bool, True, why="a boolean")
  try:
    text = tokenizer.render_chat(out, add_generation_prompt=gen, **kwargs)
  except Exception as e:  # noqa: BLE001 (a template error is the request's fault)
    raise bad(f"the chat template failed on these messages: {e}", "messages") from e
  ids = tokenizer.encode(text, add_bos=False)
  if not ids:
    raise bad("the templated conversation has no tokens.", "messages")
  return ids, text


def parse_request(body, *, chat: bool, tokenizer, vocab_size: int, max_len: int, max_slots: int) -> GenRequest:
  """Checks a request body; raises ApiError(400) naming the field."""
  if not isinstance(body, dict):
    raise bad("the request body must be a JSON object.")
  if chat:
    ids, text = _chat_prompt(body, tokenizer)
    prompts, texts = [ids], [text]
  else:
    prompts, texts = _prompts(body, tokenizer, vocab_size)
  n = _get(
    body, "n", int, 1, check=lambda v: 1 <= v <= max_slots, why=f"an integer in [1, {max_slots}] (the server's slots)"
  )
  best_of = _get(body, "best_of", int, None, why="an integer")
  if best_of is not None and best_of != n:
    raise bad(f"'best_of'={best_of} other than n={n} is not supported.", "best_of")
  temperature = _get(body, "temperature", float, 1.0, check=lambda v: 0 <= v < math.inf, why="a number >= 0")
  top_p = _get(body, "top_p", float, 1.0, check=lambda v: 0 < v <= 1, why="a number in (0, 1]")
  top_k = _get(body, "top_k", int, 0, check=lambda v: v >= -1, why="an integer >= -1 (-1 or 0 disable it)")
  top_k = min(max(top_k, 0), vocab_size)
  min_p = _get(body, "min_p", float, 0.0, check=lambda v: 0 <= v <= 1, why="a number in [0, 1]")
  rep = _get(body, "repetition_penalty", float, 1.0, check=lambda v: 0 < v < math.inf, why="a number > 0")
  for name in ("presence_penalty", "frequency_penalty"):
    if _get(body, name, float, 0.0, why="a number") != 0.0:
      raise bad(f"'{name}' is not supported (use repetition_penalty).", name)
  if body.get("logit_bias"):
    raise bad("'logit_bias' is not supported.", "logit_bias")
  if body.get("suffix"):
    raise bad("'suffix' is not supported.", "suffix")
  ignore_eos = _get(body, "ignore_eos", bool, False, why="a boolean")
  greedy = temperature < _GREEDY_EPS
  sampling = SamplingParams(
    0.0 if greedy else temperature,
    1.0 if greedy else top_p,
    0 if greedy else top_k,
    0.0 if greedy else min_p,
    rep,
    ignore_eos,
  )
  seed = _get(body, "seed", int, None, why="an integer")
  stop = body.get("stop")
  stop = [stop] if isinstance(stop, str) else (stop or [])
  if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
    raise bad("'stop' must be a non-empty string or a list of them.", "stop")
  stop_ids = body.get("stop_token_ids") or []
  if stop_ids:
    stop_ids = _token_list(stop_ids, vocab_size, "stop_token_ids")
  include_stop = _get(body, "include_stop_str_in_output", bool, False, why="a boolean")
  skip_special = _get(body, "skip_special_tokens", bool, True, why="a boolean")
  if chat:
    want = _get(body, "logprobs", bool, False, why="a boolean")
    top = _get(
      body, "top_logprobs", int, 0, check=lambda v: 0 <= v <= MAX_LOGPROBS, why=f"an integer in [0, {MAX_LOGPROBS}]"
    )
    if top and not want:
      raise bad("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
    logprobs = top if want else None
    echo = False
  else:
    logprobs = _get(
      body, "logprobs", int, None, check=lambda v: 0 <= v <= MAX_LOGPROBS, why=f"an integer in [0, {MAX_LOGPROBS}]"
    )
    echo = _get(body, "echo", bool, False, why="a boolean")
  if logprobs is not None:
    logprobs = min(logprobs, vocab_size)
  stream = _get(body, "stream", bool, False, why="a boolean")
  opts = _get(body, "stream_options", dict, {}, why="an object")
  if opts and not stream:
    raise bad("'stream_options' needs 'stream': true.", "stream_options")
  include_usage = _get(opts, "include_usage", bool, False, why="a boolean")
  # max_tokens: completions default 16 (OpenAI's); chat: the rest of the context. Prompt + tokens <= max_len.
  max_tokens = _get(
    body,
    "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens",
    int,
    None,
    check=lambda v: v >= 1,
    why="an integer >= 1",
  )
  where = "messages" if chat else "prompt"
  budgets = []
  for ids in prompts:
    if len(ids) >= max_len:
      raise bad(
        f"This model's maximum context length is {max_len} tokens. However, your {where} has {len(ids)} "
        f"tokens, which leaves no room to generate. Please reduce the length of the {where}.",
        where,
      )
    if max_tokens is not None and len(ids) + max_tokens > max_len:
      raise bad(
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{len(ids) + max_tokens} tokens ({len(ids)} in the {where}, {max_tokens} in the completion). "
        f"Please reduce the length of the {where} or completion.",
        "max_tokens",
      )
    room = max_len - len(ids)
    budgets.append(max_tokens if max_tokens is not None else (room if chat else min(16, room)))
  return GenRequest(
    chat=chat,
    prompts=prompts,
    n=n,
    max_tokens=budgets,
    sampling=sampling,
    seed=seed,
    stop=tuple(stop),
    stop_token_ids=tuple(stop_ids),
    include_stop=include_stop,
    skip_special_tokens=skip_special,
    logprobs=logprobs,
    echo=echo,
    stream=stream,
    include_usage=include_usage,
    tokens_as_ids=_get(body, "return_tokens_as_token_ids", bool, False, why="a boolean"),
    return_token_ids=_get(body, "return_token_ids", bool, False, why="a boolean"),
    prompt_texts=texts,
  )
