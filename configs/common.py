"""Settings shared by the experiment configs: the official ARPO/AEPO script values (spec §1.7, §2.4), each paper's
method switches, the released-run preset (spec §2.6) and the cold-start SFT of both papers.

Not an experiment itself. Each configs/*.py loads it with `common = load_sibling(__file__, "common")`
(`aepo_jax.train.load_sibling`) and then states what it changes, so the values of a run stay readable in its own
file. Variants are chosen after the file name, comma separated: `--config=configs/aepo_gaia.py:released,cold_start`.
  paper       (default) the paper's full method; our corrected rollout quirks and one global token-mean
  released    what the released scripts ran (`released` below)
  cold_start  start from the base model: the cold-start SFT on chat traces (sft.source), then RL
  calls3      deep search with the tool-call limit of the ARPO yaml uploaded with the paper (3); the presets follow
              the later "fix tool call limit" commit (6) of the official repository (spec §1.7)
"""

from aepo_jax.train import base_config

VARIANTS = ("paper", "released", "cold_start", "calls3")
SFT_TRACES = "gs://YOUR_BUCKET/data/ARPO-SFT-54K.jsonl"  # ARPO-SFT-54K as JSONL (or Parquet), sharegpt or alpaca
SFT_EXAMPLES = 54_000


def variants(arg, config_file: str, models=None, extra=()):
  """Parses 'released,cold_start' (and, with `models`, one model name among them; with `extra`, the config's own
  switches) into a dict of flags."""
  parts = [p.strip() for p in str(arg or "paper").split(",") if p.strip()]
  known = VARIANTS + tuple(extra) + tuple(models or ())
  bad = [p for p in parts if p not in known]
  if bad:
    raise ValueError(
      f"{config_file}:{arg}: unknown variant {bad[0]!r}; use a comma-separated subset of {known} "
      "(e.g. ':released' or ':released,cold_start')."
    )
  chosen = [p for p in parts if p in tuple(models or ())]
  if len(chosen) > 1:
    raise ValueError(f"{config_file}:{arg}: name one model of {tuple(models)}, not {chosen}.")
  out = {v: v in parts for v in VARIANTS + tuple(extra)}
  out["model"] = chosen[0] if chosen else None
  return out


def _run(
  c,
  *,
  shape: str,
  checkpoint: str,
  prompts: int,
  mini: int,
  n: int,
  n0: int,
  prompt_len: int,
  response_len: int,
  call_limit: int,
  epochs: int,
  micro: int,
  mesh=(1, -1, 4),
):
  """The values every ARPO/AEPO script shares (ppo_trainer*.yaml, spec §1.5, §1.7) plus the run's own."""
  c.model.name = checkpoint
  c.model.shape = shape  # the checkpoint's architecture, for launch/compile.py
  c.model.init = "pretrained"
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "float32"
  c.model.remat = True
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  c.data.template = "code_search"
  c.data.prompts_per_step = prompts  # train_batch_size
  c.tools.names = ("python", "search")
  c.tools.search_backend = "replay"  # ARPO's search_cache.json; 'retrieval' + tools.search_url for a live server
  c.tools.call_limit = call_limit
  c.tools.retry_count = 4  # AEPO yaml; ARPO's scripts use 3 (`arpo` below)
  c.tools.python_timeout = 120.0
  c.rollout.n = n
  c.rollout.initial_rollouts = n0
  c.rollout.beam_size = 2
  c.rollout.branch_probability = 0.5
  c.rollout.entropy_weight = 0.2
  # The code's step entropy (top-10 sum / ln|V|): w = 0.2 was set on this scale. The paper's 'exact' is an option.
  c.rollout.entropy_estimator = "official"
  c.rollout.max_prompt_len = prompt_len
  c.rollout.max_response_len = response_len
  c.rollout.temperature, c.rollout.top_p, c.rollout.top_k = 1.0, 1.0, 0
  c.rollout.repetition_penalty, c.rollout.min_p = 1.0, 0.0  # vLLM defaults in training
  c.reward.name = "deep_research"
  c.algo.advantage = "grpo"
  c.algo.clip_low, c.algo.clip_high, c.algo.clip_c = 0.2, 0.2, 3.0
  c.algo.agg = "token-mean"
  c.algo.kl.name, c.algo.kl.coef, c.algo.kl.use_in_reward = "low_var_kl", 0.0, False  # effectively no KL (§1.5)
  c.optim.lr = 1e-6
  c.optim.weight_decay = 0.01
  c.optim.grad_clip = 1.0
  c.optim.schedule = "constant"
  c.optim.warmup_steps = 0
  c.train.epochs = epochs
  c.train.steps = 0  # derived: epochs x ceil(train prompts / prompts_per_step)
  c.train.ppo_mini_batch_size = mini  # prompts -> prompts / mini optimizer steps per rollout step (8 in all scripts)
  c.train.micro_batch_size = micro  # sequences; a multiple of data*fsdp
  c.train.ppo_epochs = 1
  c.train.eval_every = 5
  c.eval.temperature = 0.0  # validation: greedy, n = 1
  c.eval.protocol = "official"  # validation scored as the official evaluator does (aepo_jax.eval._scoring)
  c.checkpoint.every_steps = 5
  c.checkpoint.best_metric = "eval/accuracy"
  _sft(c)
  return c


