"""A minimal client for any OpenAI-compatible chat-completions server (vLLM, SGLang, launch/serve.py, a hosted API).

    client = ChatClient("http://127.0.0.1:8000/v1", "Qwen2.5-72B-Instruct")
    client.complete("Summarise ...")  # -> the assistant's text

Used by the browse tool's summariser. The API key is read from the environment variable `api_key_env` (never
passed in code); an unset variable sends no Authorization header, which local servers accept.
"""

import json
import os
import time

from aepo_jax.tools._http import http_request


class ChatError(RuntimeError):
  """The server failed after all retries, or answered outside the OpenAI schema."""


class ChatClient:
  """`POST {base_url}/chat/completions`. Each attempt (connect, send, the whole answer) ends within `timeout_s`;
  connection errors, timeouts, HTTP 429 and 5xx are retried `retries` times with exponential backoff; other 4xx
  fail at once. One call therefore ends within (retries + 1) * timeout_s plus the backoff. `extra_body`: further
  request fields sent as given (e.g. vLLM's top_p, stop, repetition_penalty: the SDS summariser's sampling)."""

  def __init__(
    self,
    base_url: str,
    model: str,
    *,
    timeout_s: float = 120.0,
    retries: int = 2,
    backoff_s: float = 0.5,
    temperature: float | None = 0.0,
    max_tokens: int | None = 1024,
    api_key_env: str = "OPENAI_API_KEY",
    extra_body: dict | None = None,
  ):
    if not base_url or not model:
      raise ValueError(
        f"ChatClient needs a base URL and a model name (got {base_url!r}, {model!r}); the URL "
        "is the OpenAI base, e.g. http://127.0.0.1:8000/v1"
      )
    self.url = base_url.rstrip("/") + "/chat/completions"
    self.model, self.timeout_s, self.retries, self.backoff_s = model, timeout_s, retries, backoff_s
    self.temperature, self.max_tokens, self.api_key_env = temperature, max_tokens, api_key_env
    self.extra_body = dict(extra_body or {})

  def complete(self, prompt: str) -> str:
    payload = {"model": self.model, "messages": [{"role": "user", "content": prompt}]}
    for key in ("temperature", "max_tokens"):  # None: not sent, the server's default (the official judge's request)
      if getattr(self, key) is not None:
        payload[key] = getattr(self, key)
    payload.update(self.extra_body)
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(self.api_key_env)
    if key:
      headers["Authorization"] = f"Bearer {key}"
    last = None
    for attempt in range(self.retries + 1):
      try:
        status, body = http_request(
          "POST", self.url, data=json.dumps(payload).encode(), headers=headers, timeout_s=self.timeout_s
        )
      except OSError as e:  # refused, reset, or no complete answer within the deadline
        last = e
      else:
        if status == 429 or status >= 500:
          last = f"HTTP {status}"
        elif status >= 400:
          raise ChatError(
            f"{self.url} answered HTTP {status}; check the model name {self.model!r} and the "
            f"key in ${self.api_key_env}: {body[:200].decode(errors='replace')}"
          )
        else:
          try:
            return str(json.loads(body)["choices"][0]["message"]["content"] or "")
          except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ChatError(f"{self.url} returned a non-OpenAI response: {e!r}") from e
      if attempt < self.retries:
        time.sleep(self.backoff_s * 2**attempt)
    raise ChatError(f"{self.url} failed after {self.retries + 1} attempts ({self.timeout_s:g} s each): {last!r}")
