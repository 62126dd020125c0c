"""The one rollout face: `RolloutSettings` say everything that decides an engine, its agent loop and its rollout
policy; `build_engine` turns them into the `Engine`, and `Rollouts` into the whole thing (engine, loop, policy and
the weights it serves). The trainer and its validation, `eval.Evaluator` and `launch/compile.py` all build through
here, so the stop sequences, EOS ids, sampling, slots and cache layout of a run come from one place.

  settings = RolloutSettings(max_slots=16, max_prompt_len=512, max_response_len=1024, policy="aepo", ...)
  rollouts = Rollouts(model_config, tokenizer, tools, settings, mesh=mesh)
  weights = rollouts.weights(params)                  # the policy on the rollout mesh, in settings.dtype
  traj = rollouts(weights, prompt_ids, seed=0)        # Trajectories
  describe_engine(rollouts.engine)                    # the settings an engine was built with (for comparisons)
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from aepo_jax.rollout._agent import AgentConfig, AgentLoop
from aepo_jax.rollout._engine import Engine, num_pages_for
from aepo_jax.rollout._factory import make_engine
from aepo_jax.rollout._sampling import SamplingParams
from aepo_jax.rollout.policies import PolicyConfig, rollout_policy

RESULT_MODES = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  """What decides a rollout, in one hashable value. `aepo_jax.train.rollout_settings(config)` makes it from a
  training config, `aepo_jax.eval.EvalSettings.rollout_settings()` from the evaluation protocol."""

  max_slots: int  # engine slots (trajectories decoded together)
  max_prompt_len: int
  max_response_len: int  # response tokens, tool results included; the cache holds prompt + response
  sampling: SamplingParams = SamplingParams()
  policy: str = "none"  # rollout policy name (aepo_jax.rollout.rollout_policy)
  policy_config: PolicyConfig = PolicyConfig(n=1, initial_rollouts=1)
  tokenizer_eos: bool = False  # the tokenizer's own end-of-turn ids end a trajectory too (first in eos_ids)
  entropy_window: int = 20
  topk_entropy: int = 10
  prefill_chunk: int = 128
  prefill_rows: int = 16
  kv_layout: str = "dense"  # dense | paged | auto
  page_size: int = 64
  kv_tokens: int = 0  # paged pool size in tokens (0: every slot at max_len)
  cpu_kernels: Optional[bool] = None  # Engine(cpu_kernels=...): None when they apply
  chunk_steps: int = 16  # decode steps per engine call
  decode_rows: int = 0  # Engine(max_decode_rows=): active slots per decode call through the CPU kernel (0: all)
  max_tool_calls: int = 10**6  # per trajectory; beyond it the trajectory ends
  result_mode: str = "train"  # tool results as training ('train') or the official evaluation ('eval') writes them
  max_tokens_per_call: int = 0  # tokens one generation call may sample (0: only max_response_len bounds it)
  max_calls_per_turn: int = 1  # the official engine's continuation of a call that hit max_tokens_per_call
  sample_timeout_s: float = 0.0  # wall-clock seconds per trajectory, then it ends ('timeout'); 0: no limit
  tool_results: str = "when_ready"  # when a tool result enters its trajectory (AgentConfig.tool_results)
  dtype: Optional[str] = None  # rollout weights' dtype (None: the model config's param_dtype)
  record_routes: bool = False  # keep each token's experts (a model with experts; routing replay, Trajectories)

  def __post_init__(self):
    for key in ("max_slots", "max_prompt_len", "max_response_len", "chunk_steps", "max_calls_per_turn"):
      if getattr(self, key) < 1:
        raise ValueError(f"RolloutSettings.{key}={getattr(self, key)} must be >= 1.")
    if self.result_mode not in RESULT_MODES:
      raise ValueError(f"RolloutSettings.result_mode={self.result_mode!r}; use one of {RESULT_MODES}.")

  @property
  def max_len(self) -> int:
    return self.max_prompt_len + self.max_response_len


def closing_tags(tool_tags: Sequence[str]) -> list[str]:
  """The stop strings of tool calls: `</tag>` for each call tag."""
  return [f"</{t}>" for t in tool_tags]


def build_engine(
  model_config,
  tokenizer,
  settings: RolloutSettings,
  *,
  tool_tags: Sequence[str] = (),
  mesh=None,
  stop_sequences: Optional[Sequence[Sequence[int]]] = None,
) -> Engine:
  """The `Engine` of `settings` for `model_config` (its param_dtype replaced by settings.dtype when set).

  Stop sequences: the token sequences of every tool call's closing tag (needs `tokenizer`), unless given
  (`launch/compile.py` without a tokenizer passes sequences of the same shape: the compiled program depends only
  on how many there are and how long)."""
  cfg = model_config.replace(param_dtype=settings.dtype) if settings.dtype else model_config
  tags = closing_tags(sorted(tool_tags)) if stop_sequences is None else ()
  return make_engine(
    cfg,
    max_slots=settings.max_slots,
    max_len=settings.max_len,
    tokenizer=tokenizer,
    stop_strings=tags,
    stop_sequences=stop_sequences or (),
    tokenizer_eos=settings.tokenizer_eos and tokenizer is not None,
    sampling=settings.sampling,
    mesh=mesh,
    entropy_window=settings.entropy_window,
    topk_entropy=settings.topk_entropy,
    prefill_chunk=settings.prefill_chunk,
    prefill_rows=settings.prefill_rows,
    cpu_kernels=settings.cpu_kernels,
    max_decode_rows=settings.decode_rows,
    kv_layout=settings.kv_layout,
    page_size=settings.page_size,
    num_pages=num_pages_for(settings.kv_tokens, settings.page_size),
    record_routes=settings.record_routes,
  )


def describe_engine(engine: Engine) -> dict:
  """The settings an engine was built with, as plain values: what two engines of one run must share."""
  return {
    "max_slots": engine.max_slots,
    "max_len": engine.max_len,
    "eos_ids": list(engine.eos_ids),
    "stop_sequences": [list(s) for s in engine.stop_sequences],
    "sampling": dataclasses.asdict(engine.sampling),
    "entropy_window": engine.entropy_window,
    "topk_entropy": engine.topk_entropy,
    "prefill_chunk": engine.prefill_chunk,
    "prefill_rows": engine.prefill_rows,
    "kv_layout": engine.kv_layout,
    "page_size": engine.page_size,
    "num_pages": engine.num_pages,
    "param_dtype": str(engine.config.param_dtype),
    "record_routes": engine.record_routes,
  }


class Rollouts:
  """An engine, its agent loop and rollout policy, built from one `RolloutSettings`.

  weights = rollouts.weights(params)     # the policy on the rollout mesh in settings.dtype (the same arrays
                                         # when they already are; a collective when params span hosts)
  traj = rollouts(weights, prompt_ids, seed)
  """

  def __init__(self, model_config, tokenizer, tools, settings: RolloutSettings, *, mesh=None, pad_id=None):
    self.settings, self.tokenizer, self.tools = settings, tokenizer, tools
    self.tool_tags = tuple(tools.tags) if tools is not None else ()
    self.mesh = mesh
    self.engine = build_engine(model_config, tokenizer, settings, tool_tags=self.tool_tags, mesh=mesh)
    self.config = self.engine.config
    self.policy = rollout_policy(settings.policy, settings.policy_config)
    self.loop = AgentLoop(
      self.engine,
      tokenizer,
      tools,
      AgentConfig(
        max_response_len=settings.max_response_len,
        max_tool_calls=settings.max_tool_calls,
        chunk_steps=settings.chunk_steps,
        tool_tags=self.tool_tags,
        result_mode=settings.result_mode,
        max_tokens_per_call=settings.max_tokens_per_call,
        max_calls_per_turn=settings.max_calls_per_turn,
        sample_timeout_s=settings.sample_timeout_s,
        tool_results=settings.tool_results,
      ),
      pad_id=pad_id,
    )
    self._shardings = None

  def weights(self, params):
    """`params` on this rollout's devices in settings.dtype (see `aepo_jax.parallel.to_host_local`); unchanged
    without a mesh when they already have the dtype."""
    from aepo_jax.parallel import to_host_local

    if self.mesh is None:
      import jax

      dt = self.config.param_dtype
      return jax.tree.map(lambda x: x if x.dtype == dt else x.astype(dt), params)
    if self._shardings is None:
      from aepo_jax.model import param_shardings

      self._shardings = param_shardings(self.config, self.mesh)
    return to_host_local(params, self._shardings, self.config.param_dtype)

  def __call__(self, weights, prompt_ids: Sequence[Sequence[int]], seed: int = 0, should_stop=None, on_finished=None):
    """Trajectories of the prompts; `should_stop()` True between decode chunks abandons the rollout
    (RolloutInterrupted); `on_finished()` is called as each trajectory ends."""
    prompts = [list(p) for p in prompt_ids]
    return self.loop.rollout(weights, prompts, self.policy, seed=seed, should_stop=should_stop, on_finished=on_finished)

  def describe(self) -> dict:
    """describe_engine(engine) plus the agent loop's and policy's settings."""
    s = self.settings
    return {
      **describe_engine(self.engine),
      "tool_tags": list(self.tool_tags),
      "policy": s.policy,
      "n": s.policy_config.n,
      "max_response_len": s.max_response_len,
      "max_tool_calls": s.max_tool_calls,
      "chunk_steps": s.chunk_steps,
      "result_mode": s.result_mode,
    }
