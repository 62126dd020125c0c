"""The official ARPO/AEPO evaluator's scoring, function by function (`eval.protocol = 'official'`).

Source: github.com/dongguanting/ARPO, `evaluation/src/` (snapshot of 2025-08; the README declares the MIT
License, "Copyright (c) the ARPO authors"; the snapshot has no top-level LICENSE file):
  math_equivalence.py   `_fix_fracs`, `_fix_a_slash_b`, `_remove_right_units`, `_fix_sqrt`, `_strip_string`,
                        `is_equiv` (the Hendrycks MATH normaliser)                      vendored, logic unchanged
  metrics.py            `normalize_answer`, `compute_token_overlap`, `compute_f1_score`,
                        `evaluate_math_prediction`, `evaluate_qa_prediction`            vendored, logic unchanged
  utils.py              `last_boxed_only_string`, `extract_answer`                      vendored, logic unchanged
  evaluator.py          `count_valid_tags`, `remove_result_tags`, the empty-prediction fallback and the per-sample
                        metrics of `Evaluator.evaluate_sample` (without the judge)      re-implemented
  llm_evaluator_sds.py  `EVALUATION_PROMPT` (byte-equal), the reading of the judge's reply and
                        `llm_equal = is_equiv(pred, gold) OR judge`                     vendored / re-implemented
Only the formatting (2-space indentation, bare `except:` written `except Exception:`) differs, so the verdicts are
the official ones, quirks included: `is_equiv` compares strings after normalising, so "3.0" != "3", "025" != "25"
and "1,000" != "1000" (math-verify, the project protocol's scorer, says equal to all three); a malformed LaTeX
answer makes `_strip_string` raise and `is_equiv` fall back to plain string equality.

How the official pipeline uses them (evaluate_passk.sh / evaluate.sh): every set is scored with `--use_llm`
(Qwen2.5-72B-Instruct); task 'math' for aime24/aime25/math500/gsm8k/math, 'qa' for every other set. A sample's
`llm_equal` is the reported accuracy when a judge is used; without one, `math_equal` (math) or token `f1` (qa).
Never imports jax (runs in reward workers).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Optional, Sequence, Union

# --- math_equivalence.py (vendored; MIT, the ARPO authors) -------------------------------------------------------


def _fix_fracs(string):
  substrs = string.split("\\frac")
  new_str = substrs[0]
  if len(substrs) > 1:
    substrs = substrs[1:]
    for substr in substrs:
      new_str += "\\frac"
      if substr[0] == "{":
        new_str += substr
      else:
        try:
          assert len(substr) >= 2
        except Exception:
          return string
        a = substr[0]
        b = substr[1]
        if b != "{":
          if len(substr) > 2:
            post_substr = substr[2:]
            new_str += "{" + a + "}{" + b + "}" + post_substr
          else:
            new_str += "{" + a + "}{" + b + "}"
        else:
          if len(substr) > 2:
            post_substr = substr[2:]
            new_str += "{" + a + "}" + b + post_substr
          else:
            new_str += "{" + a + "}" + b
  string = new_str
  return string


def _fix_a_slash_b(string):
  if len(string.split("/")) != 2:
    return string
  a = string.split("/")[0]
  b = string.split("/")[1]
  try:
    a = int(a)
    b = int(b)
    assert string == "{}/{}".format(a, b)
    new_string = "\\frac{" + str(a) + "}{" + str(b) + "}"
    return new_string
  except Exception:
    return string


def _remove_right_units(string):
  # "\\text{ " only ever occurs (at least in the val set) when describing units
  if "\\text{ " in string:
    splits = string.split("\\text{ ")
    assert len(splits) == 2
    return splits[0]
  else:
    return string


def _fix_sqrt(string):
  if "\\sqrt" not in string:
    return string
  splits = string.split("\\sqrt")
  new_string = splits[0]
  for split in splits[1:]:
    if split[0] != "{":
      a = split[0]
      new_substr = "\\sqrt{" + a + "}" + split[1:]
    else:
      new_substr = "\\sqrt" + split
    new_string += new_substr
  return new_string


def _strip_string(string):
  string = string.replace("\n", "")  # linebreaks
  string = string.replace("\\!", "")  # remove inverse spaces
  string = string.replace("\\\\", "\\")  # replace \\ with \
  string = string.replace("tfrac", "frac")  # replace tfrac and dfrac with frac
  string = string.replace("dfrac", "frac")
  string = string.replace("\\left", "")  # remove \left and \right
  string = string.replace("\\right", "")
  string = string.replace("^{\\circ}", "")  # Remove circ (degrees)
  string = string.replace("^\\circ", "")
  string = string.replace("\\$", "")  # remove dollar signs
  string = _remove_right_units(string)  # remove units (on the right)
  string = string.replace("\\%", "")  # remove percentage (the official code does this twice, same string)
  string = string.replace("\\%", "")
  # " 0." equivalent to " ." and "{0." equivalent to "{." Alternatively, add "0" if "." is the start of the string
  string = string.replace(" .", " 0.")
  string = string.replace("{.", "{0.")
  if len(string) == 0:  # if empty, return empty string
    return string
  if string[0] == ".":
    string = "0" + string
  # to consider: get rid of e.g. "k = " or "q = " at beginning
  if len(string.split("=")) == 2:
    if len(string.split("=")[0]) <= 2:
      string = string.split("=")[1]
  string = _fix_sqrt(string)  # fix sqrt3 --> sqrt{3}
  string = string.replace(" ", "")  # remove spaces
  # \frac1b or \frac12 --> \frac{1}{b} and \frac{1}{2}, etc.
  string = _fix_fracs(string)
  if string == "0.5":  # manually change 0.5 --> \frac{1}{2}
    string = "\\frac{1}{2}"
  # NOTE: X/Y changed to \frac{X}{Y} in dataset, but in simple cases fix in case the model output is X/Y
  string = _fix_a_slash_b(string)
  return string


def is_equiv(str1, str2) -> bool:
  """The official `is_equiv`: equal after `_strip_string`; plain equality when normalising raises."""
  if str1 is None and str2 is None:
    return True
  if str1 is None or str2 is None:
    return False
  try:
    return _strip_string(str1) == _strip_string(str2)
  except Exception:
    return str1 == str2


# --- metrics.py (vendored; MIT, the ARPO authors) ----------------------------------------------------------------


def normalize_answer(text, remove_articles: bool = False, remove_punctuations: bool = False) -> str:
  """Lower-case, strip, optionally drop articles / punctuation, collapse whitespace. Unlike the project's SQuAD
  normaliser, punctuation is kept (the official code never passes remove_punctuations=True)."""
  if not isinstance(text, str):
    text = str(text)
  text = text.lower().strip()
  if remove_articles:
    text = re.sub(r"\b(a|an|the)\b", " ", text)
  if remove_punctuations:
    exclude = set(string.punctuation)
    text = "".join(ch for ch in text if ch not in exclude)
  return " ".join(text.split())


def compute_token_overlap(prediction: str, reference: str) -> tuple[int, int, int]:
  prediction_tokens = prediction.split()
  reference_tokens = reference.split()
  common = Counter(prediction_tokens) & Counter(reference_tokens)
  return sum(common.values()), len(prediction_tokens), len(reference_tokens)


def compute_f1_score(num_same: int, pred_len: int, ref_len: int) -> float:
  if num_same == 0:
    return 0.0
  precision = num_same / pred_len if pred_len > 0 else 0
  recall = num_same / ref_len if ref_len > 0 else 0
  return (2 * precision * recall) / (precision + recall) if (precision + recall) > 0 else 0.0


def evaluate_math_prediction(prediction: str, reference) -> dict:
  """em, acc (reference is a substring of the prediction), f1, math_equal (`is_equiv` on the normalised pair)."""
  normalized_prediction = normalize_answer(prediction)
  normalized_reference = normalize_answer(reference)
  em = int(normalized_prediction == normalized_reference)
  acc = int(normalized_reference in normalized_prediction)
  f1 = compute_f1_score(*compute_token_overlap(normalized_prediction, normalized_reference))
  math_equal = int(is_equiv(normalized_prediction, normalized_reference))
  return {"em": em, "acc": acc, "f1": f1, "math_equal": math_equal}


def evaluate_qa_prediction(prediction: str, references: Union[str, Sequence[str]]) -> dict:
  """The maximum over the references of em, acc, f1 and math_equal (articles removed). A string that starts with
  '[' is split on commas, as officially."""
  if isinstance(references, str):
    if not references.startswith("["):
      references = [references]
    else:
      references = [e.strip() for e in re.split(r",\s*", references.strip("[]"))]
  result = {"em": 0, "acc": 0, "f1": 0, "math_equal": 0}
  normalized_prediction = normalize_answer(prediction, remove_articles=True)
  for reference in references:
    normalized_reference = normalize_answer(reference, remove_articles=True)
    em = int(normalized_prediction == normalized_reference)
    acc = int(normalized_reference in normalized_prediction)
    f1 = compute_f1_score(*compute_token_overlap(normalized_prediction, normalized_reference))
    result["em"] = max(result["em"], em)
    result["acc"] = max(result["acc"], acc)
    result["f1"] = max(result["f1"], f1)
    result["math_equal"] = max(result["math_equal"], int(is_equiv(normalized_prediction, normalized_reference)))
  return result


# --- utils.py (vendored; MIT, the ARPO authors) ------------------------------------------------------------------


def last_boxed_only_string(string: str) -> str:
  idx = string.rfind("\\boxed")
  if idx < 0:
    idx = string.rfind("\\fbox")
    if idx < 0:
      return ""
  i = idx
  right_brace_idx = None
  num_left_braces_open = 0
  while i < len(string):
    if string[i] == "{":
      num_left_braces_open += 1
    if string[i] == "}":
      num_left_braces_open -= 1
      if num_left_braces_open == 0:
        right_brace_idx = i
        break
    i += 1
  if right_brace_idx is None:
    return string[idx:]
  return string[idx : right_brace_idx + 1]


def _unbox(s: str) -> str:
  if s and s.startswith("\\boxed{") and s.endswith("}"):
    s = s[7:-1]
    if s and s.startswith("\\text{") and s.endswith("}"):
      s = s[6:-1]
  return s


def extract_answer(full_text: str) -> str:
  """The official prediction: the last `<answer>..</answer>` block (its last `\\boxed{}` unwrapped, one `\\text{}`
  removed; the block itself when it has no box); without a block, the last `\\boxed{}` of the whole text; else ''.
  """
  text = full_text
  temp_answer = None
  last_answer_end = text.rfind("</answer>")
  if last_answer_end != -1:
    last_answer_start = text[:last_answer_end].rfind("<answer>")
    if last_answer_start != -1:
      temp_answer = text[last_answer_start + len("<answer>") : last_answer_end]
  if temp_answer:
    boxed_answer = _unbox(last_boxed_only_string(temp_answer.strip()))
    return temp_answer if not boxed_answer else boxed_answer
  return _unbox(last_boxed_only_string(text.strip()))


# --- evaluator.py (re-implemented) -------------------------------------------------------------------------------


def count_valid_tags(text: str, tag: str) -> int:
  """Paired `<tag>..</tag>` occurrences, scanning left to right."""
  count, pos = 0, 0
  start_tag, end_tag = f"<{tag}>", f"</{tag}>"
  while True:
    start = text.find(start_tag, pos)
    if start == -1:
      break
    end = text.find(end_tag, start + len(start_tag))
    if end == -1:
      break
    count += 1
    pos = end + len(end_tag)
  return count


_R_TAGS = re.compile(r"<r>.*?</r>", re.DOTALL)
_RESULT_TAGS = re.compile(r"<result>.*?</result>", re.DOTALL)


def remove_result_tags(text: str) -> str:
  if not text:
    return ""
  return _RESULT_TAGS.sub("", _R_TAGS.sub("", text)).strip()


def fallback_prediction(prediction: str, output: str) -> str:
  """An empty prediction is replaced by the last 5 lines of the output (blank lines collapsed), as officially."""
  if prediction:
    return prediction
  return "\n".join(output.replace("\n\n", "\n").strip().split("\n")[-5:]) if output else ""


def task_of(family: str) -> str:
  """The official task of a project family: 'math' for math sets, 'qa' for all others (evaluate_passk.sh)."""
  return "math" if family == "math" else "qa"


def _tools_used(counts: dict) -> str:
  """'none', the one tool used, 'both' when the two official tools were (the official labels), else the names."""
  used = [t for t, n in counts.items() if n]
  if not used:
    return "none"
  if len(used) == 1:
    return used[0]
  return "both" if len(counts) == 2 else "+".join(used)


def sample_metrics(
  output: str, reference, task: str, prediction: Optional[str] = None, tools: Optional[Sequence[str]] = None
) -> dict:
  """`Evaluator.evaluate_sample` without the judge: the official per-sample metrics of one output.

  `prediction` None: extracted from `output` as the official inference does (`extract_answer`); an empty one falls
  back to the output's last lines. `reference`: the answer field as the official data holds it (a string, or a
  list of aliases for the QA sets). Adds `prediction` (what was scored) to the official keys. tools: the call tags
  counted as `<tag>_calls` (default the official protocol's tools, `aepo_jax.tools.reward_tags()`, in name order:
  python_calls, search_calls, as officially).
  """
  if tools is None:
    from aepo_jax.tools import reward_tags

    tools = sorted(reward_tags())
  if task not in ("math", "qa"):
    raise ValueError(f"Unsupported task type: {task}")
  output = output or ""
  pred = fallback_prediction(extract_answer(output) if prediction is None else prediction, output)
  if not pred:
    return {
      "is_valid_answer": False,
      "em": 0,
      "acc": 0,
      "f1": 0,
      "math_equal": 0,
      **{f"{t}_calls": 0 for t in tools},
      "output_length": 0,
      "tools_used": "none",
      "tool_counts": 0,
      "prediction": "",
    }
  counts = {t: count_valid_tags(output, t) for t in tools}
  out = {
    "is_valid_answer": True,
    **{f"{t}_calls": n for t, n in counts.items()},
    "tools_used": _tools_used(counts),
    "tool_counts": sum(counts.values()),
    "output_length": len(remove_result_tags(output)),
  }
  if task == "math":
    out.update(evaluate_math_prediction(pred, reference))
  else:
    out.update(evaluate_qa_prediction(pred, reference))
  out["prediction"] = pred
  return out


# --- llm_evaluator_sds.py (prompt vendored byte for byte; MIT, the ARPO authors) ---------------------------------

EVALUATION_PROMPT = """Given a Question and its Golden Answer, verify whether the Predicted Answer is correct. The prediction is correct if it fully aligns with the meaning and key information of the Golden Answer. Respond with "Correct" if the prediction is correct and "Incorrect" otherwise.
Golden Answer may have multiple options, and matching any one of them is considered correct.

