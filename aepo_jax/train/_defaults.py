"""`base_config()`: every key of the experiment config with its default and what it means."""

from __future__ import annotations

import ml_collections


def base_config() -> ml_collections.ConfigDict:
  """Every key with its default.

  Algorithm constants are those of the released ARPO/AEPO code and scripts (spec §1.7, §2.4; n, N0, batch and
  lengths from the 14B deep-search scripts), with the paper's full AEPO method switched on. Where a default is
  deliberately not the code's, its comment says so: rollout.entropy_estimator ('exact', the paper's entropy),
  rollout.mode ('corrected') and algo.aggregation ('global'). The `:released` presets of configs/ set the code's
  values (configs/common.py `released`); the rollout.* defaults equal `aepo_jax.rollout.PolicyConfig()`'s.
  """
  c = ml_collections.ConfigDict()
  c.workdir = "/tmp/aepo_jax_run"  # local path or gs://bucket/path: checkpoints, metrics, plots, config
  c.mode = "both"  # sft | rl | both (SFT first, then RL from its final parameters)

  # Model: a preset name (random init), 'smollm2-135m-instruct' (load_pretrained), an HF dir, or gs://.
  c.model = ml_collections.ConfigDict()
  c.model.name = "smollm2-135m-instruct"
  # pretrained (load the weights named by `name`) | random (preset shape) | checkpoint (`name` is another run's
  # Orbax checkpoint: a step dir, phase dir or workdir; e.g. RL from an SFT run's final parameters)
  c.model.init = "pretrained"
  c.model.dtype = "float32"  # compute dtype; bfloat16 on TPU, float32 on CPU (XLA's CPU bf16 is slow)
  c.model.param_dtype = "float32"
  c.model.remat = False
  c.model.tokenizer = ""  # '' = the tokenizer that comes with the model
  # The preset whose shape the checkpoint at `name` has (e.g. qwen3-14b for a gs:// Qwen3-14B SFT checkpoint): lets
  # launch/compile.py build the model's programs without reading the checkpoint. '' = read `name` (preset/HF dir).
  c.model.shape = ""
  # ModelConfig field overrides (e.g. num_layers=2 for a tiny test model). Validated against ModelConfig.
  c.model.overrides = ml_collections.ConfigDict()

  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))  # -1 allowed once: the rest
  # Expert parallelism for models with experts (Qwen3-MoE): '' keeps every expert on every device, its hidden units
  # over 'tensor'; 'fsdp' | 'data' | 'data,fsdp' splits the stacked experts whole over those axes, each (token,
  # expert) pair sent to its expert's device by an all-to-all (model/_expert_parallel.py;
  # `_config_checks.mesh_rules`).
  c.mesh.expert_axis = ""

  c.data = ml_collections.ConfigDict()
  # Sources: 'suite' (the generated task suite: its train split; its held-out split in `val`), an ARPO RL
  # file name (hard_search_1k, train_10k, valid, gaia_test, hle_test; $AEPO_ARPO_DATA), a benchmark name (gaia,
  # hle, math500, ...; aepo_jax.data.BENCHMARKS) or a .jsonl / .parquet file, local or gs://, of question/answer
  # records or verl records (docs/data.md). GAIA/HLE never go in `train`.
  c.data.train = "suite"
  c.data.val = ()
  c.data.template = "code_search"
  # Fields of question/answer records in .jsonl / .parquet sources: `answer` holds a string, a number or a list
  # of accepted answers; `system` (optional) a record's own system prompt, used instead of the template's.
  c.data.fields = ml_collections.ConfigDict(dict(question="question", answer="answer", system="system"))
  c.data.family = "qa"  # answers of those records: qa (math equivalence or exact match) | math (equivalence only)
  c.data.prompts_per_step = 64  # train_batch_size, in prompts
  c.data.seed = 0
  c.data.shuffle = True
  c.data.val_size = 0  # 0 = the whole validation set
  # The generated suite (aepo_jax.data.generate_suite): mix = shares of (arith, kb, both) tasks; top_k = pages
  # per search result in the demos; tool_demo_fraction = share of demos that call tools (the rest answer from
  # memory: a cold start that has not learnt when its tools are needed, which RL then has to teach).
  c.data.suite = ml_collections.ConfigDict(
    dict(seed=0, n_train=512, n_heldout=64, difficulty=1, mix=(0.4, 0.4, 0.2), top_k=3, tool_demo_fraction=1.0)
  )

  c.tools = ml_collections.ConfigDict()
  # Registered tools by name (aepo_jax.tools.registered_tools(): python, search, browse, and those of the plug-ins).
  c.tools.names = ("python", "search")
  # Plug-ins: importable module names, imported before the tools are built (training, its evaluations, the
  # pre-flight); a module that calls aepo_jax.tools.register_tool(...) when imported adds a tool to use by name in
  # tools.names (docs/tools.md). Each tool reads its settings from this tools section.
  c.tools.plugins = ()
  c.tools.python_timeout = 120.0
  c.tools.python_memory_mb = 1024
  c.tools.python_max_output = 4096
  c.tools.allow_unsandboxed = False
  # local (BM25 over search_corpus) | retrieval (a retrieval server at search_url) | replay (the query -> result
  # cache in search_corpus, default ARPO's search_cache.json) | serper | brave | bing (web APIs, key in
  # $SERPER_API_KEY / $BRAVE_API_KEY / $BING_API_KEY)
  c.tools.search_backend = "local"
  c.tools.search_url = ""
  c.tools.search_corpus = ""  # '' = the task suite's generated corpus
  c.tools.search_topk = 10
  # snippets: the result is the hits' `Page i: <snippet>` lines (the training tool, spec §4) | browse: the evaluation's
  # SDS browser (spec §2.5): the hits' pages are fetched from tools.browse.pages and an LLM at
  # tools.browse.summarizer_url (any OpenAI-compatible server) condenses them into the result.
  c.tools.search_mode = "snippets"
  # pages: a directory of page files or a corpus JSONL ('' = tools.search_corpus); max_pages: hits fetched per
  # query; page_chars: characters of each page shown to the summariser; live: fetch a hit's http(s) URL that the
  # store lacks (off: the snippet stands in for it).
  c.tools.browse = ml_collections.ConfigDict(
    dict(pages="", summarizer_url="", summarizer_model="", max_pages=10, page_chars=5000, live=False)
  )
  c.tools.call_limit = 6
  c.tools.retry_count = 4
  c.tools.max_workers = 64

  c.rollout = ml_collections.ConfigDict()
  c.rollout.policy = "aepo"  # none | arpo | aepo
  c.rollout.n = 12  # group size = total budget per prompt
  c.rollout.initial_rollouts = 6
  c.rollout.beam_size = 2
  c.rollout.branch_probability = 0.5
  c.rollout.entropy_weight = 0.2
  # exact (the paper: full-vocabulary entropy, mean over the window) | official (the code: top-k truncated entropy
  # summed over the window / ln|V|, spec §1.2 2.2)
  c.rollout.entropy_estimator = "exact"
  # corrected (ours: per-trajectory initial entropy, decision after the tool result) | faithful (the code's quirks
  # Q1 and the one-call lag, spec §1.2, §5)
  c.rollout.mode = "corrected"
  c.rollout.entropy_window = 20
  c.rollout.topk_entropy = 10
  c.rollout.consecutive_penalty = 0.05  # slope of P̂(l) = slope·l (spec §2.1)
  c.rollout.penalize_refills = True
  c.rollout.enable_dynamic_rollouts = True  # paper: True; released scripts: False (spec §2.6)
  c.rollout.premonitor_beta = 0.5
  # m of the pre-monitoring split: 'code' int(n·σ(β·ΔH)) + 1 (the released code), 'paper' n·σ(β·ΔH) rounded.
  c.rollout.premonitor_formula = "code"
  c.rollout.probe_tokens = 50
  c.rollout.max_prompt_len = 2000
  c.rollout.max_response_len = 6192
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0  # 0 = off (verl's -1)
  # Sampler extras (vLLM semantics; training scripts: off). repetition_penalty: logits of every token already in the
  # row (prompt, generated, tool results) divided by it when positive, multiplied when negative; 1 = off.
  # min_p: keep tokens with probability >= min_p x the top one; 0 = off. The evaluation protocol uses 1.1 and 0.
  c.rollout.repetition_penalty = 1.0
  c.rollout.min_p = 0.0
  c.rollout.max_slots = 0  # 0 = this host's prompts_per_step * n, times 1 + train.max_staleness (partial rollouts)
  c.rollout.decode_chunk = 32
  # Active slots a decode call runs through the CPU decode kernel (0 = all; oldest prompt groups first): past the
  # rows where the CPU's matmuls saturate, more rows only slow every row (Engine(max_decode_rows), docs/performance.md).
  c.rollout.decode_rows = 0
  # When a tool result enters its trajectory: 'when_ready' (after any decode chunk once the call is done; no decode
  # step waits for a tool) or 'next_chunk' (after the chunk that follows the call, waiting for it there if needed:
  # partial rollouts then repeat run to run; the synchronous rollout is the same under both). AgentConfig.tool_results.
  c.rollout.tool_results = "when_ready"
  # Each host rolls out its own prompts on its own devices, independently of the other hosts: the policy weights
  # are copied once per RL step from the training mesh onto this per-host mesh (-1 once: the rest of the host's
  # devices), in rollout.dtype ('' = model.dtype: bfloat16 on accelerators, float32 on CPU).
  c.rollout.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=-1))
  c.rollout.dtype = ""
  c.rollout.prefill_chunk = 256  # tokens per prefill/extend call and row
  c.rollout.prefill_rows = 16  # rows per prefill/extend call (bounds its activations and KV window)
  # The engine's KV cache (aepo_jax/rollout/_pages.py). 'auto': paged on TPU (a pool of pages shared by the host's
  # slots; a fork shares its parent's full pages; decode through JAX's Pallas paged-attention kernel), dense
  # elsewhere (a max_len row per slot; the CPU kernels read dense rows). kv_tokens: the paged pool in tokens per
  # host, 0 = max_slots x max_len (every slot at full length at once). A smaller pool fits longer contexts: slots
  # that run short wait, and the agent loop preempts (re-prefills later) when nothing else can go on.
  c.rollout.kv_layout = "auto"
  c.rollout.page_size = 64
  c.rollout.kv_tokens = 0

  # timeout_s: wall time per response in a scoring worker (math-verify on a hostile answer can run for minutes);
  # past it the response scores 0 and the step goes on.
  c.reward = ml_collections.ConfigDict(dict(name="deep_research", timeout_s=10.0))

  c.algo = ml_collections.ConfigDict()
  c.algo.advantage = "grpo"
  c.algo.norm_by_std = True
  c.algo.loss = "aepo"
  c.algo.clip_low = 0.2
  c.algo.clip_high = 0.2
  c.algo.clip_c = 3.0  # dual clip; 0 = off
  c.algo.agg = "token-mean"
  # How micro-batch losses combine under gradient accumulation: global (ours: one token-mean over the whole
  # mini-batch, as one big batch) | verl (the code: each micro-batch's own mean, weighted by its share of the
  # sequences; use_dynamic_bsz, spec §1.5, §5 item 10).
  c.algo.aggregation = "global"
  # With aggregation='verl': the micro-batches of verl's use_dynamic_bsz, as the released scripts ran it
  # (train/_verl_batching.py): the step's rows balanced over verl_world_size ranks by tokens, each rank's mini-batch
  # cut into token-balanced micro-batches of at most verl_max_token_len tokens (0: 2 x (max_prompt_len +
  # max_response_len), the scripts' ppo_max_token_len_per_gpu), each micro-batch's own loss weighted by its rows.
  # Off: micro-batches of train.micro_batch_size rows in rollout order (verl with use_dynamic_bsz off).
  c.algo.verl_dynamic_bsz = False
  c.algo.verl_max_token_len = 0
  c.algo.verl_world_size = 8  # the released scripts' GPUs (1 node x 8)
  # Credit for a prefix shared by branches (spec §1.4): soft (the code: GRPO on every trajectory, the prefix
  # repeated per copy) | hard (the paper's option: each shared prefix token gets the mean advantage of the
  # trajectories that share it).
  c.algo.attribution = "soft"
  # Importance weights for tokens the engine sampled under another policy than the trainer's pi_old (its own numeric
  # precision, or an older parameter version): none | tis (truncated IS, w = min(pi_old/pi_sampler, cap); verl PR
  # #2953) | decoupled (AReaL's decoupled PPO: tokens with w > cap leave the loss). cap 0: the method's default (tis
  # 2, decoupled 5). objectives/_off_policy.py.
  c.algo.off_policy = "none"
  c.algo.off_policy_cap = 0.0
  c.algo.entropy_advantage_coef = 0.2  # paper's full method; 0 reproduces the released runs (spec §2.3)
  c.algo.preserve_high_clip_grad = True
  # KL to the reference (the RL start): a loss term (coef > 0), or with use_in_reward a token-level reward
  # penalty −coef·KL(old, ref) (verl use_kl_in_reward: then there is no KL loss term).
  c.algo.kl = ml_collections.ConfigDict(dict(name="low_var_kl", coef=0.0, use_in_reward=False))
  # DAPO dynamic sampling: drop groups whose filter_metric ('acc' = answer correct, or 'reward') is the same
  # for every trajectory, and keep generating (at most max_num_gen_batches batches; 0 = no limit) until
  # data.prompts_per_step groups are kept.
  c.algo.filter_groups = False
  c.algo.filter_metric = "acc"
  c.algo.max_num_gen_batches = 10
  c.algo.overlong_buffer = 0  # DAPO overlong shaping; 0 = off
  c.algo.overlong_factor = 1.0
  # Routing replay for a model with experts (R3, arXiv 2510.11370): none | rollout (the engine records the experts
  # each token went to in each sparse layer, and the old-log-prob recomputation and the update route every token
  # through those experts, the gates still the current router's probabilities at them, so the router keeps learning;
  # the reference log-probs keep their own routing). Use it for an MoE policy whose engine and trainer numerics differ
  # (bf16 rollouts, another kernel, partial rollouts): a flipped top-k there moves a token's log-prob by a whole
  # expert and destabilises RL. Costs 4 x L_sparse x k bytes per token in the batch. A dense model refuses 'rollout'.
  # 'measure': the engine records the routes and the trainer only measures how often its own top-k differs from
  # them (train/routing_disagreement; one extra forward per step), without replaying: what replay would change.
  c.algo.routing_replay = "none"

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 1e-6
  c.optim.warmup_steps = 0
  c.optim.schedule = "constant"  # constant | cosine | linear
  c.optim.end_lr_fraction = 0.0
  c.optim.weight_decay = 0.01
  c.optim.grad_clip = 1.0
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.eps = 1e-8

  c.train = ml_collections.ConfigDict()
  c.train.steps = 0  # RL steps; 0 = derive from epochs and the train set size
  c.train.epochs = 1
  c.train.ppo_mini_batch_size = 8  # in prompts (verl convention)
  c.train.micro_batch_size = 8  # in sequences (gradient accumulation)
  c.train.ppo_epochs = 1
  c.train.seed = 0
  # Partial rollouts (docs/rollout.md): 0 = the synchronous step (every trajectory of a step ends before its update).
  # k > 0: a step's rollout ends once data.prompts_per_step groups are complete; unfinished trajectories carry over
  # to the next step under the new weights, and no token of an update was sampled more than k steps (weight versions)
  # before it (algo.off_policy corrects for it). Carried-over trajectories are dropped at a restart.
  c.train.max_staleness = 0
  # With max_staleness > 0, which complete groups a step trains on: 'completion' = the first data.prompts_per_step
  # to complete (oldest first; a group more than max_staleness steps old is always waited for), 'admission' = the
  # oldest data.prompts_per_step groups, in the data's order (no bias toward groups with short trees; waits for
  # their slowest trajectory while the younger groups decode).
  c.train.hand_back = "completion"
  # With max_staleness > 0: True = fill the carried-over run one batch per step (step 1 synchronous, then one more
  # step's groups in flight each step until max_staleness + 1), so the first updates train on groups the latest
  # weights started rather than max_staleness + 1 batches the initial policy started. False = all at the first step.
  c.train.staleness_ramp = False
  # With max_staleness > 0: a step's rollout, once its groups are ready, goes on decoding until it has sampled this
  # fraction of the mean tokens per step so far (0 = return once ready). Spreads the decoding over the steps where
  # admission order would otherwise run one long step and max_staleness short ones (PartialRollouts(call_floor)).
  c.train.call_floor = 0.0
  c.train.nan_limit = 3  # non-finite losses skipped before a clear stop
  c.train.eval_every = 0  # 0 = only before and after RL
  c.train.log_every = 1
  # > 0: the update steps (SFT and RL) compute the LM head only at loss positions, up to this fraction of a
  # micro-batch's rows x length (a micro-batch with more loss tokens takes the dense path: same result, only the
  # time differs). The head is ~1/4 of a small model's step FLOPs; prompts and padding need no logits.
  c.train.logit_fraction = 0.0
  # The update steps keep a micro-batch's float32 logits from the forward for the backward when they take at most
  # this many MiB (one LM-head matmul fewer per step); larger ones are recomputed chunk by chunk. 0: always recompute.
  c.train.saved_logits_mb = 1024.0
  # Peak dense TFLOP/s of one chip, for perf/mfu; 0 = the known TPU/GPU kinds' table (no MFU on CPU).
  c.train.peak_tflops = 0.0
  # The persistent XLA compilation cache (aepo_jax/parallel/_compile_cache.py): a restart, a resume or the next run
  # reads the programs back instead of compiling them again. 'auto': <workdir>/compile_cache ($JAX_COMPILATION_CACHE_DIR,
  # where set, stands instead); a folder (local or gs://; one for a sweep's runs); '' = none.
  c.train.compile_cache = "auto"

  c.sft = ml_collections.ConfigDict()
  c.sft.enabled = False
  # 'suite' (the generated suite's demonstrations), 'synthetic' (tests), or a .jsonl / .parquet file (local or gs://,
  # read as a stream) of chat traces in LLaMA-Factory's alpaca (instruction/input/output) or sharegpt
  # (conversations / messages) form; tool results inside an assistant turn (<result>...</result>) get no loss
  # (docs/data.md). Traces longer than max_len are cut there (LLaMA-Factory's cutoff_len; the papers use 15,000).
  c.sft.source = "suite"
  c.sft.steps = 100
  c.sft.lr = 7e-6  # AEPO cold start: 7e-6, cosine, warm-up 0.1 (spec §2.4)
  c.sft.schedule = "cosine"
  c.sft.warmup_frac = 0.1
  c.sft.batch_size = 8
  c.sft.micro_batch_size = 8
  c.sft.max_len = 1024
  # 0: one demo per row of max_len. R > 0: each step's batch_size demos are packed into R rows of max_len
  # (attention within each demo; the same loss on fewer padded tokens); micro_batch_size then counts rows.
  c.sft.packed_rows = 0
  # Tool results inside an assistant turn (<result>...</result>) get no loss, as in RL (this project's choice);
  # False trains them like the rest of the turn and masks only observation / tool turns (LLaMA-Factory's recipe).
  c.sft.mask_results = True
  c.sft.seed = 0

  c.eval = ml_collections.ConfigDict()
  c.eval.before_rl = True
  c.eval.after_rl = True
  c.eval.num_prompts = 0  # 0 = data.val_size
  c.eval.temperature = 0.0  # greedy, n = 1 (ARPO validation)
  c.eval.max_response_len = 0  # 0 = rollout.max_response_len
  c.eval.batch_size = 0  # prompts per evaluation rollout; 0 = data.prompts_per_step
  # Pass@k: the evaluations before and after RL also sample pass_k answers per question (at pass_k_temperature;
  # 0 = rollout.temperature) and report eval/pass@1 and eval/pass@k (unbiased); 0 = off (greedy only).
  c.eval.pass_k = 0
  c.eval.pass_k_temperature = 0.0
  # An LLM judge (any OpenAI-compatible server: base URL and model) for the QA and deep-search validation sets,
  # OR'ed with math equivalence as in the evaluation protocol (spec §2.5); '' = math equivalence / exact match only.
  c.eval.judge_url = ""
  c.eval.judge_model = ""
  # Or serve a judge from this process: a bundled model name, an HF directory or a training checkpoint (local or
  # gs://), behind aepo_jax.serve on 127.0.0.1 for the run (each host its own); excludes judge_url.
  c.eval.judge_checkpoint = ""
  # Scoring of the validation answers: 'project' (math-verify, the strict judge) or 'official' (the official
  # ARPO/AEPO evaluator's metrics, judge prompt and reply rule: aepo_jax.eval._scoring). The paper configs: official.
  c.eval.protocol = "project"

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 10
  c.checkpoint.keep = 3
  c.checkpoint.best_metric = "eval/accuracy"  # '' = keep no best
  c.checkpoint.best_mode = "max"
  c.checkpoint.async_save = True
  c.checkpoint.ocdbt = True  # Orbax's OCDBT format (few files); False = one zarr per array (storage emulators)
  c.checkpoint.compression = True  # zstd (Orbax's default); False: ~20% larger, ~4x less CPU per save (small hosts)
  # A checkpoint whose files or arrays differ from their checksums at save, or hold NaN/inf: 'fallback' moves it
  # aside (<step>.damaged) and resumes from the newest intact step; 'stop' names it and the intact step, and stops.
  c.checkpoint.on_corrupt = "fallback"
  # A rerun in a workdir that holds checkpoints resumes them only if it is the same run (model, data sources,
  # objective, rollout policy, seeds: workdir/fingerprint.json); 'check' refuses another run naming the differences,
  # 'force' resumes the checkpoints with this config anyway (and records its fingerprint).
  c.checkpoint.resume = "check"
  # A multi-host run needs a workdir every host sees (gs://...). A local path is refused unless it is shared
  # storage mounted at the same path on every host (NFS, Filestore, or several processes on one machine).
  c.checkpoint.shared_workdir = False

  c.metrics = ml_collections.ConfigDict(dict(jsonl=True, tensorboard=True, histograms=True, progress=True))
  c.lock()
  c.model.overrides.unlock()  # the one open dict: ModelConfig fields, checked in validate()
  return c


# ---------------------------------------------------------------------------------------------------------
# Loading.
