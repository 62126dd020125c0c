"""Serving: the rollout engine behind an OpenAI-compatible HTTP API (docs/serving.md).

  Server(config, params, tokenizer, *, model_name, max_slots, max_len, host, port, ...)
      .start() / .serve_forever() / .shutdown(drain_s) / .url / .warmup()
      routes: GET /v1/models, /health, /metrics; POST /v1/completions, /v1/chat/completions
  Scheduler(engine, params, *, steps_per_call, max_queue)   continuous batching over Engine slots
  parse_request(body, *, chat, tokenizer, ...) -> GenRequest   request checks (ApiError -> OpenAI error schema)

Imports only `aepo_jax.rollout` and `aepo_jax.model`; nothing in the core imports this package.
"""

from aepo_jax.serve._protocol import ApiError, GenRequest, parse_request
from aepo_jax.serve._scheduler import Job, QueueFull, Scheduler, ShuttingDown, Update
from aepo_jax.serve._server import Server
