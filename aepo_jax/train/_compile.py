"""The memory plan of an RL step on a TPU slice, proven by compiling the step's programs for that slice on any host.

With libtpu installed (`pip install -e ".[tpu]"`), XLA:TPU runs ahead of time on a CPU host:
`jax.experimental.topologies.get_topology_desc("v5p:4x4x2", "tpu")` gives the chips of a slice, and
`jit(f).lower(<ShapeDtypeStructs with shardings>).compile().memory_analysis()` is what each chip needs for `f`.
`compile_plan(config, topology)` builds the config's model, mesh, batch and KV-cache shapes abstractly (nothing
is allocated, no checkpoint is read) and compiles the programs of the run through the constructors the run itself
calls (the SFT phase's step and optimizer, the RL phase's update step and optimizer, the rollout's engine and weight
copy):

  sft             one cold-start SFT step (sft.batch_size rows of sft.max_len), on the training mesh
  update          one RL optimizer update: params + optimizer state (donated) and a mini-batch, on the training mesh
  logprob         old / reference log-probs of the step's whole batch, on the training mesh
  weight_cast     the policy cast to rollout.dtype where it is (training mesh), before the copy
  weight_copy     the policy copied onto every host's rollout devices (`parallel.to_host_local`'s reshard)
  prefill         the engine's prefill/extend call (prefill_rows rows x prefill_chunk tokens), on one host's devices
  decode          the engine's decode call (rollout.decode_chunk steps over every slot), on one host's devices
  decode_compact  the decode call over max(4, ceil(slots/4)) gathered slots (the engine's few-active-slots variant)

By default those the config's run runs (sft only where config.mode runs SFT; decode_compact only where the engine
compacts). Per program: its per-chip memory, the collective bytes and the HBM bytes one call moves per chip
(aepo_jax/train/_hlo.py, loop trip counts included).

Per chip, a program's peak is arguments + outputs - aliased (donated) + temporaries, plus what stays resident on
the chip while it runs and is not one of its arguments: the optimizer state (and the KL reference, if any) during
logprob, the whole training state (and reference) during prefill and decode. The rollout weights and the KV cache
are dropped before the update (the trainer deletes its rollout copy; the agent loop frees its cache).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("aepo_jax.compile")

GB = 1e9
# HBM per chip by generation (Cloud TPU documentation), in GB.
HBM_GB = {"v4": 32.0, "v5e": 16.0, "v5litepod": 16.0, "v5p": 95.0, "v6e": 32.0}
# Per chip: bf16 dense FLOP/s and HBM bytes/s (Cloud TPU documentation), for the estimates in bench/.
PEAKS = {"v4": (275e12, 1228e9), "v5e": (197e12, 819e9), "v5p": (459e12, 2765e9), "v6e": (918e12, 1640e9)}


@dataclasses.dataclass
class ProgramMemory:
  name: str
  argument_gb: float
  output_gb: float
  alias_gb: float
  temp_gb: float
  resident_gb: float  # on the chip during the program, not among its arguments
  compile_s: float
  devices: int
  kernels: tuple = ()  # the Mosaic (Pallas TPU) kernels the program calls, e.g. 'splash_mha_fwd_segmented_residuals'
  collective_gb: float = 0.0  # result bytes of its collectives on one chip per call, loop trip counts included
  collectives: dict = dataclasses.field(default_factory=dict)  # kind -> GB per chip per call
  copy_gb: float = 0.0  # bytes of copies of buffers >= 64 MB per call (relayouts of a KV pool, say): should be ~0
  hbm_gb: float = 0.0  # HBM bytes one call reads and writes on one chip (an estimate: _hlo.hbm_bytes)
  flops: float = 0.0  # XLA's cost analysis FLOPs of one call on one chip (loop bodies counted once)
  large_copies: tuple = ()  # (array type, executions per call) of those copies

  @property
  def attention(self) -> str:
    """'splash' where the program calls splash-attention kernels, other Mosaic kernels by name, else 'xla'."""
    kinds = {
      "splash" if k.startswith("splash_") else "paged_attention" if k.startswith("paged_") else k for k in self.kernels
    }
    return ", ".join(sorted(kinds)) or "xla"

  @property
  def peak_gb(self) -> float:
    return self.argument_gb + self.output_gb - self.alias_gb + self.temp_gb + self.resident_gb


def topology_devices(topology: str):
  """The chips of a TPU slice named like 'v5p:4x4x2' or 'v6e:8x8' (needs libtpu; no TPU needed)."""
  from aepo_jax.parallel import topology_devices as describe

  try:
    return describe(topology)
  except ValueError as e:
    raise RuntimeError(
      f"cannot describe TPU topology {topology!r} ({e.__cause__!r}). Compiling for TPU needs libtpu "
      "(pip install -e \".[tpu]\", the jax[tpu] of the installed jax) and a name such as v5p:4x4x2, v6e:8x8, "
      "v5e:4x4 or v4:2x2x2."
    ) from e


def host_devices(topology: str, devices) -> list:
  """The chips of one host of the slice, as a slice of their own (`v6e:2x2` for a v6e:8x8 host): the engine's
  programs run on one host's chips, and XLA:TPU compiles a program for device ids 0..n-1 of a topology."""
  first = [d for d in devices if d.process_index == devices[0].process_index]
  coords = np.asarray([d.coords for d in first])
  extent = coords.max(0) - coords.min(0) + 1
  dims = len(topology.split(":")[1].split("x"))
  name = topology.split(":")[0] + ":" + "x".join(str(int(e)) for e in extent[:dims])
  host = topology_devices(name)
  if len(host) != len(first):
    raise RuntimeError(f"{topology}: a host has {len(first)} chips but topology {name} has {len(host)}.")
  return host


