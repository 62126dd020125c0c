"""A training config as the rollout part's settings: the run's tools (`make_toolset`), its rollout policy and
`aepo_jax.rollout.RolloutSettings` (`rollout_settings`, the one conversion the trainer, its validation and
launch/compile.py share), and this host's `Rollout` over `aepo_jax.rollout.Rollouts`. Parts are imported lazily:
an SFT-only run never imports the rollout engine or the tools."""

from __future__ import annotations

from typing import Optional

import jax

from aepo_jax.train._inputs import _suite, host_share, pad_id


def make_toolset(config, mode: str = "train"):
  """The run's ToolSet (None without tools): `tools.names`, each built by its registered factory from `config.tools`
  (`tools.build_toolset`), after importing the modules of `tools.plugins`; the suite's corpus for a tool that needs
  one and is given none."""
  from aepo_jax import tools as tools_lib
  from aepo_jax.data import arpo_data_root

  tc = config.tools
  return tools_lib.build_toolset(
    tuple(tc.names),
    tc,
    mode=mode,
    context=tools_lib.ToolContext(mode, corpus=lambda: str(_suite(config).corpus_path), data_root=arpo_data_root),
    plugins=tuple(tc.get("plugins", ())),
  )


def policy_config(config):
  """rollout.* -> the rollout part's PolicyConfig (spec §1.7, §2.1)."""
  from aepo_jax.rollout import PolicyConfig

  r = config.rollout
  return PolicyConfig(
    n=r.n,
    initial_rollouts=r.initial_rollouts,
    beam_size=r.beam_size,
    entropy_weight=r.entropy_weight,
    branch_threshold=r.branch_probability,
    entropy_window=r.entropy_window,
    estimator=r.entropy_estimator,
    mode=r.mode,
    penalty_slope=r.consecutive_penalty,
    penalty_counts_refills=r.penalize_refills,
    enable_dynamic_rollouts=r.enable_dynamic_rollouts,
    premonitor_beta=r.premonitor_beta,
    premonitor_formula=r.premonitor_formula,
    probe_tokens=r.probe_tokens,
  )


def tool_tags(config) -> tuple:
  """The call tags of config.tools.names, in the order the agent loop checks them."""
  from aepo_jax import tools as tools_lib

  return tools_lib.call_tags(config.tools.names, plugins=tuple(config.tools.get("plugins", ())))


def rollout_settings(
  config,
  *,
  policy_name: Optional[str] = None,
  temperature: Optional[float] = None,
  n: Optional[int] = None,
  result_mode: str = "train",
  prompts_per_call: Optional[int] = None,
  max_response_len: Optional[int] = None,
  hosts: Optional[int] = None,
  record_routes: Optional[bool] = None,
):
  """config -> `aepo_jax.rollout.RolloutSettings` of this host's rollouts: the one conversion of a training config
  into rollout settings (the trainer, its validation and launch/compile.py use it).

  prompts_per_call: default this host's share of data.prompts_per_step (`hosts` processes: default
  jax.process_count()); the slots are rollout.max_slots, else prompts_per_call x n (at least that many when
  prompts_per_call is given); a training run's partial rollouts (train.max_staleness = k > 0, prompts_per_call
  not given) hold k + 1 steps' groups at once and get k + 1 times the slots. record_routes: default
  algo.routing_replay='rollout' (the engine keeps each token's experts for the update: algo.routing_replay
  'rollout' or 'measure')."""
  import dataclasses

  from aepo_jax import rollout as rollout_lib

  r = config.rollout
  pc = policy_config(config)
  if n is not None:
    pc = dataclasses.replace(pc, n=n, initial_rollouts=min(pc.initial_rollouts, n))
  per_host = prompts_per_call or host_share(config.data.prompts_per_step, process_count=hosts)
  in_flight = 1 + int(config.train.max_staleness) if prompts_per_call is None else 1
  slots = r.max_slots or per_host * pc.n * in_flight
  if prompts_per_call is not None:
    slots = max(slots, per_host * pc.n)
  return rollout_lib.RolloutSettings(
    max_slots=slots,
    max_prompt_len=r.max_prompt_len,
    max_response_len=max_response_len or r.max_response_len,
    sampling=rollout_lib.SamplingParams(
      temperature=r.temperature if temperature is None else temperature,
      top_p=r.top_p,
      top_k=r.top_k,
      min_p=r.min_p,
      repetition_penalty=r.repetition_penalty,
    ),
    policy=policy_name or r.policy,
    policy_config=pc,
    entropy_window=r.entropy_window,
    topk_entropy=r.topk_entropy,
    prefill_chunk=r.prefill_chunk,
    prefill_rows=r.prefill_rows,
    kv_layout=r.kv_layout,
    page_size=r.page_size,
    kv_tokens=r.kv_tokens,
    chunk_steps=r.decode_chunk,
    decode_rows=r.decode_rows,
    tool_results=r.tool_results,
    max_tool_calls=config.tools.call_limit,
    result_mode=result_mode,
    dtype=r.dtype or config.model.dtype,
    record_routes=config.algo.routing_replay != "none" if record_routes is None else record_routes,
  )


