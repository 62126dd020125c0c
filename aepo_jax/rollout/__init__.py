"""Rollout: the slot engine and what drives it.

Engine (docs/rollout_contract.md):
  Engine(model_config, *, max_slots, max_len, eos_ids, stop_sequences, sampling, entropy_window, topk_entropy, ...,
         kv_layout='dense' | 'paged' | 'auto', page_size, num_pages)   OutOfPages: a paged pool ran short
    .init_decode_state() .add() .decode() .extend() .copy_slots() .truncate() .release() .host_info()
  make_engine(model_config, *, max_slots, max_len, tokenizer, stop_strings, eos_ids, tokenizer_eos, sampling, mesh,
              ...)                             the Engine of a run's settings (trainer, evaluation, server, generate)
  DecodeState, StepOutputs, SamplingParams, stop-reason codes (STOP_*)
  generate(config, params, prompts, *, max_new_tokens, ...)   one-call generation (tests, benchmarks, evals)
  stop_sequences_from_strings(tokenizer, strings)              stop strings -> token-id sequences
  JetStreamEngine(model_config, params, *, max_slots, max_len, tokenizer, ...)  JetStream 0.2.2 Engine adapter
                                                (optional extra; jetstream is imported only when it is called)
"""

from aepo_jax.rollout._engine import KV_LAYOUTS, Engine, OutOfPages, num_pages_for
from aepo_jax.rollout._factory import make_engine
from aepo_jax.rollout._sampling import SamplingParams, topk_entropy
from aepo_jax.rollout._state import (
  RUNNING,
  STOP_BUDGET,
  STOP_CACHE_FULL,
  STOP_EOS,
  STOP_NO_PAGES,
  STOP_REASON_NAMES,
  STOP_SEQUENCE,
  DecodeState,
  StepOutputs,
)

# The one rollout face: every user of the engine (trainer, validation, eval.Evaluator, launch/compile.py) builds here:
#   RolloutSettings(max_slots, max_prompt_len, max_response_len, sampling, policy, policy_config, ...)
#   Rollouts(model_config, tokenizer, tools, settings, mesh=None).weights(params) / (weights, prompt_ids, seed,
#     should_stop=None)
#   build_engine(model_config, tokenizer, settings, tool_tags=(), mesh=None)   the Engine of the settings
#   describe_engine(engine) -> dict                the settings an engine was built with (for comparisons)
# Agent loop and rollout policies (docs/rollout.md):
#   AgentLoop(engine, tokenizer, tools, AgentConfig(...)).rollout(params, prompts, policy, seed=0) -> Trajectories
#     (should_stop=callable: asked between decode chunks; True raises RolloutInterrupted, e.g. on SIGTERM)
#   rollout_policy('none' | 'arpo' | 'aepo', PolicyConfig(...), **overrides), register_rollout_policy(name)
#   PartialRollouts(loop, policy, groups_per_call, max_staleness)(params, prompt_ids, payloads, version=, seed=)
#     -> (Trajectories, payloads, metrics): unfinished groups carry over to the next call (train.max_staleness)
from aepo_jax.rollout._agent import AgentConfig, AgentLoop, RolloutInterrupted
from aepo_jax.rollout._partial import PartialRollouts
from aepo_jax.rollout._trajectories import Trajectories, TrajectoryRecord, concat_groups
from aepo_jax.rollout.policies import PolicyConfig, RolloutPolicy, register_rollout_policy, rollout_policy
from aepo_jax.rollout._generate import generate
from aepo_jax.rollout._stop import StopStringChecker, stop_sequences_from_strings
from aepo_jax.rollout._rollouts import RolloutSettings, Rollouts, build_engine, describe_engine
from aepo_jax.rollout._jetstream import JetStreamEngine  # jetstream itself is imported only when called
