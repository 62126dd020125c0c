"""One request's choices: their text, log-probs and finish state, and the OpenAI response objects built from them."""

from __future__ import annotations

import time
import uuid
from typing import Optional

from aepo_jax.serve._protocol import GenRequest
from aepo_jax.serve._text import ChoiceText


class _Run:
  """The text, log-probs and finish state of one request's choices, and its OpenAI response objects."""

  def __init__(self, app, req: GenRequest, jobs):  # app: the Server
    self.app, self.req, self.jobs, self.sink = app, req, jobs, jobs[0].sink
    self.tok = app.tokenizer
    self.chat = req.chat
    self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex
    self.created = int(time.time())
    self.texts = {
      (i, c): ChoiceText(
        self.tok,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        include_stop=req.include_stop,
        skip_special_tokens=req.skip_special_tokens,
        eos_ids=app.eos_ids,
      )
      for i in range(len(jobs))
      for c in range(req.n)
    }
    self.finish = {}  # (i, c) -> 'stop' | 'length'
    self.prompt_lp = {}  # i -> Update with the prompt's log-probs

  @property
  def finished(self) -> bool:
    need_prompt = self.jobs[0].prompt_logprobs is not None
    return len(self.finish) == len(self.texts) and (not need_prompt or len(self.prompt_lp) == len(self.jobs))

  def index(self, key) -> int:
    return key[0] * self.req.n + key[1]

  def apply(self, u, stream: bool = False) -> list:
    """Takes one update; with stream, returns the chunks to send for it."""
    if u.choice < 0:
      self.prompt_lp[u.tag] = u
      return []
    key = (u.tag, u.choice)
    if key in self.finish:
      return []  # tokens decoded after a stop found on the host
    ct = self.texts[key]
    ct.push(u.tokens, u.logprobs, u.top_ids, u.top_logprobs, final=u.finish)
    if ct.stopped:
      self.finish[key] = "stop"
      self.app.scheduler.stop_choice(self.jobs[u.tag], u.choice)
    elif u.finish is not None:
      self.finish[key] = "length" if u.finish in ("length", "cache_full") else "stop"
    if not stream:
      return []
    delta, pieces = ct.take(done=key in self.finish)
    if not (delta or pieces or key in self.finish):
      return []
    chunk = self._chunk(key, delta, pieces, self.finish.get(key))
    if len(self.finish) == len(self.texts) and not self.req.include_usage:
      chunk["usage"] = self.usage()  # every response carries usage: here on the stream's last chunk
    return [chunk]

  # ------------------------------------------------------------------------------------------------
  # Objects
  # ------------------------------------------------------------------------------------------------
  def usage(self) -> dict:
    prompt = sum(len(p) for p in self.req.prompts)
    done = sum(ct.num_tokens for ct in self.texts.values())
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

  def _tstr(self, tid: int) -> str:
    return f"token_id:{tid}" if self.req.tokens_as_ids else self.tok.decode([tid])

  def _logprobs(self, pieces, base: int = 0, prompt: Optional[dict] = None):
    if self.req.logprobs is None:
      return None
    k = self.req.logprobs
    if self.chat:

      def entry(t, lp):
        s = self._tstr(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

      return {
        "content": [
          {**entry(p.token_id, p.logprob), "top_logprobs": [entry(t, lp) for t, lp in p.top[:k]]} for p in pieces
        ]
      }
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if prompt is not None:  # echo: the prompt's tokens first (the first has no log-prob)
      out = prompt
    for p in pieces:
      top = {self._tstr(t): lp for t, lp in p.top[:k]}
      top.setdefault(self._tstr(p.token_id), p.logprob)
      out["tokens"].append(self._tstr(p.token_id))
      out["token_logprobs"].append(p.logprob)
      out["top_logprobs"].append(top)
      out["text_offset"].append(base + p.offset)
    return out

  def _prompt_logprobs(self, i: int) -> dict:
    u = self.prompt_lp[i]
    ids = [int(t) for t in u.tokens]
    ct = ChoiceText(self.tok, skip_special_tokens=False)
    ct.push(ids)
    k = self.req.logprobs
    out = {
      "tokens": [self._tstr(t) for t in ids],
      "token_logprobs": [None] + [float(x) for x in u.logprobs],
      "top_logprobs": [None],
      "text_offset": [p.offset for p in ct.pieces],
    }
    for j in range(len(ids) - 1):
      top = {self._tstr(int(t)): float(v) for t, v in zip(u.top_ids[j][:k], u.top_logprobs[j][:k])}
      top.setdefault(self._tstr(ids[j + 1]), float(u.logprobs[j]))
      out["top_logprobs"].append(top)
    return out

  def _choice_extra(self, key) -> dict:
    ct = self.texts[key]
    extra = {"stop_reason": ct.stop_reason}
    if self.req.return_token_ids:
      extra["prompt_token_ids"] = self.req.prompts[key[0]]
      extra["token_ids"] = list(ct.token_ids)
    return extra

  def response(self) -> dict:
    choices = []
    for key in sorted(self.texts, key=self.index):
      ct = self.texts[key]
      if self.chat:
        choice = {
          "index": self.index(key),
          "message": {"role": "assistant", "content": ct.text},
          "logprobs": self._logprobs(ct.pieces),
          "finish_reason": self.finish[key],
        }
      else:
        echo = self.req.prompt_texts[key[0]] if self.req.echo else ""
        prompt = self._prompt_logprobs(key[0]) if (self.req.echo and self.req.logprobs is not None) else None
        choice = {
          "index": self.index(key),
          "text": echo + ct.text,
          "logprobs": self._logprobs(ct.pieces, len(echo), prompt),
          "finish_reason": self.finish[key],
        }
      choices.append({**choice, **self._choice_extra(key)})
    return {
      "id": self.id,
      "object": "chat.completion" if self.chat else "text_completion",
      "created": self.created,
      "model": self.app.model_name,
      "choices": choices,
      "usage": self.usage(),
    }

  def _envelope(self, choices) -> dict:
    return {
      "id": self.id,
      "object": "chat.completion.chunk" if self.chat else "text_completion",
      "created": self.created,
      "model": self.app.model_name,
      "choices": choices,
    }

  def _chunk(self, key, delta: str, pieces, finish) -> dict:
    if self.chat:
      choice = {
        "index": self.index(key),
        "delta": {"content": delta} if delta or not finish else {},
        "logprobs": self._logprobs(pieces),
        "finish_reason": finish,
      }
    else:
      choice = {"index": self.index(key), "text": delta, "logprobs": self._logprobs(pieces), "finish_reason": finish}
    if finish is not None:
      choice.update(self._choice_extra(key))
    return self._envelope([choice])

  def opening_chunks(self) -> list:
    """Chat: the assistant role per choice. Completions with echo: the prompt text per choice."""
    out = []
    for key in sorted(self.texts, key=self.index):
      if self.chat:
        out.append(
          self._envelope(
            [
              {
                "index": self.index(key),
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
              }
            ]
          )
        )
      elif self.req.echo:
        out.append(
          self._envelope(
            [{"index": self.index(key), "text": self.req.prompt_texts[key[0]], "logprobs": None, "finish_reason": None}]
          )
        )
    return out

  def closing_chunks(self) -> list:
    if self.req.include_usage:
      return [{**self._envelope([]), "usage": self.usage()}]
    return []
