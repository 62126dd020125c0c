"""The slot engine: a static KV cache of max_slots x max_len rows, one sequence per row ("slot").

Every per-token operation (forward, sampling, log-prob, entropies, stop detection) runs on device inside one
jitted `decode` call (a lax.scan over steps, the state donated so the cache is updated in place). The host only
validates inputs, chunks prefill/extend, and reads small per-slot summaries. See docs/rollout_contract.md.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from aepo_jax import model as model_lib
from aepo_jax.model import ModelConfig
from aepo_jax.rollout import _state as st
from aepo_jax.rollout._compiled import (  # noqa: F401  (_decode_weights, prepared_weights: read by bench/ and tests)
  _bucket,
  _decode,
  _decode_tpu,
  _decode_weights,
  _fill,
  _StepSpec,
  prepared_weights,
)
from aepo_jax.rollout._sampling import SamplingParams
from aepo_jax.rollout._prefill import _FillOps
from aepo_jax.rollout._slots import OutOfPages, _SlotOps, num_pages_for  # noqa: F401  (re-exported)

KV_LAYOUTS = ("auto", "dense", "paged")


class Engine(_FillOps, _SlotOps):
  """Slot-based generation engine (contract: docs/rollout_contract.md, section Engine)."""

  def __init__(
    self,
    model_config: ModelConfig,
    *,
    max_slots: int,
    max_len: int,
    eos_ids: Sequence[int] = None,
    stop_sequences: Sequence[Sequence[int]] = (),
    sampling: SamplingParams = SamplingParams(),
    entropy_window: int = 20,
    topk_entropy: int = 10,
    mesh=None,
    prefill_chunk: int = 128,
    prefill_rows: int = 16,
    cache_dtype: Optional[str] = None,
    cpu_kernels: Optional[bool] = None,
    compact: bool = True,
    max_decode_rows: int = 0,
    per_slot_sampling: bool = False,
    kv_layout: str = "dense",
    page_size: int = 64,
    num_pages: int = 0,
    paged_kernel: Optional[str] = None,
    record_routes: bool = False,
  ):
    """sampling: the settings of every slot; with per_slot_sampling=True, the default of a slot whose `add` gives
    none: each slot then samples with the settings `add` gave it (a server's requests in one decode call).
    cpu_kernels: decode through the CPU small-M kernel (`model.decode_weights`, aepo_jax/model/_cpu_decode.py): None (default) when it applies
    (float32 model on one CPU device, max_slots <= 64, kernel built), True to require it (an error says why it
    cannot), False for XLA's dots.
    compact: unless slots are split over devices (mesh data x fsdp > 1), a decode call with at most max(4, ceil(S/4)) active slots (< S) runs only
    those rows (padded with inactive ones to that size; one more compiled variant) instead of all S slots; through
    the CPU decode kernel also larger row sizes below S (`decode_row_sizes`). Fewer rows than 4 would save little:
    a small-batch step is bound by reading the weights.
    max_decode_rows: through the CPU decode kernel, a call runs at most this many active slots (its row sizes:
    `decode_row_sizes`): the first of `decode(order=...)`, the rest wait unchanged. A step's cost grows
    with its rows there, so past the rows where the machine's matmuls saturate (16 for SmolLM2-135M on 2 cores: 55
    ms a step against 110 ms at 32) more rows add no tokens per second, only latency to every row; partial rollouts
    thus finish their oldest groups sooner. 0 (default): every active slot.
    kv_layout: 'dense' (a max_len row per slot), 'paged' (a pool of `num_pages` pages of `page_size` tokens,
    aepo_jax/rollout/_pages.py: forks share full pages, the pool is sized by the tokens in flight rather than
    slots x max_len) or 'auto' (paged on TPU unless slots are split over devices; dense elsewhere, where the CPU
    kernels read dense rows). num_pages 0: enough for every slot at max_len (+ the null page).
    paged_kernel: the paged decode attention: None (JAX's Pallas paged-attention kernel on TPU when head_dim is a
    multiple of 128, XLA's attention over gathered pages otherwise), '' (XLA's everywhere), 'tpu' or 'interpret' (the kernel in Pallas interpret mode).
    record_routes (a model with experts): keep the experts every cached token went to in each sparse layer
    (`DecodeState.routes`, read with `slot_routes`), for routing replay in the update (R3, arXiv 2510.11370)."""
    if max_slots < 1 or max_len < 2:
      raise ValueError(f"Engine: max_slots={max_slots} must be >= 1 and max_len={max_len} >= 2.")
    if record_routes and not model_config.has_experts:
      raise ValueError("Engine(record_routes=True): routes are the experts of a sparse layer; the model has none.")
    self.record_routes = bool(record_routes)
    self.config = model_config
    self.max_slots, self.max_len = int(max_slots), int(max_len)
    self.eos_ids = tuple(int(e) for e in (model_config.eos_token_ids if eos_ids is None else eos_ids))
    seqs = []
    for seq in stop_sequences:
      seq = tuple(int(t) for t in seq)
      if not seq or min(seq) < 0 or max(seq) >= model_config.vocab_size:
        raise ValueError(f"Engine: stop sequence {seq} must be non-empty token ids in [0, {model_config.vocab_size}).")
      seqs.append(seq)
    self.stop_sequences = tuple(dict.fromkeys(seqs))
    self.sampling = sampling
    self.per_slot_sampling = bool(per_slot_sampling)
    self.entropy_window, self.topk_entropy = int(entropy_window), int(topk_entropy)
    if self.topk_entropy > model_config.vocab_size:
      raise ValueError(f"Engine: topk_entropy={topk_entropy} exceeds the vocabulary ({model_config.vocab_size}).")
    self.tail_width = max([len(s) for s in self.stop_sequences], default=1)
    self.prefill_chunk = int(prefill_chunk)
    if prefill_rows < 1:
      raise ValueError(f"Engine: prefill_rows={prefill_rows} must be >= 1.")
    self.prefill_rows = int(prefill_rows)
    self.mesh = mesh
    self.cache_dtype = cache_dtype
    self.cpu_kernels = cpu_kernels
    self.compact = bool(compact)
    if max_decode_rows < 0:
      raise ValueError(f"Engine: max_decode_rows={max_decode_rows} must be >= 0 (0: every active slot).")
    self.max_decode_rows = int(max_decode_rows)
    self._use_kernels = None  # decided at the first decode (needs the parameters' device)
    if kv_layout not in KV_LAYOUTS:
      raise ValueError(f"Engine: kv_layout={kv_layout!r}; use one of {KV_LAYOUTS}.")
    platform = self._platform()
    if kv_layout == "auto":
      kv_layout = "paged" if platform == "tpu" and not self._rows_sharded() else "dense"
    if kv_layout == "paged" and self._rows_sharded():
      raise ValueError(
        f"Engine(kv_layout='paged'): the rollout mesh splits slots over data x fsdp ({dict(mesh.shape)}); the page "
        "pool is shared by all slots of a host, so use a mesh with data = fsdp = 1 (KV heads over tensor) or "
        "kv_layout='dense'."
      )
    self.kv_layout = kv_layout
    if kv_layout == "paged" and int(page_size) < 1:
      raise ValueError(f"Engine: page_size={page_size} must be >= 1 (tokens per KV page).")
    self.page_size = int(page_size) if kv_layout == "paged" else 0
    self.pages_per_slot = -(-self.max_len // self.page_size) if self.page_size else 0
    if self.page_size:
      self.num_pages = int(num_pages) or self.max_slots * self.pages_per_slot + 1
      if self.num_pages < 2:
        raise ValueError(f"Engine: num_pages={num_pages} must be >= 2 (page 0 is the null page).")
    else:
      self.num_pages = 0
    # The kernel's TPU lowering needs head_dim a multiple of 128 (aepo_jax/model/_paged_tpu.py).
    if paged_kernel is None:
      paged_kernel = "tpu" if platform == "tpu" and model_config.head_dim % 128 == 0 else ""
    if paged_kernel not in ("", "tpu", "interpret"):
      raise ValueError(f"Engine: paged_kernel={paged_kernel!r}; use None, '', 'tpu' or 'interpret'.")
    self.paged_kernel = paged_kernel if self.page_size else ""

  def _platform(self) -> str:
    return self.mesh.devices.flat[0].platform if self.mesh is not None else jax.default_backend()

  # ------------------------------------------------------------------------------------------------
  # JetStream-style sizes
  # ------------------------------------------------------------------------------------------------
  @property
  def max_concurrent_decodes(self) -> int:
    return self.max_slots

  def step_spec(
    self,
    sampling: Optional[SamplingParams] = None,
    with_entropy: bool = True,
    attend_len: Optional[int] = None,
    top_logprobs: int = 0,
  ) -> _StepSpec:
    sampling = sampling or (None if self.per_slot_sampling else self.sampling)
    return _StepSpec(
      sampling,
      bool(with_entropy),
      self.topk_entropy,
      self.entropy_window,
      self.eos_ids,
      self.stop_sequences,
      int(attend_len or self.max_len),
      top_logprobs=int(top_logprobs),
      paged_kernel=self.paged_kernel,
    )

  def attend_bucket(self, max_length: int) -> int:
    """Attention window for a decode call whose rows end at most at `max_length` tokens: a power of two
    (>= 128) so that only a few variants compile, capped at max_len."""
    return min(self.max_len, _bucket(max_length, lo=128))

  # ------------------------------------------------------------------------------------------------
  # State
  # ------------------------------------------------------------------------------------------------
  def _empty_state(self) -> st.DecodeState:
    return st.empty_state(
      self.config,
      self.max_slots,
      self.max_len,
      self.tail_width,
      self.cache_dtype,
      self.page_size,
      self.num_pages,
      self.record_routes,
    )

  def init_decode_state(self) -> st.DecodeState:
    state = self._empty_state()
    if self.mesh is not None:
      state = jax.device_put(state, self._state_shardings(state))
    return state

  def _state_shardings(self, state):
    """The KV cache over the mesh by CACHE_LOGICAL_AXES (slots over data x fsdp, KV heads over tensor); every
    other field replicated."""
    from aepo_jax.model import CACHE_LOGICAL_AXES, PAGED_CACHE_LOGICAL_AXES
    from aepo_jax.parallel import logical_sharding
    from jax.sharding import NamedSharding, PartitionSpec

    if state.paged:
      specs = jax.tree.map(lambda _: PartitionSpec(*PAGED_CACHE_LOGICAL_AXES), state.cache)
    else:
      specs = {k: PartitionSpec(*CACHE_LOGICAL_AXES) for k in state.cache}
    replicated = NamedSharding(self.mesh, PartitionSpec())
    return jax.tree.map(lambda _: replicated, state.replace(cache={})).replace(
      cache=logical_sharding(specs, state.cache, self.mesh)
    )

  # ------------------------------------------------------------------------------------------------
  # Ahead-of-time lowering (launch/compile.py: the engine's programs for a TPU slice, on any host)
  # ------------------------------------------------------------------------------------------------
  def abstract_decode_state(self) -> st.DecodeState:
    """ShapeDtypeStructs (with the engine's shardings when it has a mesh) of `init_decode_state()`."""
    shapes = jax.eval_shape(self._empty_state)
    if self.mesh is None:
      return shapes
    return jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, self._state_shardings(shapes)
    )

  def lower_decode(self, params, num_steps: int, *, compact: bool = False):
    """The lowered decode call of `num_steps` steps over the whole cache window (`params`: arrays or
    ShapeDtypeStructs); compact=True: the variant that runs only max(4, ceil(S/4)) gathered rows."""
    state = self.abstract_decode_state()
    rows = None
    if compact:
      rows = jax.ShapeDtypeStruct((max(4, -(-self.max_slots // 4)),), jnp.int32)  # as compact_slots
    if self.page_size:  # the paged engine runs one step per call (see `decode`)
      num_steps = 1
    with self._kernel_context():
      return self._decode_fn.lower(
        self.config, self.step_spec(attend_len=self.max_len), int(num_steps), params, state, None, rows
      )

  @property
  def _decode_fn(self):
    """The jitted decode step: on TPU with the paged kernel, the one with `_compiled.TPU_DECODE_OPTIONS`."""
    return _decode_tpu if self.paged_kernel == "tpu" else _decode

  def _kernel_context(self):
    """The mesh for the paged-attention kernel's shard_map (read while the decode step traces)."""
    if self.paged_kernel and self.mesh is not None:
      from aepo_jax.parallel import sharding_context

      return sharding_context(self.mesh)
    return contextlib.nullcontext()

  def lower_fill(self, params):
    """The lowered prefill/extend call: prefill_rows rows, one prefill_chunk each, reading the whole window."""
    state = self.abstract_decode_state()
    chunk, span = self._fill_chunk(self.prefill_chunk)
    rows = jax.ShapeDtypeStruct((_bucket(min(self.prefill_rows, self.max_slots)),), jnp.int32)
    return _fill.lower(self.config, chunk, span, params, state, rows, rows, rows if self.page_size else None)

  def _fill_chunk(self, chunk: int) -> tuple:
    """(tokens per prefill call and row, the window a call may reach): paged, whole pages (model.fill_cache_rows)."""
    chunk = min(chunk, self.max_len)
    if not self.page_size:
      return chunk, self.max_len
    span = self.pages_per_slot * self.page_size
    return min(-(-chunk // self.page_size) * self.page_size, span), span

  # ------------------------------------------------------------------------------------------------
  # Input checks (before any compute)
  # ------------------------------------------------------------------------------------------------
  def _check_slots(self, slots, what="slots", unique=True) -> np.ndarray:
    arr = np.asarray(list(slots), np.int64).reshape(-1)
    bad = arr[(arr < 0) | (arr >= self.max_slots)]
    if bad.size:
      raise ValueError(f"Engine: {what} {bad.tolist()} out of range; slots are 0..{self.max_slots - 1}.")
    if unique and len(set(arr.tolist())) != arr.size:
      raise ValueError(f"Engine: {what} {arr.tolist()} contain duplicates; each slot may appear once per call.")
    return arr.astype(np.int32)

  def _check_tokens(self, token_lists, what) -> list:
    out = []
    for i, toks in enumerate(token_lists):
      arr = np.asarray(toks, np.int64).reshape(-1)
      if arr.size and (arr.min() < 0 or arr.max() >= self.config.vocab_size):
        raise ValueError(f"Engine: {what}[{i}] has token ids outside [0, {self.config.vocab_size}).")
      out.append(arr.astype(np.int32))
    return out

  # ------------------------------------------------------------------------------------------------
  # Decode and slot edits
  # ------------------------------------------------------------------------------------------------
  def decode(
    self,
    params,
    state,
    num_steps: int,
    *,
    sampling: Optional[SamplingParams] = None,
    with_entropy: bool = True,
    top_logprobs: int = 0,
    order=None,
  ):
    """num_steps decode steps for all active slots in one jitted call -> (state, StepOutputs [S, num_steps]).
    sampling: static settings for every slot (overrides per-slot ones). top_logprobs: also output the N most
    likely tokens of each step and their log-probs (one compiled variant per N). order: slots by priority (first
    first); with max_decode_rows, the call runs the first active ones of it (active slots not in it come last) and
    the others wait unchanged (their outputs are not valid)."""
    if num_steps < 1:
      raise ValueError(f"Engine.decode: num_steps={num_steps} must be >= 1.")
    if not 0 <= top_logprobs <= self.config.vocab_size:
      raise ValueError(f"Engine.decode: top_logprobs={top_logprobs} must be in [0, {self.config.vocab_size}].")
    weights_t = prepared_weights.get(self.config, params) if self.uses_cpu_kernels(params) else None
    if self.paged_kernel or (
      weights_t is not None
      and not self.page_size
      and model_lib.decode_attention_kernel_applies(self.config, state.cache["k"].dtype)
    ):
      # The kernel's attention (CPU decode kernel, or Pallas paged attention on TPU) reads each row's own entries
      # only: one compiled variant and no host read for a window bucket.
      attend = self.max_len
    else:  # XLA's attention reads only the cache prefix any row can reach in this call (one small host read)
      attend = self.attend_bucket(int(jax.device_get(jnp.max(state.length))) + int(num_steps))
    spec = self.step_spec(sampling, with_entropy, attend, top_logprobs)
    rows = self._decode_rows(state, ladder=weights_t is not None, order=order)
    with self._kernel_context():
      if not self.page_size:
        return self._decode_fn(self.config, spec, int(num_steps), params, state, weights_t, rows)
      # Paged: one jitted step per call, the calls queued back to back (no host sync between them). In a scan over
      # steps XLA:TPU would copy the pool every step (aepo_jax/rollout/_pages.py); a step whose rows are all idle
      # is skipped on device as in the scan.
      outs = []
      for _ in range(int(num_steps)):
        state, out = self._decode_fn(self.config, spec, 1, params, state, weights_t, rows)
        outs.append(out)
      return state, jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *outs)

  @property
  def compact_slots(self) -> int:
    """Rows of a compact decode call, max(4, ceil(S/4)); 0 where this engine never compacts (compact=False, S <= 4,
    or slots split over devices)."""
    r = max(4, -(-self.max_slots // 4))
    return r if self.compact and r < self.max_slots and not self._rows_sharded() else 0

  def decode_row_sizes(self, ladder: bool = True) -> tuple:
    """The row counts a compact decode call may run, smallest first (empty: this engine never compacts). XLA's path
    (ladder=False): compact_slots only. Through the CPU decode kernel (ladder=True), whose cost grows with the rows
    (SmolLM2-135M on 2 cores: a step of 12 rows 10-20% cheaper than one of 16, bench/decode_rows.py), also the
    sizes above it, each 1.5x the last rounded up to the kernel's 4-row tile, while below S and max_decode_rows,
    plus max_decode_rows itself where it is below S (in place of a size less than 4 rows below it): S = 32 gives
    8, 12, 16 (cap 16), 8, 13 (cap 13) or 8, 12, 20 (no cap). One compiled variant each."""
    r = self.compact_slots
    if not r:
      return ()
    cap = self.max_decode_rows if ladder and 0 < self.max_decode_rows < self.max_slots else self.max_slots
    sizes = [min(r, cap)]
    while ladder:
      nxt = max(sizes[-1] + 4, -(-(3 * sizes[-1]) // 8) * 4)  # 1.5x, rounded up to a multiple of 4
      if nxt >= cap:
        break
      sizes.append(nxt)
    if ladder and cap < self.max_slots and sizes[-1] < cap:
      if len(sizes) > 1 and cap - sizes[-1] < 4:  # a size just below the cap saves less than a row tile
        sizes.pop()
      sizes.append(cap)
    return tuple(sizes)

  def _decode_rows(self, state, ladder: bool = False, order=None) -> Optional[jax.Array]:
    """The slots a compact decode call runs (every active slot, padded with inactive ones to the call's rows: the
    smallest of `decode_row_sizes(ladder)` that holds them), or None for all slots. One small device read of
    `active`. With `ladder` (through the CPU kernel) max_decode_rows caps the active slots a call runs, the first
    of `order`."""
    sizes = self.decode_row_sizes(ladder)
    if not sizes:
      return None
    active = np.asarray(jax.device_get(state.active), bool)
    n = int(active.sum())
    if ladder and self.max_decode_rows:
      n = min(n, self.max_decode_rows)
    fits = [k for k in sizes if k >= n]
    if not fits:
      return None
    r = fits[0]
    live = np.flatnonzero(active)
    if order is not None and live.size > r:  # more active slots than rows: the first of `order` run
      rank = np.full(self.max_slots, self.max_slots, np.int64)
      first = self._check_slots(order, "order")
      rank[first] = np.arange(first.size)
      live = live[np.argsort(rank[live], kind="stable")]
    rows = np.concatenate([live, np.flatnonzero(~active)])[:r]
    return jnp.asarray(np.sort(rows), jnp.int32)

  def _rows_sharded(self) -> bool:
    """Slots are split over devices (mesh data x fsdp > 1): gathering active rows would move cache rows between
    devices. A tensor-parallel mesh keeps whole rows on every device, so compact decoding stays on there."""
    return self.mesh is not None and self.mesh.shape.get("data", 1) * self.mesh.shape.get("fsdp", 1) > 1

  def uses_cpu_kernels(self, params) -> bool:
    """Whether decode runs through the CPU small-M kernel (decided once per engine, see `cpu_kernels`)."""
    if self._use_kernels is None:
      if self.cpu_kernels is False:
        self._use_kernels = False
      else:
        why = model_lib.decode_kernels_unavailable(self.config, self.max_slots, self.mesh, params)
        if why is not None and self.cpu_kernels:
          raise ValueError(
            f"Engine(cpu_kernels=True): the CPU decode kernel cannot be used: {why}. Pass "
            "cpu_kernels=None (use it where it applies) or False."
          )
        self._use_kernels = why is None
    return self._use_kernels
