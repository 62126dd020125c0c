"""`generate`: one call from prompts (token-id lists) to generated tokens with log-probs and entropies.

Used by tests, benchmarks and evaluation. More prompts than slots are queued and fed to slots as others finish.
"""

from __future__ import annotations

import collections
from typing import Optional, Sequence

import jax
import numpy as np

from aepo_jax.rollout._factory import make_engine
from aepo_jax.rollout._sampling import SamplingParams
from aepo_jax.rollout._state import STOP_REASON_NAMES, STOP_SEQUENCE
from aepo_jax.rollout._stop import StopStringChecker


def generate(
  config,
  params,
  prompts: Sequence[Sequence[int]],
  *,
  max_new_tokens: int,
  temperature: float = 1.0,
  top_p: float = 1.0,
  top_k: int = 0,
  min_p: float = 0.0,
  repetition_penalty: float = 1.0,
  seed: int = 0,
  stop_strings: Sequence[str] = (),
  tokenizer=None,
  stop_sequences: Sequence[Sequence[int]] = (),
  eos_ids: Optional[Sequence[int]] = None,
  max_slots: Optional[int] = None,
  max_len: Optional[int] = None,
  steps_per_call: int = 16,
  prefill_chunk: int = 128,
) -> list:
  """Generates a continuation of each prompt. `temperature=0.0` is greedy. Sampling settings: `SamplingParams`
  (repetition_penalty applies over each prompt and its generated tokens, as in transformers and vLLM).

  Returns one dict per prompt: `tokens` (int32), `logprobs`, `entropies`, `topk_entropies` (float32 numpy
  arrays over the generated tokens; a stop string's tokens included) and `stop_reason`
  ('eos' | 'stop_sequence' | 'length' | 'cache_full'). Prompt i uses the PRNG seed `seed + i`. Log-probs and
  entropies are of softmax(penalised logits / T), before min-p / top-k / top-p truncation (see _sampling.py).
  Stop strings need `tokenizer`: they stop on device for their common tokenizations and are re-checked on the
  host on the decoded text after each call of `steps_per_call` steps (see _stop.py).
  """
  prompts = [list(map(int, p)) for p in prompts]
  if not prompts:
    return []
  if max_new_tokens < 1:
    raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be >= 1.")
  if stop_strings and tokenizer is None:
    raise ValueError("generate: stop_strings need a tokenizer (to find their token sequences); pass tokenizer=.")
  checker = StopStringChecker(tokenizer, stop_strings, config.vocab_size) if stop_strings else None
  n = len(prompts)
  slots = max(1, min(n, max_slots or n))
  max_len = max_len or max(len(p) for p in prompts) + max_new_tokens
  engine = make_engine(
    config,
    max_slots=slots,
    max_len=max_len,
    tokenizer=tokenizer,
    stop_strings=stop_strings,
    stop_sequences=stop_sequences,
    eos_ids=eos_ids,
    sampling=SamplingParams(temperature, top_p, top_k, min_p, repetition_penalty),
    prefill_chunk=prefill_chunk,
  )
  state = engine.init_decode_state()
  pending = collections.deque(range(n))
  running = {}  # slot -> prompt index
  bufs = {i: collections.defaultdict(list) for i in range(n)}
  results = [None] * n

  def refill(state):
    free = [s for s in range(slots) if s not in running][: len(pending)]
    if not free:
      return state
    idx = [pending.popleft() for _ in free]
    running.update(zip(free, idx))
    return engine.add(params, state, free, [prompts[i] for i in idx], [seed + i for i in idx], max_new_tokens)

  state = refill(state)
  while running:
    state, out = engine.decode(params, state, steps_per_call)
    out = jax.device_get(out)
    info = engine.host_info(state)
    done = []
    for slot, i in running.items():
      valid = out.valid[slot]
      for name in ("token", "logprob", "entropy", "topk_entropy"):
        bufs[i][name].extend(getattr(out, name)[slot][valid].tolist())
      reason = STOP_REASON_NAMES[int(info["stop_reason"][slot])]
      cut = checker.first_stop(bufs[i]["token"]) if checker is not None else None
      if cut is not None:
        for name in bufs[i]:
          del bufs[i][name][cut:]
        reason = STOP_REASON_NAMES[STOP_SEQUENCE]
      if cut is not None or not info["active"][slot]:
        results[i] = _record(bufs.pop(i), reason)
        done.append(slot)
    for slot in done:
      del running[slot]
    if done:
      state = engine.release(state, done)
      state = refill(state)
  return results


def _record(buf, reason: str) -> dict:
  return {
    "tokens": np.asarray(buf["token"], np.int32),
    "logprobs": np.asarray(buf["logprob"], np.float32),
    "entropies": np.asarray(buf["entropy"], np.float32),
    "topk_entropies": np.asarray(buf["topk_entropy"], np.float32),
    "stop_reason": reason,
  }
