"""Generated token ids -> text for one choice: incremental detokenization, stop strings and stop token ids, the
text held back while it may still become a stop string, and the per-token pieces that log-probs report.

Detokenization follows vLLM's incremental scheme: each token's text is decode(ids[prefix:]) minus
decode(ids[prefix:read]) over a short window, so a tokenizer that adds or drops a leading space at the start of
a decode (SentencePiece) gives the same text as decoding the whole sequence, and a token that ends inside a
multi-byte character shows its text only once the character is complete.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence


@dataclasses.dataclass
class TokenPiece:
  """One generated token as reported in log-probs."""

  token_id: int
  logprob: float
  offset: int  # characters of output text before this token's text
  top: Sequence[tuple] = ()  # ((token_id, logprob), ...) most likely first


class ChoiceText:
  """Text of one choice, fed the engine's tokens chunk by chunk (`push`), finished with `finish`.

  After each call, `take()` returns the new text that may be sent (a stream's delta) and the pieces of the
  tokens it covers. `stopped` is set when a stop string or stop token id ends the choice on the host.
  """

  def __init__(
    self,
    tokenizer,
    *,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    include_stop: bool = False,
    skip_special_tokens: bool = True,
    eos_ids: Sequence[int] = (),
  ):
    self._tok = tokenizer
    self._stop = tuple(s for s in stop if s)
    self._stop_ids = frozenset(int(t) for t in stop_token_ids)
    self._eos = frozenset(int(t) for t in eos_ids)
    self._include = include_stop
    self._skip = skip_special_tokens
    self._hold = max((len(s) for s in self._stop), default=1) - 1  # a stop string may start this far back
    self._ids: list = []
    self._prefix = self._read = 0
    self.text = ""  # all text so far (cut at a stop once found)
    self.pieces: list = []  # TokenPiece per token whose text is reported
    self.token_ids: list = []  # tokens generated up to the end (stop token / EOS included)
    self.stopped = False
    self.stop_reason = None  # the stop string or token id that ended the choice (vLLM's stop_reason)
    self._sent_chars = 0
    self._sent_pieces = 0
    self._searched = 0  # text before this index holds no stop string start

  @property
  def num_tokens(self) -> int:
    return len(self.token_ids)

  def _decode(self, ids) -> str:
    return self._tok.decode(ids, skip_special_tokens=self._skip)

  def _piece_text(self, token_id: int) -> str:
    self._ids.append(token_id)
    prefix_text = self._decode(self._ids[self._prefix : self._read])
    new_text = self._decode(self._ids[self._prefix :])
    if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
      self._prefix, self._read = self._read, len(self._ids)
      return new_text[len(prefix_text) :]
    return ""

  def push(self, token_ids, logprobs=None, top_ids=None, top_logprobs=None, final: Optional[str] = None):
    """Appends generated tokens. final: the engine's finish for the last of them ('eos' ends without its text)."""
    if self.stopped:
      return
    for i, t in enumerate(int(x) for x in token_ids):
      self.token_ids.append(t)
      lp = float(logprobs[i]) if logprobs is not None else 0.0
      top = tuple(zip(map(int, top_ids[i]), map(float, top_logprobs[i]))) if top_ids is not None else ()
      piece = TokenPiece(t, lp, len(self.text), top)
      if t in self._stop_ids or (t in self._eos and final == "eos" and i == len(token_ids) - 1):
        if t in self._stop_ids:
          self.stopped, self.stop_reason = True, t
        if self._include and t in self._stop_ids:
          self.text += self._piece_text(t)
          self.pieces.append(piece)
        break
      self.text += self._piece_text(t)
      self.pieces.append(piece)
      if self._stop and self._find_stop():
        return
    if final is not None or self.stopped:  # the end: text still waiting for bytes of a character goes out as is
      rest = self._decode(self._ids[self._prefix :])[len(self._decode(self._ids[self._prefix : self._read])) :]
      self._prefix = self._read = len(self._ids)
      self.text += rest
      if self._stop and rest:
        self._find_stop()

  def _find_stop(self) -> bool:
    best = None
    for s in self._stop:
      j = self.text.find(s, self._searched)
      if j >= 0 and (best is None or j < best[0]):
        best = (j, s)
    if best is None:
      self._searched = max(self._searched, len(self.text) - self._hold)
      return False
    j, s = best
    cut = j + len(s) if self._include else j
    self.text = self.text[:cut]
    self.pieces = [p for p in self.pieces if p.offset < cut]
    self.stopped, self.stop_reason = True, s
    return True

  def take(self, done: bool):
    """(new text, new pieces) to send: everything when `done` (or stopped), else all but the held-back tail."""
    end = (
      len(self.text) if (done or self.stopped or not self._stop) else max(self._sent_chars, len(self.text) - self._hold)
    )
    delta = self.text[self._sent_chars : end]
    self._sent_chars = end
    n = len(self.pieces) if (done or self.stopped) else sum(1 for p in self.pieces if p.offset < end)
    pieces = self.pieces[self._sent_pieces : max(n, self._sent_pieces)]
    self._sent_pieces = max(n, self._sent_pieces)
    return delta, pieces