def prompt_ids(config, tokenizer, example) -> list:
  from aepo_jax.data import build_messages

  ids = tokenizer.apply_chat_template(build_messages(example, config.data.template), add_generation_prompt=True)
  if len(ids) > config.rollout.max_prompt_len:
    raise ValueError(
      f"a prompt has {len(ids)} tokens > rollout.max_prompt_len={config.rollout.max_prompt_len}; "
      "raise it or shorten the template."
    )
  return ids


class Rollout:
  """This host's rollouts: `aepo_jax.rollout.Rollouts` of `rollout_settings(config, **kw)` on the host's own
  devices (`rollout.mesh` over `jax.local_devices()`), with its own tools, independent of every other host
  (docs/training.md, "On a pod").

    weights = rollout.weights(params)            # the policy copied onto this host's devices, in rollout.dtype;
                                                 # a collective: every host calls it once per RL step / evaluation
    traj = rollout(weights, examples, key)       # host-local: no cross-host collective inside the tool loop
  """

  def __init__(self, config, model_cfg, tokenizer, tools, **settings_kw):
    from aepo_jax import rollout as rollout_lib
    from aepo_jax.parallel import local_mesh

    self.config, self.tokenizer = config, tokenizer
    self.settings = rollout_settings(config, **settings_kw)
    self.prompts_per_call = settings_kw.get("prompts_per_call") or host_share(config.data.prompts_per_step)
    mesh = local_mesh({k: int(v) for k, v in config.rollout.mesh.items()})
    self.rollouts = rollout_lib.Rollouts(
      model_cfg, tokenizer, tools, self.settings, mesh=mesh, pad_id=pad_id(model_cfg, tokenizer)
    )
    self.engine, self.loop, self.policy = self.rollouts.engine, self.rollouts.loop, self.rollouts.policy
    self.partial = None  # PartialRollouts, made on the first carry_over call

  def weights(self, params):
    """The policy on this host's rollout devices (the same arrays when they already are; see to_host_local)."""
    return self.rollouts.weights(params)

  def __call__(self, weights, prompts, key, should_stop=None):
    ids = [prompt_ids(self.config, self.tokenizer, ex) for ex in prompts]
    return self.rollouts(weights, ids, seed=self._seed(key), should_stop=should_stop)

  def _seed(self, key) -> int:
    if jax.process_count() > 1:  # hosts sample independently of each other
      key = jax.random.fold_in(key, jax.process_index())
    return int(jax.random.randint(key, (), 0, 2**31 - 1))

  def carry_over(self, weights, loader, key, *, version: int, should_stop=None):
    """Partial rollouts (train.max_staleness > 0): batches from `loader` (this host's share of a step's prompts
    each) fill the carried-over run up to max_staleness + 1 steps' groups (all of them at the first call, one batch
    after; with train.staleness_ramp one batch more per call until full); returns (trajectories, the examples of
    their groups, metrics) for one batch's worth of complete groups, the oldest first (an interrupted rollout drops
    what is carried)."""
    from aepo_jax import rollout as rollout_lib

    if self.partial is None:
      self.partial = rollout_lib.PartialRollouts(
        self.loop,
        self.policy,
        groups_per_call=self.prompts_per_call,
        max_staleness=self.config.train.max_staleness,
        order=self.config.train.hand_back,
        ramp=self.config.train.staleness_ramp,
        call_floor=self.config.train.call_floor,
      )
    prompts = []
    while len(prompts) < self.partial.wanted():
      prompts += list(next(loader))
    ids = [prompt_ids(self.config, self.tokenizer, ex) for ex in prompts]
    return self.partial(weights, ids, list(prompts), version=version, seed=self._seed(key), should_stop=should_stop)


def make_rollout(config, model_cfg, tokenizer, tools, **kw) -> Rollout:
  """This host's `Rollout` (prompts_per_call / max_response_len default to this host's share of
  data.prompts_per_step and rollout.max_response_len)."""
  return Rollout(config, model_cfg, tokenizer, tools, **kw)


# ---------------------------------------------------------------------------------------------------------
# Metrics of a rollout, and evaluation.
# ---------------------------------------------------------------------------------------------------------