def _sft(c):
  """The cold-start SFT of both papers (spec §2.4: LLaMA-Factory, full fine-tuning on ARPO-SFT-54K, lr 7e-6,
  3 epochs, cosine, warm-up 0.1, cutoff 15,000). Off by default: the released runs start from its checkpoint
  (model.name); the `cold_start` variant runs it first. Here 64 traces per step, packed into 32 rows of 15,000
  tokens, tool results inside assistant turns without loss (as in RL); the `released` variant runs the released
  recipe instead (`released_sft`: 16 per step, unpacked, results trained)."""
  c.sft.enabled = False
  c.sft.source = SFT_TRACES
  c.sft.max_len = 15_000  # LLaMA-Factory cutoff_len
  c.sft.lr = 7e-6
  c.sft.schedule = "cosine"
  c.sft.warmup_frac = 0.1
  c.sft.batch_size = 64
  c.sft.packed_rows = 32
  c.sft.micro_batch_size = 16
  c.sft.steps = 3 * -(-SFT_EXAMPLES // c.sft.batch_size)  # 3 epochs


def deep_search_14b():
  """Qwen3-14B deep search: AEPO_Qwen3_14B_DeepResearch.sh / ARPO_14b_Deepsearch_1node.sh (ppo_trainer_dr.yaml)."""
  c = _run(
    base_config(),
    shape="qwen3-14b",
    checkpoint="gs://YOUR_BUCKET/models/Qwen3-14B-SFT",
    prompts=64,
    mini=8,
    n=12,
    n0=6,
    prompt_len=2000,
    response_len=6192,
    call_limit=6,
    epochs=5,
    micro=16,
  )
  c.data.train = "hard_search_1k"  # 1,071 prompts
  c.data.val = ("gaia_test", "hle_test")  # 103 + 100
  # The paged KV pool per host (4 chips): 393,216 tokens, 16.1 GB per chip, whatever the response length, so
  # 20,480-token trajectories fit a v6e host (32 GB) beside the weights; slots that run short of pages wait or are
  # preempted (the agent loop). 4 rows per prefill call bound its attention window (20,480 tokens) to ~2.5 GB.
  c.rollout.kv_tokens = 393_216
  c.rollout.prefill_rows = 4
  return c


def deep_search_8b():
  """Qwen3-8B deep search: ARPO_8B_Deepsearch_1node.sh (ppo_trainer_dr.yaml): batch 128, n = 16, L = 10,000."""
  c = _run(
    base_config(),
    shape="qwen3-8b",
    checkpoint="gs://YOUR_BUCKET/models/Qwen3-8B-SFT",
    prompts=128,
    mini=16,
    n=16,
    n0=8,
    prompt_len=2000,
    response_len=10_000,
    call_limit=6,
    epochs=5,
    micro=16,
  )
  c.data.train = "hard_search_1k"
  c.data.val = ("gaia_test", "hle_test")
  # 16 prompts x 16 trajectories per host of a v5p-64 would need 113 GB of KV cache per chip at 12,000 tokens:
  # 128 slots at a time (the agent loop queues the rest).
  c.rollout.max_slots = 128
  return c


def deep_search_qwq32b():
  """QwQ-32B deep search (AEPO / ARPO README release). No script for it was released: the 14B deep-search
  script's values are used."""
  c = deep_search_14b()
  c.model.name = "gs://YOUR_BUCKET/models/QwQ-32B-SFT"
  c.model.shape = "qwq-32b"
  # 96 trajectories per host of a v5p-64 would need 52 GB of KV cache per chip beside 16 GB of bf16 weights and
  # the training state: 48 slots at a time (the agent loop queues the rest).
  c.rollout.max_slots = 48
  return c


REASONING_MODELS = {  # ARPO trains these on the reasoning setting; the released script is the 7B one
  "qwen2.5-3b": "gs://YOUR_BUCKET/models/Qwen2.5-3B-Instruct",
  "qwen2.5-7b": "gs://YOUR_BUCKET/models/Qwen2.5-7B-Instruct",
  "llama-3.1-8b": "gs://YOUR_BUCKET/models/Llama-3.1-8B-Instruct",
}


def reasoning(model: str = "qwen2.5-7b"):
  """Reasoning + knowledge QA: ARPO_7B_Reasoning_1node.sh / AEPO_Qwen25_7B_DeepResearch.sh (ppo_trainer.yaml)."""
  c = _run(
    base_config(),
    shape=model,
    checkpoint=REASONING_MODELS[model],
    prompts=128,
    mini=16,
    n=16,
    n0=8,
    prompt_len=1536,
    response_len=4096,
    call_limit=3,
    epochs=2,
    micro=16,
  )
  c.data.train = "train_10k"  # 5k math + 5k QA
  c.data.val = ("valid",)  # 180
  if model == "qwen2.5-3b":
    # 2 KV heads do not split over 4 chips: with tensor 4 every chip holds the whole cache (prefill over 95 GB).
    # Tensor 2, and the rollout's slots over the other 2 chips of a host.
    c.mesh.tensor = 2
    c.rollout.mesh.data, c.rollout.mesh.fsdp, c.rollout.mesh.tensor = 2, 1, 2
  return c


def arpo(c):
  """ARPO (spec §1, §3.7): GRPO advantage + dual-clip PPO, entropy-based adaptive branching."""
  c.rollout.policy = "arpo"
  c.rollout.enable_dynamic_rollouts = False  # AEPO's; ARPO has no pre-monitoring
  c.tools.retry_count = 3
  c.algo.loss = "arpo"  # = dual-clip PPO
  c.algo.entropy_advantage_coef = 0.0
  c.algo.preserve_high_clip_grad = False
  return c


def aepo(c):
  """AEPO's full method (spec §2): pre-monitoring, penalised branching, stop-gradient high clip, entropy-aware
  advantage."""
  c.rollout.policy = "aepo"
  c.rollout.consecutive_penalty = 0.05  # P̂(l) = 0.05·l, hard-coded in the official code (spec §2.1)
  c.rollout.premonitor_beta = 0.5  # β, hard-coded (spec §2.1)
  c.rollout.probe_tokens = 50
  c.rollout.penalize_refills = True
  c.rollout.enable_dynamic_rollouts = True
  c.algo.loss = "aepo"
  c.algo.preserve_high_clip_grad = True  # stop-gradient high clip (spec §2.2)
  c.algo.entropy_advantage_coef = 0.2  # entropy-aware advantage (spec §2.3)
  return c


def released(c):
  """What the released scripts ran (spec §1.2 quirks, §1.5, §2.6): the official rollout quirks (Q1's never-cleared
  initial-entropy table, the branch decision on the segment that ended with the call), the top-10 entropy, no
  pre-monitoring (ENABLE_DYNAMIC_ROLLOUTS=False: m = initial_rollouts), no entropy-aware advantage (the actor never
  passed the entropy: entropy_coeff=0) and verl's token-balanced micro-batches with their loss weighting
  (use_dynamic_bsz); and, for the
  `cold_start` variant, the released LLaMA-Factory recipe (`released_sft`)."""
  released_sft(c)
  c.rollout.mode = "faithful"
  c.rollout.entropy_estimator = "official"
  c.rollout.enable_dynamic_rollouts = False
  c.algo.entropy_advantage_coef = 0.0
  c.algo.aggregation = "verl"
  c.algo.verl_dynamic_bsz = True  # use_dynamic_bsz=True, ppo_max_token_len_per_gpu = 2 x (prompt + response), 8 GPUs
  return c


def released_sft(c):
  """The cold-start SFT as the released LLaMA-Factory recipe runs it: 1 example per device x gradient
  accumulation 2 x 8 GPUs = 16 examples per optimizer step, unpacked, 3 epochs; observation turns masked and the
  `<result>` spans inside assistant turns trained (sft.mask_results=False). 16 rows per micro-batch split over a
  mesh whose data x fsdp divides 16 (v5p-64: fsdp 16); on a larger data x fsdp raise sft.batch_size and
  sft.micro_batch_size to it."""
  c.sft.batch_size = 16
  c.sft.micro_batch_size = 16
  c.sft.packed_rows = 0
  c.sft.mask_results = False
  c.sft.steps = 3 * -(-SFT_EXAMPLES // c.sft.batch_size)  # 3 epochs
  return c


def cold_start(c, base_checkpoint: str):
  """Start from the base model: the cold-start SFT on sft.source first, then RL from its final parameters."""
  c.model.name = base_checkpoint
  c.mode = "both"
  c.sft.enabled = True
  return c


def apply(c, v: dict, base_checkpoint: str):
  """The chosen variants (`variants`) on a paper config."""
  if v["released"]:
    released(c)
  if v["cold_start"]:
    cold_start(c, base_checkpoint)
  if v["calls3"]:
    c.tools.call_limit = 3  # the deep-search yaml as uploaded with the ARPO paper
  return c


DEEP_SEARCH_MODELS = {  # deep search: the setting of each model's released script, and its base model
  "qwen3-14b": "gs://YOUR_BUCKET/models/Qwen3-14B",
  "qwen3-8b": "gs://YOUR_BUCKET/models/Qwen3-8B",
  "qwq-32b": "gs://YOUR_BUCKET/models/QwQ-32B",
}


def deep_search(model: str = "qwen3-14b"):
  """The deep-search setting of `model` (a key of DEEP_SEARCH_MODELS)."""
  return {"qwen3-14b": deep_search_14b, "qwen3-8b": deep_search_8b, "qwq-32b": deep_search_qwq32b}[model]()


def baseline(c, loss: str, clip_low: float, clip_high: float, clip_c: float):
  """A baseline of the papers' comparisons (spec §3) on the setting `c`: plain group sampling (policy 'none', all n
  samples global, as the baselines have no branching), the given loss and clip values, no AEPO-specific terms. How
  the authors ran the baselines is unknown (spec §3): the values are the original papers' or upstream verl's."""
  c.rollout.policy = "none"
  c.rollout.initial_rollouts = c.rollout.n
  c.rollout.enable_dynamic_rollouts = False
  c.algo.loss = loss
  c.algo.entropy_advantage_coef = 0.0
  c.algo.preserve_high_clip_grad = False
  c.algo.clip_low, c.algo.clip_high, c.algo.clip_c = clip_low, clip_high, clip_c
  return c


def baseline_14b(loss: str, clip_low: float, clip_high: float, clip_c: float):
  """`baseline` on the 14B deep-search setting (AEPO's comparison)."""
  return baseline(deep_search_14b(), loss, clip_low, clip_high, clip_c)


def baseline_config(arg, config_file: str, setting: str, make):
  """A baseline experiment: `make(c)` (the baseline's loss settings) on the chosen model of `setting` ('deep_search':
  qwen3-14b (default), qwen3-8b, qwq-32b; 'reasoning': qwen2.5-7b (default), qwen2.5-3b, llama-3.1-8b), with the
  variants of the paper configs (`released`, `cold_start`, `calls3`)."""
  models = DEEP_SEARCH_MODELS if setting == "deep_search" else REASONING_MODELS
  v = variants(arg, config_file, models=models)
  model = v["model"] or ("qwen3-14b" if setting == "deep_search" else "qwen2.5-7b")
  c = deep_search(model) if setting == "deep_search" else reasoning(model)
  return apply(make(c), v, models[model])


def grpo(c):
  """GRPO (spec §3.1): group-normalised advantage (unbiased std), clipped surrogate ε = 0.2 with verl's dual clip
  c = 3, no KL (the ARPO fork's β = 0), token-mean."""
  baseline(c, "grpo", 0.2, 0.2, 3.0)  # verl adds the dual clip
  c.algo.advantage = "grpo"
  return c


def dapo(c):
  """DAPO (spec §3.2): clip-higher (ε_low 0.2, ε_high 0.28; verl recipe c = 10), dynamic sampling (groups whose
  accuracy is all 0 or all 1 are dropped and generation continues, up to 10 batches), overlong shaping with verl's
  test-script buffer of 512 tokens (the paper: 4,096 of 20,480), token-level mean, no KL."""
  baseline(c, "dapo", 0.2, 0.28, 10.0)  # clip-higher; verl recipe c = 10
  c.algo.filter_groups = True  # dynamic sampling: drop all-0 / all-1 groups
  c.algo.max_num_gen_batches = 10
  c.algo.overlong_buffer = 512  # verl test script buffer; the paper uses 4096 of 20480
  c.algo.overlong_factor = 1.0
  return c


def reinforce_pp(c):
  """REINFORCE++-baseline (spec §3.4): R minus the group mean, whitened over the batch's valid tokens; PPO clip 0.2;
  the KL enters the reward (k1, verl's default coefficient 0.001). Which variant and β the papers ran is unknown."""
  baseline(c, "ppo", 0.2, 0.2, 0.0)
  c.algo.advantage = "reinforce_pp_baseline"  # group-mean baseline + global whitening; variant unknown (§3.4)
  c.algo.kl.name, c.algo.kl.coef, c.algo.kl.use_in_reward = "k1", 0.001, True  # verl default kl_coef
  return c
