"""Rewards and answer scoring. Never imports jax: runs in worker processes that must start fast.

Training reward (spec §1.6):
  deep_research(response_text, ground_truths) -> float        # {-1} ∪ [0, 1.1]
  deep_research_details(...) -> dict(score, format_ok, reason, extracted, f1)
  check_format(text) -> (ok, reason)
Evaluation (spec §2.5):
  math_equal(pred, gt), exact_match(pred, gts), f1_score(pred, gts), normalize_answer(s)
  extract_boxed(text), extract_answer(text), answer_span(text)
  eval_correct(response_text, answers, family, question=, judge=)
  answer_checks(response_text, answers) -> dict(extracted, math_ok, em, f1)   # one pool item
  JudgeClient (protocol), OpenAICompatibleJudge, JUDGE_PROMPT, JudgeError   # the project's strict judge
  official: the official ARPO/AEPO evaluator's scoring (is_equiv, metrics, EVALUATION_PROMPT, OfficialJudge)
Isolation:
  RewardPool(num_workers, timeout_s=...).map(fn, [(args...), ...], default=...)
  shared_pool() -> the process's RewardPool, used by every production scoring path
"""

from aepo_jax.rewards._deep_research import (
  FORMAT_PENALTY,
  TOOL_BONUS,
  check_format,
  deep_research,
  deep_research_details,
)
from aepo_jax.rewards._evaluate import answer_checks, eval_correct
from aepo_jax.rewards._extract import answer_span, extract_answer, extract_boxed
from aepo_jax.rewards._judge import (
  JUDGE_PROMPT,
  JudgeClient,
  JudgeError,
  OpenAICompatibleJudge,
  format_judge_prompt,
  parse_verdict,
)
from aepo_jax.rewards import _official as official
from aepo_jax.rewards._math import math_equal
from aepo_jax.rewards._official import OfficialJudge
from aepo_jax.rewards._pool import PoolResult, RewardPool, shared_pool
from aepo_jax.rewards._qa import exact_match, f1_score, normalize_answer

__all__ = [
  "FORMAT_PENALTY",
  "TOOL_BONUS",
  "check_format",
  "deep_research",
  "deep_research_details",
  "answer_checks",
  "eval_correct",
  "answer_span",
  "extract_answer",
  "extract_boxed",
  "JUDGE_PROMPT",
  "JudgeClient",
  "JudgeError",
  "OpenAICompatibleJudge",
  "format_judge_prompt",
  "parse_verdict",
  "math_equal",
  "official",
  "OfficialJudge",
  "PoolResult",
  "RewardPool",
  "shared_pool",
  "exact_match",
  "f1_score",
  "normalize_answer",
]
