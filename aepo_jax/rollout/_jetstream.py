"""JetStream 0.2.2 `Engine` adapter over the slot engine (optional extra `[jetstream]`).

JetStream is archived and pulls TensorFlow through seqio, so this module imports jetstream only inside
`jetstream_engine_class()`, within `_jetstream_imported()`, which contains what JetStream 0.2.2 needs and does:
  * a minimal `seqio.vocabularies` (JetStream's token_utils imports two classes from it at import time) is in
    `sys.modules` only while jetstream's modules are imported, then taken out again;
  * `jax.tree_map` (removed from JAX, still called by the orchestrator, which kills its process on error) is given
    to the orchestrator module alone, as its own `jax` name; the `jax` module itself is left untouched;
  * the orchestrator sets the root logger to DEBUG with a stdout handler when imported: both are undone.
Install without TensorFlow:
  pip install grpcio tiktoken blobfile shortuuid portpicker prometheus-client
  pip install --no-deps google-jetstream==0.2.2

Mapping: `prefill` runs a one-slot engine (KV computed there, so prefill and generate engines may differ);
the Prefix is that one-slot DecodeState; `insert` copies it into a slot of the serving state (one jitted copy);
`generate` is one `Engine.decode` step and returns ResultTokens with [token, valid, n_generated] per slot.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import logging
import sys
import types
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from aepo_jax.rollout._factory import make_engine
from aepo_jax.rollout._sampling import SamplingParams

_NO_BOS = -1  # JetStream prepends bos_id to token requests; a model without BOS gets this marker, dropped again


class _JaxWithTreeMap(types.ModuleType):
  """`jax` plus the `tree_map` alias JAX removed, for JetStream's orchestrator module only."""

  tree_map = staticmethod(jax.tree.map)

  def __getattr__(self, name):
    return getattr(jax, name)


@contextlib.contextmanager
def _jetstream_imported():
  """Imports JetStream's orchestrator, and lets the body import its engine modules; every global change they need or
  make is undone at exit (see the module docstring). The modules stay imported (in `sys.modules`), patched."""
  fake_seqio = "seqio" not in sys.modules and importlib.util.find_spec("seqio") is None
  if fake_seqio:
    vocab = types.ModuleType("seqio.vocabularies")
    vocab.Vocabulary = type("Vocabulary", (), {})
    vocab.SentencePieceVocabulary = type("SentencePieceVocabulary", (vocab.Vocabulary,), {})
    seqio = types.ModuleType("seqio")
    seqio.vocabularies = vocab
    sys.modules["seqio"], sys.modules["seqio.vocabularies"] = seqio, vocab
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  try:
    try:
      from jetstream.core import orchestrator
    except ImportError:  # the engine API alone (no grpc / prometheus-client): no orchestrator to patch
      orchestrator = None
    if orchestrator is not None and not hasattr(jax, "tree_map"):
      orchestrator.jax = _JaxWithTreeMap("jax")
    yield
  finally:
    root.setLevel(level)
    for h in root.handlers[:]:
      if h not in handlers:
        root.removeHandler(h)
    if fake_seqio:
      for name in ("seqio", "seqio.vocabularies"):
        sys.modules.pop(name, None)


def _insert(prefix, state, slot):
  """Copies the single row of `prefix` (a one-slot DecodeState) into `slot` of `state`."""

  def put(dst, src):
    return dst.at[slot].set(src[0])

  cache = jax.tree.map(lambda d, s: d.at[:, slot].set(s[:, 0]), state.cache, prefix.cache)
  rest = jax.tree.map(put, state.replace(cache={}), prefix.replace(cache={}))
  return rest.replace(cache=cache)


