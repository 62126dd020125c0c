"""LLM-as-judge of the project protocol and of the trainer's validation (spec §2.5): a `JudgeClient` protocol and an
OpenAI-compatible client with a strict prompt and reply rule.

This is NOT the official evaluator's judge. The official one (`evaluation/src/llm_evaluator_sds.py` of the ARPO
repository: its `EVALUATION_PROMPT`, a request with the server's default sampling, the lenient reading of the reply
and `llm_equal = is_equiv OR judge`) is `aepo_jax.rewards._official`, used by `eval.protocol = 'official'`. Here
the judge sees the question, the labeled answer and the predicted answer and must answer exactly "Correct" or
"Incorrect" (temperature 0, 16 tokens); `parse_verdict` reads that strictly. Two rules, each where it is used:
the official one to compare with the papers' tables, this one for the 'project' protocol and any
training-time use."""

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
  """The judge's reply -> True only for the verdict "Correct" (this project's strict rule).

  The reply may carry case, quotes, markdown or a final period ("**correct.**"). Any other reply that names a
  verdict is False: "Incorrect", "Not correct", "Correct? No.", "Correct, but the year is wrong", and also "The
  prediction is Correct.". A reply naming no verdict ("Maybe") raises JudgeError: the example is recorded as a
  judge failure and judged again on resume.

  The official evaluator reads replies differently (`_official.reply_is_correct`): the text inside
  `<judgment>...</judgment>` when present, correct when it contains "correct" and none of "incorrect", "wrong",
  "not correct", so "The prediction is Correct." is correct there and False here.
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
