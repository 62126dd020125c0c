"""The agent loop's settings (`AgentConfig`) and its interruption (`RolloutInterrupted`), apart from the loop
(_agent.py) so the settings read on their own."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class AgentConfig:
  """max_response_len: L, response tokens per trajectory including tool results (truncated at the end).
  max_tool_calls: per trajectory; the next call appends EOS and ends it (training, spec §1.2 2.3).
  chunk_steps: decode steps per jitted call. lookahead: let a slot start its next round's segment early.
  tool_tags: the call tags the loop stops at and parses; None: the ToolSet's (`tools.tags`, else every registered
  tool's, aepo_jax.tools.registered_tools).
  check_stop_strings: also find tool closing tags in the decoded text (any tokenization) and rewind the slot.
  result_mode: 'train' (" <result>\\n..\\n</result>") or 'eval' ("<result>..</result>").
  max_tokens_per_call: tokens one generation call (segment) may sample, apart from the trajectory's budget; a call
  that reaches it ends the trajectory (stop reason 'call_tokens'), as vLLM's max_tokens does in the evaluation
  protocol (spec §2.5: 4,096). 0: only max_response_len bounds a call (training, spec §1.2 2.1).
  max_calls_per_turn: with max_tokens_per_call, how many generation calls one turn (the text up to a tool call or
  the end) may take: a call that reaches the cap without having written `</answer>` since the turn began is
  continued by another call with a fresh cap (the official inference engine's `call_local_llm`, up to 4 calls in
  all); the last one that reaches the cap ends the trajectory ('call_tokens'). 1: no continuation.
  sample_timeout_s: wall-clock seconds a trajectory may take from its first decode chunk on (so the engine's first
  compile is not counted; then decoding, waiting for tools, waiting to resume); past it the trajectory ends where it
  stands (stop reason 'timeout'), its slot is freed and a tool call it waits on is abandoned (the official
  evaluation's per-sample `asyncio.wait_for`, SAMPLE_TIMEOUT=1500 in its SDS scripts, on a served model that is
  already warm). Checked between decode chunks and tool polls. 0: no limit (training).
  tool_results: when a tool's result enters its trajectory. 'when_ready' (default): after every decode chunk, the
  results whose calls are done; no decode step waits for a tool, but which chunk a result enters depends on how
  long the tool took. 'next_chunk': a result enters after the decode chunk that follows its call (the loop waits
  for it there if it is still running): the rollout is then a function of the seeds, the weights and the tools'
  outputs alone, so partial rollouts (train.max_staleness > 0), whose hand-back points depend on when groups
  complete, repeat run to run. Its costs: a wait where a call takes longer than a decode chunk (local tools rarely
  do; web search does), a result that is done early entering after that chunk all the same, and, with nothing
  decoding, a wait for every due call rather than the first done. Not with sample_timeout_s. The synchronous
  rollout's trajectories are the same under both when every live trajectory has a slot."""

  TOOL_RESULTS = ("when_ready", "next_chunk")

  max_response_len: int = 1024
  max_tool_calls: int = 3
  chunk_steps: int = 16
  tool_tags: Optional[tuple] = None
  result_mode: str = "train"
  lookahead: bool = True
  check_stop_strings: bool = True
  tool_poll_s: float = 0.05
  max_tokens_per_call: int = 0
  max_calls_per_turn: int = 1
  sample_timeout_s: float = 0.0
  tool_results: str = "when_ready"

  def __post_init__(self):
    if self.tool_results not in self.TOOL_RESULTS:
      raise ValueError(
        f"AgentConfig: tool_results={self.tool_results!r}; use one of {self.TOOL_RESULTS} (rollout.tool_results)."
      )
    if self.tool_results == "next_chunk" and self.sample_timeout_s:
      raise ValueError(
        f"AgentConfig: tool_results='next_chunk' waits for due tool calls, which sample_timeout_s="
        f"{self.sample_timeout_s} (a wall-clock limit) could not interrupt in time; use tool_results='when_ready' "
        "with a sample timeout."
      )
    if self.sample_timeout_s < 0:
      raise ValueError(f"AgentConfig: sample_timeout_s={self.sample_timeout_s} must be >= 0 (0: no limit).")
    if self.max_calls_per_turn < 1:
      raise ValueError(f"AgentConfig: max_calls_per_turn={self.max_calls_per_turn} must be >= 1 (1: no continuation).")
    if self.max_response_len < 1 or self.chunk_steps < 1 or self.max_tool_calls < 0 or self.max_tokens_per_call < 0:
      raise ValueError(
        f"AgentConfig: max_response_len={self.max_response_len} and chunk_steps={self.chunk_steps} "
        f"must be >= 1, max_tool_calls={self.max_tool_calls} and max_tokens_per_call="
        f"{self.max_tokens_per_call} >= 0."
      )


class RolloutInterrupted(RuntimeError):
  """`should_stop` answered True between two decode chunks or tool polls (e.g. SIGTERM on a preemptible VM): the
  rollout was abandoned, its slots released; nothing of it is returned."""