@functools.lru_cache(maxsize=None)
def jetstream_engine_class():
  """Builds the adapter class (a subclass of JetStream's Engine ABC); imports jetstream on first call."""
  with _jetstream_imported():
    from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2, token_utils

  class _Tokenizer(tokenizer_api.Tokenizer):
    """JetStream tokenizer over an HF-style tokenizer (encode/decode) and the model's special ids."""

    def __init__(self, tokenizer, eos_ids: Sequence[int], pad_id: int, bos_id: Optional[int]):
      self._tok, self._eos, self._pad, self._bos = tokenizer, tuple(eos_ids), pad_id, bos_id

    def encode(
      self, s: str, is_bos: bool = True, max_prefill_length: Optional[int] = None, jax_padding: bool = True, **kwargs
    ):
      from aepo_jax.rollout._stop import _encode

      ids = np.asarray(_encode(self._tok, s), np.int32)
      return token_utils.pad_tokens(
        ids,
        self.bos_id,
        self.pad_id,
        is_bos=is_bos and self._bos is not None,
        max_prefill_length=max_prefill_length,
        jax_padding=jax_padding,
      )

    def decode(self, token_ids, **kwargs) -> str:
      return self._tok.decode([int(t) for t in token_ids])

    @property
    def pad_id(self) -> int:
      return self._pad

    @property
    def eos_id(self) -> int:
      return self._eos[0]

    @property
    def bos_id(self) -> int:
      return _NO_BOS if self._bos is None else self._bos

    @property
    def stop_tokens(self) -> set:
      return set(self._eos)  # not the pad id (JetStream's default adds it)

  class JetStreamEngine(engine_api.Engine):
    """JetStream `Engine` over aepo_jax's slot engine (one decode step per `generate`)."""

    def __init__(
      self,
      model_config,
      params=None,
      *,
      max_slots: int,
      max_len: int,
      tokenizer=None,
      sampling: SamplingParams = SamplingParams(),
      eos_ids: Optional[Sequence[int]] = None,
      prefill_chunk: int = 128,
      seed: int = 0,
    ):
      self.config, self._params, self._hf_tokenizer = model_config, params, tokenizer
      kw = dict(max_len=max_len, eos_ids=eos_ids, sampling=sampling, prefill_chunk=prefill_chunk)
      self.engine = make_engine(model_config, max_slots=max_slots, **kw)
      self._one = make_engine(model_config, max_slots=1, **kw)  # prefill engine: one row per request
      self._insert = jax.jit(_insert, donate_argnums=(1,))
      self._seeds = itertools.count(seed)
      # JetStream only accepts powers of two (>= 16) here; keep one position free for generation.
      self._max_prefill = 1 << (max(16, max_len - 1).bit_length() - 1)
      if self._max_prefill >= max_len:
        raise ValueError(f"JetStreamEngine: max_len={max_len} must be > 16 (JetStream's smallest prefill bucket).")

    # -- Engine ABC -------------------------------------------------------------------------------
    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int):
      if existing_prefix is not None:
        raise NotImplementedError(
          "JetStreamEngine.prefill: existing_prefix (multi-turn sessions) is not "
          "supported; send the whole history as one request."
        )
      tokens = np.asarray(jax.device_get(padded_tokens))[: int(true_length)]
      tokens = tokens[tokens != _NO_BOS]
      budget = self.engine.max_len  # JetStream ends requests itself at max_tokens
      return self._one.add(params, self._one.init_decode_state(), [0], [tokens], [next(self._seeds)], budget)

    def insert(self, prefix, decode_state, slot: int):
      self.engine._check_slots([slot], "slot")
      return self._insert(prefix, decode_state, jnp.int32(slot))

    def generate(self, params, decode_state):
      state, out = self.engine.decode(params, decode_state, 1)
      data = jnp.stack([out.token[:, 0], out.valid[:, 0].astype(jnp.int32), state.n_generated], axis=1)
      return state, engine_api.ResultTokens(
        data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3), samples_per_slot=1
      )

    def init_decode_state(self, *args, **kwargs):
      return self.engine.init_decode_state()

    def load_params(self, *args, **kwargs):
      if self._params is None:
        raise ValueError(
          "JetStreamEngine.load_params: build the engine with params=... (e.g. from aepo_jax.model.load_hf)."
        )
      return self._params

    def get_prefix_destination_sharding(self):
      return None  # single-host: prefixes stay where they are

    def get_tokenizer(self):
      return tokenizer_pb2.TokenizerParameters(path="aepo_jax")

    def build_tokenizer(self, metadata):
      if self._hf_tokenizer is None:
        raise ValueError(
          "JetStreamEngine: text requests need tokenizer=... (HF or aepo_jax.model.Tokenizer); "
          "token-id requests work without one only if you never build the tokenizer."
        )
      cfg = self.config
      pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
      return _Tokenizer(self._hf_tokenizer, self.engine.eos_ids or (pad,), pad, cfg.bos_token_id)

    @property
    def max_concurrent_decodes(self) -> int:
      return self.engine.max_slots

    @property
    def samples_per_slot(self) -> int:
      return 1

    @property
    def max_prefill_length(self) -> int:
      return self._max_prefill

    @property
    def mesh(self):
      return self.engine.mesh

    @property
    def colocated_cpus(self):
      return None

  return JetStreamEngine


def JetStreamEngine(*args, **kwargs):
  """Constructs the JetStream adapter (see `jetstream_engine_class`); needs google-jetstream installed."""
  return jetstream_engine_class()(*args, **kwargs)
