"""`make_engine`: the one place an `Engine` is built from a model config and a run's settings (trainer, evaluation,
server, `generate`, the JetStream adapter), so the stop sequences, EOS ids, greedy settings and mesh rule agree."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from aepo_jax.rollout._engine import Engine
from aepo_jax.rollout._sampling import SamplingParams
from aepo_jax.rollout._stop import stop_sequences_from_strings


def make_engine(
  model_config,
  *,
  max_slots: int,
  max_len: int,
  tokenizer=None,
  stop_strings: Sequence[str] = (),
  stop_sequences: Sequence[Sequence[int]] = (),
  eos_ids: Optional[Sequence[int]] = None,
  tokenizer_eos: bool = False,
  sampling: SamplingParams = SamplingParams(),
  mesh=None,
  **engine_kw,
) -> Engine:
  """An `Engine` (its other keywords in `engine_kw`: entropy_window, prefill_chunk, per_slot_sampling, ...).

  stop_strings: e.g. a tool call's closing tag `</python>`, as the token sequences `stop_sequences_from_strings`
    finds (needs `tokenizer`), after the explicit `stop_sequences`.
  eos_ids: default the model's; tokenizer_eos puts the tokenizer's own `eos_ids` (a chat template's end of turn)
    first. The agent loop ends a trajectory with eos_ids[0].
  sampling: when greedy, top-p / top-k / min-p are dropped (argmax ignores them), so every greedy setting shares
    one compiled step.
  mesh: dropped when it holds one device (the single-device path, and its CPU kernels, apply).
  """
  seqs = [list(s) for s in stop_sequences]
  if stop_strings:
    if tokenizer is None:
      raise ValueError("make_engine: stop_strings need a tokenizer (to find their token sequences).")
    seqs += stop_sequences_from_strings(tokenizer, stop_strings)
  eos = tuple(model_config.eos_token_ids if eos_ids is None else eos_ids)
  if tokenizer_eos:
    eos = tuple(dict.fromkeys([*getattr(tokenizer, "eos_ids", ()), *eos]))
  if sampling.greedy:
    sampling = dataclasses.replace(sampling, top_p=1.0, top_k=0, min_p=0.0)
  if mesh is not None and mesh.devices.size == 1:
    mesh = None
  return Engine(
    model_config,
    max_slots=max_slots,
    max_len=max_len,
    eos_ids=eos,
    stop_sequences=seqs,
    sampling=sampling,
    mesh=mesh,
    **engine_kw,
  )