def hbm_gb(topology: str) -> float:
  gen = topology.split(":")[0].lower()
  if gen not in HBM_GB:
    raise ValueError(f"no HBM size known for {gen!r}; known: {sorted(HBM_GB)}.")
  return HBM_GB[gen]


def _per_chip_gb(tree) -> float:
  """Bytes per chip of ShapeDtypeStructs with NamedShardings (the largest chip, replicated leaves counted whole)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += int(np.prod(shard)) * jnp.dtype(x.dtype).itemsize
  return total / GB


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def mosaic_kernels(lowered) -> tuple:
  """Names of the Mosaic (Pallas TPU) kernels a lowered program calls: each is a `tpu_custom_call` with a
  `kernel_name` attribute (the name the Pallas call gave it). Read before compiling, so a refused program has them."""
  return tuple(sorted(set(re.findall(r'kernel_name = "([^"]+)"', lowered.as_text()))))


def _memory(name, lowered, resident_gb, devices, args_gb: float, hlo_dir: str = "") -> ProgramMemory:
  """Compiles `lowered` and reads its per-chip memory, collectives and large copies (aepo_jax/train/_hlo.py; with
  `hlo_dir` the compiled text goes to <hlo_dir>/<name>.txt). XLA:TPU refuses to compile a program whose temporaries
  exceed the chip's HBM (RESOURCE_EXHAUSTED): that program is reported with the temporaries XLA asked for."""
  from aepo_jax.train import _hlo

  kernels = mosaic_kernels(lowered)
  t0 = time.perf_counter()
  try:
    compiled = lowered.compile()
    m = compiled.memory_analysis()
  except Exception as e:  # noqa: BLE001 - only an out-of-memory refusal is a result; anything else is raised
    need = re.search(r"HLO temporaries \(([\d.]+)([KMGT])\)", str(e))
    if "RESOURCE_EXHAUSTED" not in str(e) or not need:
      raise
    temp = float(need.group(1)) * {"K": 1e-6, "M": 1e-3, "G": 1.0, "T": 1e3}[need.group(2)] * 2**30 / GB
    log.warning("%s: XLA:TPU refused to compile it: %s", name, str(e).splitlines()[0][:300])
    return ProgramMemory(name, args_gb, 0.0, 0.0, temp, resident_gb, time.perf_counter() - t0, devices, kernels)
  seconds = time.perf_counter() - t0
  text = compiled.as_text()
  if hlo_dir:
    import os

    os.makedirs(hlo_dir, exist_ok=True)
    with open(os.path.join(hlo_dir, f"{name}.txt"), "w") as f:
      f.write(text)
  coll = {k: v.bytes / GB for k, v in _hlo.collectives(text).items() if v.bytes}
  large = _hlo.large_copies(text, 64 * 2**20)
  copies = sum(_hlo._bytes(shape) * n for shape, n in large) / GB
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
  return ProgramMemory(
    name,
    m.argument_size_in_bytes / GB,
    m.output_size_in_bytes / GB,
    m.alias_size_in_bytes / GB,
    m.temp_size_in_bytes / GB,
    resident_gb,
    seconds,
    devices,
    kernels,
    sum(coll.values()),
    coll,
    copies,
    _hlo.hbm_bytes(text) / GB,
    float(cost.get("flops", 0.0)),
    tuple((shape.split("{")[0], n) for shape, n in large),
  )


