"""Fixtures for the policy tests (no tests here): a character tokenizer and a scripted engine.

The scripted engine implements the Engine methods the agent loop uses (add, decode, extend, copy_slots, truncate,
release, host_info) on host numpy, with segments whose length, ending (tool call or EOS) and entropy come from a
per-slot seeded generator and a test-supplied script. It exists only to test the POLICIES (budget, order,
branch rates, concentration) under controlled entropies; the real engine is tested in test_agent_engine.py.
"""

import dataclasses
import math
import string
import threading
import time
import types

import numpy as np

from aepo_jax.rollout import _state as st

SPECIALS = ["<pad>", "<eos>", "<python>", "</python>", "<result>", "</result>"]


class CharTokenizer:
  """Specials are single tokens, every other printable character is one token."""

  def __init__(self):
    self.vocab = SPECIALS + [c for c in string.printable if c not in "\x0b\x0c"]
    self.ids = {t: i for i, t in enumerate(self.vocab)}

  def encode(self, text, add_special_tokens=False):
    out, i = [], 0
    while i < len(text):
      for sp in SPECIALS:
        if text.startswith(sp, i):
          out.append(self.ids[sp])
          i += len(sp)
          break
      else:
        out.append(self.ids.get(text[i], self.ids["?"]))
        i += 1
    return out

  def decode(self, ids):
    return "".join(self.vocab[int(i)] for i in ids)


TOK = CharTokenizer()
EOS, CLOSE, RESULT_CLOSE = TOK.ids["<eos>"], TOK.ids["</python>"], TOK.ids["</result>"]
CALL = TOK.encode("<python>1+1</python>")
FILL = TOK.ids["x"]


def default_script(rng, after_tool: bool):
  """(filler length, ends with a tool call, per-token entropy)."""
  return int(rng.integers(1, 8)), bool(rng.random() < 0.7), float(rng.uniform(0.5, 2.0))


@dataclasses.dataclass
class _Slot:
  tokens: list = dataclasses.field(default_factory=list)
  gen: list = dataclasses.field(default_factory=list)  # per position: (entropy, topk entropy) or None
  active: bool = False
  stop: int = 0
  budget: int = 0
  rng: object = None
  plan: list = dataclasses.field(default_factory=list)  # tokens still to emit in this segment
  plan_h: float = 0.0
  seg_start: int = 0


class ScriptedEngine:
  """Engine look-alike; `script(rng, after_tool) -> (n_fill, tool, entropy)` decides each segment."""

  def __init__(self, *, max_slots=8, max_len=512, script=default_script, window=20, call=CALL):
    self.max_slots, self.max_len, self.window = max_slots, max_len, window
    self.eos_ids = (EOS,)
    self.config = types.SimpleNamespace(vocab_size=len(TOK.vocab), pad_token_id=0)
    self.script, self.call = script, list(call)
    self.decode_calls = 0

  def init_decode_state(self):
    return [_Slot() for _ in range(self.max_slots)]

  def _plan(self, slot):
    after_tool = bool(slot.tokens) and slot.tokens[-1] == RESULT_CLOSE
    n_fill, tool, h = self.script(slot.rng, after_tool)
    slot.plan = [FILL] * n_fill + (self.call if tool else [EOS])
    slot.plan_h, slot.seg_start = h, len(slot.tokens)
    slot.stop = st.RUNNING if slot.budget > 0 else st.STOP_BUDGET
    slot.active = slot.stop == st.RUNNING

  def add(self, params, state, slots, token_lists, seeds, max_new_tokens):
    budgets = np.broadcast_to(np.asarray(max_new_tokens), (len(slots),))
    for s, toks, seed, b in zip(slots, token_lists, seeds, budgets):
      state[s] = _Slot(tokens=list(toks), gen=[None] * len(toks), budget=int(b), rng=np.random.default_rng(seed))
      self._plan(state[s])
    return state

  def extend(self, params, state, slots, token_lists, max_new_tokens=None):
    budgets = np.broadcast_to(np.asarray(max_new_tokens), (len(slots),))
    for s, toks, b in zip(slots, token_lists, budgets):
      assert not state[s].active, "extend of a decoding slot"
      state[s].tokens += list(toks)
      state[s].gen += [None] * len(toks)
      state[s].budget = int(b)
      self._plan(state[s])
    return state

  def decode(self, params, state, num_steps):
    self.decode_calls += 1
    shape = (self.max_slots, num_steps)
    out = types.SimpleNamespace(
      token=np.zeros(shape, np.int32),
      logprob=np.zeros(shape, np.float32),
      entropy=np.zeros(shape, np.float32),
      valid=np.zeros(shape, bool),
    )
    log_v = math.log(self.config.vocab_size)
    for s, slot in enumerate(state):
      for k in range(num_steps):
        if not slot.active:
          break
        t = slot.plan.pop(0)
        slot.tokens.append(t)
        slot.gen.append((slot.plan_h, slot.plan_h * log_v / self.window))
        slot.budget -= 1
        out.token[s, k], out.logprob[s, k], out.entropy[s, k], out.valid[s, k] = t, -1.0, slot.plan_h, True
        if t == EOS:
          slot.stop = st.STOP_EOS
        elif not slot.plan:
          slot.stop = st.STOP_SEQUENCE
        elif slot.budget <= 0:
          slot.stop = st.STOP_BUDGET
        slot.active = slot.stop == st.RUNNING
    return state, out

  def copy_slots(self, state, src, dst, seeds=None):
    for s, d, seed in zip(src, dst, seeds):
      a = state[s]
      state[d] = _Slot(
        list(a.tokens),
        list(a.gen),
        a.active,
        a.stop,
        a.budget,
        np.random.default_rng(seed),
        list(a.plan),
        a.plan_h,
        a.seg_start,
      )
    return state

  def truncate(self, state, slots, lengths):
    for s, n in zip(slots, lengths):
      slot = state[s]
      assert 1 <= n <= len(slot.tokens)
      slot.tokens, slot.gen = slot.tokens[:n], slot.gen[:n]
      slot.active, slot.stop, slot.plan = False, st.RUNNING, []
      slot.seg_start = min(slot.seg_start, n)
    return state

  def release(self, state, slots):
    for s in slots:
      state[s] = _Slot()
    return state

  def host_info(self, state):
    info = {
      k: np.zeros(self.max_slots, np.float32 if "sum" in k else np.int32)
      for k in ("length", "stop_reason", "seg_count", "seg_entropy_sum", "seg_topk_entropy_sum")
    }
    info["active"] = np.zeros(self.max_slots, bool)
    for s, slot in enumerate(state):
      seg = [g for g in slot.gen[slot.seg_start :] if g is not None]
      info["length"][s], info["active"][s], info["stop_reason"][s] = len(slot.tokens), slot.active, slot.stop
      info["seg_count"][s] = len(seg)
      info["seg_entropy_sum"][s] = sum(g[0] for g in seg[: self.window])
      info["seg_topk_entropy_sum"][s] = sum(g[1] for g in seg[: self.window])
    return info


def make_tools(fail_rate=0.0, seed=0, sleep_s=0.0, call_limit=100):
  """A real ToolSet over a scripted python tool: empty output (a failure after retries) with prob fail_rate."""
  from aepo_jax.tools import ToolSet

  rng, lock = np.random.default_rng(seed), threading.Lock()

  def tool(code):
    if sleep_s:
      time.sleep(sleep_s)
    with lock:
      fail = rng.random() < fail_rate
    return "" if fail else "2"

  return ToolSet({"python": tool}, call_limit=call_limit, retry_count=1, max_workers=8)