Question: {question}
Golden Answer: {labeled_answer}
Predicted Answer: {pred_answer}
"""  # noqa: E501 -- byte-equal to the official prompt

# The official request: `client.chat.completions.create(model=..., messages=[{"role": "user", "content": prompt}])`
# -- no temperature, no max_tokens (the server's defaults); 3 attempts, 1 s then 2 s apart; after the last failure
# the verdict is `is_equiv(pred, gold)` and the reply "Error".
JUDGE_RETRY_LIMIT = 3


def format_prompt(question: str, labeled_answer, pred_answer: str) -> str:
  """The official prompt; `labeled_answer` is shown as Python formats it (a list of aliases as `['a', 'b']`)."""
  return EVALUATION_PROMPT.format(question=question, labeled_answer=labeled_answer, pred_answer=pred_answer)


def judgment_text(reply: str) -> str:
  """The text between the first `<judgment>` and the first `</judgment>` when both are there, else the reply."""
  reply = reply.strip()
  try:
    start = reply.index("<judgment>") + len("<judgment>")
    end = reply.index("</judgment>")
    return reply[start:end].strip()
  except ValueError:
    return reply.strip()


def reply_is_correct(reply: str) -> bool:
  """The official reading: the (judgment) text contains "correct" and none of "incorrect", "wrong", "not correct",
  case-insensitively. So "The prediction is Correct." is correct, "Incorrect" and "Correct? No, it is wrong." are
  not, and "Correctly answered" is correct."""
  t = judgment_text(reply).lower()
  return "correct" in t and not ("incorrect" in t or "wrong" in t or "not correct" in t)


def llm_equal(pred_answer: str, labeled_answer, reply: Optional[str]) -> bool:
  """`is_equiv(pred, gold) or <the reply reads correct>`; reply None (the judge failed after its retries): the
  official fallback `is_equiv(pred, gold)`. Note: `is_equiv` here sees the raw (not normalised) strings, and a list
  of aliases never equals a string."""
  if is_equiv(pred_answer, labeled_answer):
    return True
  return reply is not None and reply_is_correct(reply)


class OfficialJudge:
  """The official judge request over an OpenAI-compatible endpoint: the official prompt as one user message, no
  temperature or max_tokens (the server's defaults), `JUDGE_RETRY_LIMIT` attempts. `reply()` gives the raw text;
  `judge()` the official reading of it (without the `is_equiv` OR, which the scorer adds)."""

  def __init__(self, base_url: str, model: str, *, timeout: float = 600.0, api_key_env: str = "OPENAI_API_KEY"):
    from aepo_jax.tools import ChatClient  # lazy: only a judge that is used needs the HTTP client

    self._client = ChatClient(
      base_url,
      model,
      timeout_s=timeout,
      retries=JUDGE_RETRY_LIMIT - 1,
      backoff_s=1.0,
      temperature=None,
      max_tokens=None,
      api_key_env=api_key_env,
    )
    self.url, self.model = self._client.url, model

  def reply(self, question: str, labeled_answer, predicted_answer: str) -> str:
    from aepo_jax.rewards._judge import JudgeError
    from aepo_jax.tools import ChatError

    try:
      return self._client.complete(format_prompt(question, labeled_answer, predicted_answer)).strip()
    except (ChatError, ValueError) as e:
      raise JudgeError(str(e)) from e

  def judge(self, question: str, labeled_answer, predicted_answer: str) -> bool:
    return reply_is_correct(self.reply(question, labeled_answer, predicted_answer))


# Sets whose official answer field is a JSON list of aliases (the judge is shown the list, F1 takes the best alias);
# the others hold one string (or, aime25, an int).
LIST_ANSWER_SETS = frozenset({"hotpotqa", "2wiki", "musique", "bamboogle", "simpleqa", "xbench"})


def official_reference(source: str, answers: Sequence[str]):
  """The answer field as the official data holds it, from a project example's (source, answers)."""
  answers = list(answers)
  if str(source).lower() in LIST_ANSWER_SETS or len(answers) != 1:
    return answers
  return answers[0]


def answer_checks(response_text: str, reference, task: str, prediction: Optional[str] = None) -> dict:
  """One reward-pool item: the official per-sample metrics (`sample_metrics`) of one response, plus `extracted`
  (the official extraction before the last-lines fallback; '' when the output has no answer). `prediction`: the
  official record's prediction when it is not extracted from the output (a timed-out sample's "Timeout")."""
  extracted = extract_answer(response_text or "") if prediction is None else prediction
  return dict(sample_metrics(response_text, reference, task, prediction=prediction), extracted=extracted)