def _memory_of_parts(name, parts, resident_gb, devices, args_gb: float, hlo_dir: str = "") -> ProgramMemory:
  """One program's memory from the programs it runs one after another (the weight copy's per-leaf reshards): every
  part's arguments and outputs live at once (the outputs accumulate), the temporaries of the largest part on top;
  bytes moved, collectives and compile time summed."""
  mems = [_memory(f"{name}_{i}" if hlo_dir else name, p, 0.0, devices, 0.0, hlo_dir) for i, p in enumerate(parts)]
  coll: dict = {}
  for m in mems:
    for kind, gb in m.collectives.items():
      coll[kind] = coll.get(kind, 0.0) + gb
  return ProgramMemory(
    name,
    sum(m.argument_gb for m in mems) or args_gb,
    sum(m.output_gb for m in mems),
    sum(m.alias_gb for m in mems),
    max(m.temp_gb for m in mems),
    resident_gb,
    sum(m.compile_s for m in mems),
    devices,
    tuple(sorted({k for m in mems for k in m.kernels})),
    sum(coll.values()),
    coll,
    sum(m.copy_gb for m in mems),
    sum(m.hbm_gb for m in mems),
    sum(m.flops for m in mems),
    tuple(c for m in mems for c in m.large_copies),
  )


ALL_PROGRAMS = ("sft", "update", "logprob", "weight_cast", "weight_copy", "prefill", "decode", "decode_compact")
_ROLLOUT_PROGRAMS = ("weight_cast", "weight_copy", "prefill", "decode", "decode_compact")


def run_programs(config) -> tuple:
  """The programs `config`'s run compiles: SFT's step where it runs the SFT phase (config.mode sft or both, with
  sft.enabled, as the trainer decides), the RL step's where it runs RL (the compact decode where the engine
  compacts: checked once the engine is built)."""
  out = ("sft",) if config.mode in ("sft", "both") and config.sft.enabled and config.sft.steps > 0 else ()
  if config.mode in ("rl", "both"):
    out += ("update", "logprob") + _ROLLOUT_PROGRAMS
  return out


