"""LLM-as-judge for evaluation (spec §2.5): a `JudgeClient` protocol and an OpenAI-compatible client.

The prompt follows the judge of the official ARPO/AEPO evaluation, inherited from the
Search-o1 / WebThinker evaluation scripts: the judge sees the question, the labeled answer and the
predicted answer and must answer "Correct" or "Incorrect". The official text could not be read from
the ARPO tree in this environment; this is a faithful rendering of that prompt (same fields, same
question, same two verdict words), not a byte copy. The official runs used Qwen2.5-72B-Instruct.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

JUDGE_PROMPT = (
  "You are an evaluation assistant. Please determine if the predicted answer is equivalent "
  "to the labeled answer.\n\n"
  "Question: {question}\n\n"
  "Labeled Answer: {labeled_answer}\n\n"
  "Predicted Answer: {pred_answer}\n\n"
  'Are these answers equivalent? Please respond with "Correct" if they are equivalent, '
  'or "Incorrect" if they are not equivalent. Do not include any other text.\n'
)


class JudgeError(RuntimeError):
  """The judge endpoint failed after all retries, or answered neither Correct nor Incorrect."""


@runtime_checkable
class JudgeClient(Protocol):
  """Anything that decides whether a predicted answer matches a labeled one."""

  def judge(self, question: str, labeled_answer: str, predicted_answer: str) -> bool: ...


def format_judge_prompt(question: str, labeled_answer, predicted_answer: str) -> str:
  if isinstance(labeled_answer, (list, tuple)):  # aliases: the official eval shows the list
    labeled_answer = labeled_answer[0] if len(labeled_answer) == 1 else list(labeled_answer)
  return JUDGE_PROMPT.format(question=question, labeled_answer=labeled_answer, pred_answer=predicted_answer)


_WRAPPING = " \t\r\n\"'`*_.!()[]{}"


def parse_verdict(text: str) -> bool:
  """The judge's reply -> True only for the verdict "Correct".

  The official evaluation counts an answer correct when the reply is exactly "Correct"
  (`content.strip() == "Correct"`); here the reply may also carry case, quotes, markdown or a final
  period ("**correct.**"). Any other reply that names a verdict is False: "Incorrect", "Not
  correct", "Correct? No.", "Correct, but the year is wrong". A reply naming no verdict ("Maybe")
  raises JudgeError: the example is recorded as a judge failure and judged again on resume.
  """
  t = str(text or "").strip().strip(_WRAPPING).lower()
  if t == "correct":
    return True
  if "correct" in t or "equivalent" in t or t.split()[:1] in (["no"], ["wrong"], ["false"]):
    return False
  raise JudgeError(f"judge answered neither 'Correct' nor 'Incorrect': {str(text)[:200]!r}")


class OpenAICompatibleJudge:
  """`POST {base_url}/chat/completions` (OpenAI schema: vLLM, SGLang, our own server, a hosted API).

  The API key is read from the environment variable `api_key_env` (never passed in code); an
  unset variable sends no Authorization header, which local servers accept. Each attempt (connect,
  send, the whole answer) ends within `timeout` seconds; timeouts, connection errors, HTTP 429 and
  5xx are retried `retries` times with exponential backoff; other 4xx fail fast. One `complete`
  call therefore ends within (retries + 1) * timeout plus the backoff.
  """

  def __init__(
    self,
    base_url: str,
    model: str,
    *,
    api_key_env: str = "OPENAI_API_KEY",
    timeout: float = 60.0,
    retries: int = 3,
    backoff_s: float = 0.5,
    temperature: float = 0.0,
    max_tokens: int = 16,
  ):
    from aepo_jax.tools import ChatClient  # lazy: only a judge that is used needs the HTTP client

    self._client = ChatClient(
      base_url,
      model,
      timeout_s=timeout,
      retries=retries,
      backoff_s=backoff_s,
      temperature=temperature,
      max_tokens=max_tokens,
      api_key_env=api_key_env,
    )
    self.url, self.model, self.timeout, self.retries = self._client.url, model, timeout, retries

  def complete(self, prompt: str) -> str:
    from aepo_jax.tools import ChatError

    try:
      return self._client.complete(prompt)
    except (ChatError, ValueError) as e:  # failed after retries, a 4xx, a non-OpenAI answer, a bad URL
      raise JudgeError(str(e)) from e

  def judge(self, question: str, labeled_answer, predicted_answer: str) -> bool:
    return parse_verdict(self.complete(format_judge_prompt(question, labeled_answer, predicted_answer)))
