"""Stop strings (`</search>`, `</python>`, ...) as token-id sequences for the engine, plus a host-side check.

The engine matches token sequences on device. A stop string has no single tokenization: in context BPE may
merge its first characters with the text before it (`)</` as one token) or its last ones with the text after
it (`>\n`). Two layers handle that:
  1. `stop_sequences_from_strings` tokenizes each string inside a set of likely contexts and keeps, for each,
     the shortest run of tokens whose text contains the string: the common variants stop on device, with no
     host round trip;
  2. `StopStringChecker` catches the rest on the host after each decode chunk: it looks only at rows that
     produced a token containing a stop string's last character (a per-vocabulary mask), decodes just their
     current segment, and returns where the first stop string ends. The caller rewinds (`Engine.truncate`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

_PREFIXES = ("", " ", "\n", "a", "1", ".", ")", "\"", "'", "]", "}", ">", ":", " a", "a.", "\n\n")
_SUFFIXES = ("", "\n", " ", "\n\n", ".", "<")


def _encode(tokenizer, text: str) -> list:
  """Token ids of `text` with no BOS/special tokens added (HF tokenizers or aepo_jax.model.Tokenizer)."""
  if hasattr(tokenizer, "encode_continuation"):
    return list(tokenizer.encode_continuation(text))
  try:
    return list(tokenizer.encode(text, add_special_tokens=False))
  except TypeError:
    return list(tokenizer.encode(text))


def _decode(tokenizer, ids) -> str:
  return tokenizer.decode([int(i) for i in ids])


def _completing_run(tokenizer, ids, s: str) -> Optional[tuple]:
  """The shortest run ids[i:j] whose text contains s, with j the first token at which s is complete."""
  for j in range(1, len(ids) + 1):
    if s in _decode(tokenizer, ids[:j]):
      for i in range(j - 1, -1, -1):
        if s in _decode(tokenizer, ids[i:j]):
          return tuple(int(t) for t in ids[i:j])
  return None


def stop_sequences_from_strings(tokenizer, strings: Sequence[str]) -> list:
  """Token-id sequences that end generation at each stop string (deduplicated, several per string).

  Limitation: only variants seen in the contexts above are matched on device; use `StopStringChecker` for
  a guarantee. A string that no context produces raises (it could never be matched).
  """
  seqs = []
  for s in strings:
    if not s:
      raise ValueError("stop_sequences_from_strings: empty stop string; remove it from stop_strings.")
    found = []
    for pre in _PREFIXES:
      for suf in _SUFFIXES:
        run = _completing_run(tokenizer, _encode(tokenizer, pre + s + suf), s)
        if run is not None and run not in found:
          found.append(run)
    if not found:
      raise ValueError(
        f"stop string {s!r} does not survive tokenize/detokenize with this tokenizer; it can never "
        "be matched. Check the string (e.g. special tokens are skipped on decode)."
      )
    seqs.extend(f for f in found if f not in seqs)
  return seqs


class StopStringChecker:
  """Host-side exact check for stop strings in generated text (see the module docstring)."""

  def __init__(self, tokenizer, strings: Sequence[str], vocab_size: int):
    self.tokenizer = tokenizer
    self.strings = tuple(strings)
    last_chars = {s[-1] for s in self.strings}
    pieces = [_decode(tokenizer, [i]) for i in range(vocab_size)]
    # A token can complete a stop string only if its text holds the string's last character (or it decodes
    # to a partial byte sequence, shown as U+FFFD, which may complete a multi-byte character).
    self.candidate = np.asarray([any(c in p for c in last_chars) or "\ufffd" in p for p in pieces], bool)

  def has_candidate(self, tokens) -> bool:
    tokens = np.asarray(tokens, np.int64)
    return bool(tokens.size and self.candidate[tokens].any())

  def first_stop(self, segment_tokens) -> Optional[int]:
    """Number of tokens of `segment_tokens` up to and including the one that completes the first stop string,
    or None when no stop string occurs in their text."""
    ids = [int(t) for t in segment_tokens]
    if not self.strings or not ids or not self.has_candidate(ids):
      return None
    if not any(s in _decode(self.tokenizer, ids) for s in self.strings):
      return None
    lo, hi = 1, len(ids)  # the prefix text grows monotonically: binary search the first prefix holding a string
    while lo < hi:
      mid = (lo + hi) // 2
      if any(s in _decode(self.tokenizer, ids[:mid]) for s in self.strings):
        hi = mid
      else:
        lo = mid + 1
    return lo