def compile_plan(config, topology: str, *, programs=None, hlo_dir: str = "", headroom: float = 0.05) -> dict:
  """Compiles `config`'s programs (default: `run_programs(config)`; any of ALL_PROGRAMS) for `topology`; returns
  the report (see `_compile_report.report_json`)."""
  from aepo_jax import model as model_lib
  from aepo_jax.parallel import local_mesh, lower_host_copy, make_mesh
  from aepo_jax.train import _config, _logprob, _objective, _rl, _sft, _step

  default = programs is None
  programs = tuple(run_programs(config) if default else programs)
  unknown = sorted(set(programs) - set(ALL_PROGRAMS))
  if unknown:
    raise ValueError(f"unknown programs {unknown}: choose from {', '.join(ALL_PROGRAMS)}.")
  devices = topology_devices(topology)
  mesh = make_mesh(_config.mesh_shape(config.mesh, len(devices)), devices)
  r, t, a = config.rollout, config.train, config.algo
  model_cfg = model_config(config)
  seq_len = r.max_prompt_len + r.max_response_len
  # The RL phase's optimizer, exactly (its schedule's length does not change the compiled program's shape).
  optimizer = _rl.make_optimizer(config, max(int(t.steps), 1))
  rules = _config.mesh_rules(config)  # expert parallelism (mesh.expert_axis), as the trainer places the weights
  p_sh = model_lib.param_shardings(model_cfg, mesh, rules)
  o_sh = _step.opt_state_shardings(model_cfg, optimizer, mesh, rules)
  params = _abstract(model_lib.param_shapes(model_cfg), p_sh)
  opt_state = _abstract(jax.eval_shape(optimizer.init, model_lib.param_shapes(model_cfg)), o_sh)
  with_ref = a.kl.coef > 0 or a.kl.use_in_reward
  params_gb, opt_gb = _per_chip_gb(params), _per_chip_gb(opt_state)
  ref_gb = params_gb if with_ref else 0.0
  out = {
    "topology": topology,
    "chips": len(devices),
    "hbm_gb": hbm_gb(topology),
    "mesh": dict(mesh.shape),
    "programs": {},
    "params_gb": params_gb,
    "opt_state_gb": opt_gb,
  }
  mb_per_update = t.ppo_mini_batch_size * r.n // t.micro_batch_size
  from aepo_jax.train._batch import batch_sharding

  b_sh = batch_sharding(mesh)

  # routes (routing replay): the experts of each token in each sparse layer, [k, rows, length, L_sparse, top-k]
  routes_axes = (sum(model_cfg.moe_layers), model_cfg.num_experts_per_tok)

  def batch(k, keys, rows=t.micro_batch_size, length=seq_len):
    return {
      name: jax.ShapeDtypeStruct(
        (k, rows, length) + (routes_axes if name == "routes" else ()),
        jnp.int32 if name in ("tokens", "attention_mask", "loss_mask", "segment_ids", "routes") else jnp.float32,
        sharding=b_sh,
      )
      for name in keys
    }

  if "sft" in programs:
    s = config.sft
    sft_opt = _sft.optimizer(config)
    step, micro = _sft.make_step(config, model_cfg, sft_opt, mesh)
    sft_state = _abstract(jax.eval_shape(sft_opt.init, model_lib.param_shapes(model_cfg)), o_sh)
    keys = ["tokens", "attention_mask", "loss_mask"] + (["segment_ids"] if s.packed_rows else [])
    b = batch(micro, keys, rows=s.micro_batch_size, length=s.max_len)
    out["programs"]["sft"] = _memory(
      "sft", step.lower(params, sft_state, b), 0.0, len(devices), params_gb + opt_gb + _per_chip_gb(b), hlo_dir
    )

  if "update" in programs:
    step = _objective.make_rl_update_step(config, model_cfg, optimizer, mesh)
    b = batch(mb_per_update, _objective.update_batch_keys(config))
    out["programs"]["update"] = _memory(
      "update", step.lower(params, opt_state, b), ref_gb, len(devices), params_gb + opt_gb + _per_chip_gb(b), hlo_dir
    )

  if "logprob" in programs:
    replay = a.routing_replay == "rollout"
    fn = _logprob.make_logprob_fn(model_cfg, mesh, rules, temperature=r.temperature, with_routes=replay)
    rows = config.data.prompts_per_step * r.n
    k = -(-rows // (t.micro_batch_size * mb_per_update)) * mb_per_update
    b = batch(k, ["tokens", "attention_mask"] + (["routes"] if replay else []))
    out["programs"]["logprob"] = _memory(
      "logprob",
      fn.lower(params, b["tokens"], b["attention_mask"], *([b["routes"]] if replay else [])),
      opt_gb + ref_gb,
      len(devices),
      params_gb + _per_chip_gb(b),
      hlo_dir,
    )

  engine = None
  if any(p in programs for p in _ROLLOUT_PROGRAMS):
    host = host_devices(topology, devices)
    rmesh = local_mesh({k: int(v) for k, v in r.mesh.items()}, host)
    hosts = len({d.process_index for d in devices})
    engine, stop_source = rollout_engine(config, model_cfg, rmesh, hosts)
    engine_cfg = engine.config
    slots = engine.max_slots
    weights = _abstract(model_lib.param_shapes(engine_cfg), model_lib.param_shardings(engine_cfg, rmesh))
    resident = params_gb + opt_gb + ref_gb  # the training state stays on the chips during rollouts
    state = engine.abstract_decode_state()
    out["rollout"] = {
      "host_chips": len(host),
      "hosts": hosts,
      "slots": slots,
      "compact_slots": engine.compact_slots,
      "max_len": seq_len,
      "weights_gb": _per_chip_gb(weights),
      "kv_cache_gb": _per_chip_gb(state.cache),
      "kv_layout": engine.kv_layout,
      "kv_tokens": (engine.num_pages - 1) * engine.page_size if engine.page_size else slots * seq_len,
      "stop_sequences": stop_source,
      "decode_steps": 1 if engine.page_size else int(r.decode_chunk),  # per decode call (paged: one)
      "kv_pool_shape": list(jax.tree.leaves(state.cache)[0].shape),  # one layer's
    }
    state_gb = _per_chip_gb(weights) + _per_chip_gb(state)
    if "weight_cast" in programs or "weight_copy" in programs:
      # The run's copy (Rollouts.weights -> parallel.to_host_local) onto every host's rollout devices; the target
      # is given as host 0's rollout mesh over its chips of the slice (the engine's programs use a host topology).
      first = [d for d in devices if d.process_index == devices[0].process_index]
      host0 = local_mesh({k: int(v) for k, v in r.mesh.items()}, first)
      lowered = lower_host_copy(params, model_lib.param_shardings(engine_cfg, host0), engine_cfg.param_dtype, devices)
      if "weight_cast" in programs and "cast" in lowered:
        out["programs"]["weight_cast"] = _memory(
          "weight_cast", lowered["cast"], opt_gb + ref_gb, len(devices), params_gb, hlo_dir
        )
      if "weight_copy" in programs:
        out["programs"]["weight_copy"] = _memory_of_parts(
          "weight_copy", lowered["move"], resident, len(devices), params_gb, hlo_dir
        )
    if "prefill" in programs:
      out["programs"]["prefill"] = _memory(
        "prefill", engine.lower_fill(weights), resident, len(host), state_gb, hlo_dir
      )
    if "decode" in programs:
      out["programs"]["decode"] = _memory(
        "decode", engine.lower_decode(weights, r.decode_chunk), resident, len(host), state_gb, hlo_dir
      )
    if "decode_compact" in programs and (engine.compact_slots or not default):
      out["programs"]["decode_compact"] = _memory(
        "decode_compact",
        engine.lower_decode(weights, r.decode_chunk, compact=True),
        resident,
        len(host),
        state_gb,
        hlo_dir,
      )
  if "decode" in out["programs"]:  # what a decode step must move at least: the weights and the KV pool, once each
    ro = out["rollout"]
    ro["decode_bound_gb"] = ro["weights_gb"] + ro["kv_cache_gb"]
    ro["decode_hbm_ratio"] = out["programs"]["decode"].hbm_gb / ro["decode_steps"] / ro["decode_bound_gb"]
  out["headroom"] = headroom
  out["usable_gb"] = out["hbm_gb"] * (1.0 - headroom)  # what a program may take: HBM less a margin for the runtime
  out["fits"] = all(p.peak_gb <= out["usable_gb"] for p in out["programs"].values())
  out["shardings"] = {
    "params": _describe(p_sh),
    "kv_cache": str(jax.tree.leaves(engine.abstract_decode_state().cache)[0].sharding.spec) if engine else "",
  }
  return out


def rollout_engine(config, model_cfg, mesh, hosts: int):
  """(engine, where its stop sequences came from): the trainer's rollout engine of `config`, built through the same
  `rollout_settings` and `aepo_jax.rollout.build_engine` as the run's, on `mesh` (one host's devices of `hosts`).

  The stop sequences are the tool tags' token ids when the model's tokenizer is on this machine (model.name a local
  HF directory, or model.tokenizer one); otherwise (a gs:// or hub checkpoint: nothing is read) placeholders of 3 tokens per tag, the length
  of `</python>` in the Qwen and Llama tokenizers: the compiled program depends only on their number and length."""
  import os

  from aepo_jax import model as model_lib
  from aepo_jax import rollout as rollout_lib
  from aepo_jax.train import _wiring

  settings = _wiring.rollout_settings(config, hosts=hosts)
  tags = _wiring.tool_tags(config)
  for path in (str(config.model.tokenizer), str(config.model.name)):
    if path and os.path.isfile(os.path.join(path, "tokenizer.json")):
      tokenizer = model_lib.Tokenizer.from_dir(path)
      return rollout_lib.build_engine(model_cfg, tokenizer, settings, tool_tags=tags, mesh=mesh), "tokenizer"
  stops = [[1, 2, 3 + i] for i in range(len(tags))]
  return rollout_lib.build_engine(model_cfg, None, settings, mesh=mesh, stop_sequences=stops), "placeholder"


def model_config(config):
  """The ModelConfig of `config.model` from shapes alone: model.shape (a preset), a preset name, or the config.json
  of a local HF directory; a gs:// checkpoint needs model.shape (no network is used)."""
  import os

  from aepo_jax import model as model_lib

  mc = config.model
  kw = dict(dtype=mc.dtype, param_dtype=mc.param_dtype, remat=mc.remat, **dict(mc.overrides))
  name = mc.shape or mc.name
  if name in model_lib.PRESETS:
    return model_lib.preset(name, **kw)
  if os.path.isfile(os.path.join(str(name), "config.json")):
    return model_lib.read_hf_config(name, mc.param_dtype).replace(**kw)
  raise ValueError(
    f"model.name={mc.name!r} gives no shape to compile: set --config.model.shape to the preset with the "
    f"checkpoint's architecture (one of {sorted(model_lib.PRESETS)}), or point model.name at a local HF "
    "directory with a config.json."
  )


def _describe(shardings) -> dict:
  flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
  return {"/".join(str(getattr(k, "key", k)) for k in path): str(s.spec) for path, s in flat}
