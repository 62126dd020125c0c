r"""Serve a checkpoint behind an OpenAI-compatible HTTP API (docs/serving.md).

  python launch/serve.py --checkpoint=smollm2-135m-instruct                 # a bundled name, port 8000
  python launch/serve.py --checkpoint=/tmp/aepo_cpu/checkpoints/rl/6       # a training checkpoint step (or phase dir)
  python launch/serve.py --checkpoint=gs://BUCKET/aepo_gaia --max_slots=32 --max_len=8192 --host=0.0.0.0
  python launch/serve.py --checkpoint=/path/to/hf_dir --served_model_name=policy

  curl localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "Hi", "max_tokens": 16}'

Every route but /health needs `Authorization: Bearer KEY` when --api_key (or $AEPO_JAX_API_KEY) is set, which a
server listening beyond this machine (--host=0.0.0.0) should have; requests must name this server in their Host
header (its address, localhost, an IP address when it listens on every interface, or a name in --allowed_hosts).

--checkpoint takes what `launch/evaluate.py` takes: a bundled name, an HF directory (local or gs://), or an Orbax
training checkpoint (its model config and tokenizer come from the checkpoint). SIGTERM or Ctrl-C stops taking
requests, lets running ones finish for --drain_seconds, then exits.
"""

import logging
import os
import signal
import sys
import threading

from absl import app, flags

if not __package__:  # run as a script from a checkout (not as `python -m aepo_jax.launch.NAME`)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CKPT = flags.DEFINE_string("checkpoint", None, "Bundled name, HF directory (local or gs://) or training checkpoint.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "Tokenizer name or directory (default: the checkpoint's).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0 for every interface).")
_PORT = flags.DEFINE_integer("port", 8000, "Port (0: any free port; the URL is logged).")
_SLOTS = flags.DEFINE_integer("max_slots", 16, "Engine slots: sequences decoded together.")
_LEN = flags.DEFINE_integer("max_len", 4096, "Tokens per slot: prompt + completion.")
_NAME = flags.DEFINE_string("served_model_name", None, "Model name in the API (default: --checkpoint as given).")
_STEPS = flags.DEFINE_integer("steps_per_call", 8, "Decode steps per engine call (new requests join between).")
_QUEUE = flags.DEFINE_integer("max_queue", 256, "Requests that may wait for a slot; more get 429.")
_DRAIN = flags.DEFINE_float("drain_seconds", 30.0, "On SIGTERM, how long running requests may take to finish.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Parameter and compute dtype (float32, bfloat16).")
_CACHE_DTYPE = flags.DEFINE_string("cache_dtype", None, "KV-cache dtype (default: the model's).")
_PLATFORM = flags.DEFINE_string("platform", None, "Force a JAX platform (cpu, tpu, gpu).")
_API_KEY = flags.DEFINE_string(
  "api_key", None, "Key every route but /health requires (Authorization: Bearer KEY); default $AEPO_JAX_API_KEY."
)
_ALLOWED_HOSTS = flags.DEFINE_list(
  "allowed_hosts", [], "Host header names accepted besides the address, localhost and IP literals ('*': any)."
)
_IDLE = flags.DEFINE_float("idle_timeout", 60.0, "Seconds a connection may send nothing (or not read) before closing.")
_WARMUP = flags.DEFINE_enum(
  "warmup",
  "full",
  ["full", "quick", "none"],
  "Compile before taking requests: every prefill and decode variant (full), the decode step only (quick), or nothing.",
)


def main(argv):
  del argv
  logging.getLogger().setLevel(logging.INFO)
  if not _CKPT.value:
    raise app.UsageError("--checkpoint is required (a bundled name, an HF directory or a training checkpoint).")
  from aepo_jax.parallel import use_cpu_xla_flags

  use_cpu_xla_flags()  # before JAX starts its backend
  import jax

  if _PLATFORM.value:
    jax.config.update("jax_platforms", _PLATFORM.value)

  from aepo_jax.eval import CheckpointNotFoundError, load_policy
  from aepo_jax.serve import Server

  try:
    policy = load_policy(_CKPT.value, tokenizer=_TOKENIZER.value, dtype=_DTYPE.value)
  except CheckpointNotFoundError as e:
    raise SystemExit(f"error: {e}")
  name = _NAME.value or _CKPT.value  # vLLM's default: the model argument as given
  api_key = _API_KEY.value or os.environ.get("AEPO_JAX_API_KEY") or None
  if api_key is None and _HOST.value not in ("127.0.0.1", "localhost", "::1"):
    logging.warning("serve: listening on %s without an API key: anyone who reaches it can use it.", _HOST.value)
  try:
    server = Server(
      policy.config,
      policy.params,
      policy.tokenizer,
      model_name=name,
      max_slots=_SLOTS.value,
      max_len=_LEN.value,
      host=_HOST.value,
      port=_PORT.value,
      steps_per_call=_STEPS.value,
      max_queue=_QUEUE.value,
      cache_dtype=_CACHE_DTYPE.value,
      api_key=api_key,
      allowed_hosts=_ALLOWED_HOSTS.value,
      idle_timeout_s=_IDLE.value,
    )
  except (ValueError, OSError) as e:  # --max_len beyond the model's context, an address in use, ...
    raise SystemExit(f"error: {e}")

  def stop(signum, frame):
    del frame
    logging.info("serve: signal %d; draining for at most %.0f s", signum, _DRAIN.value)
    threading.Thread(target=server.shutdown, args=(_DRAIN.value,), daemon=True).start()

  signal.signal(signal.SIGTERM, stop)
  signal.signal(signal.SIGINT, stop)
  server.scheduler.start()
  if _WARMUP.value != "none":
    server.warmup(full=_WARMUP.value == "full")
  logging.info("serve: %s (%s) at %s, %d slots x %d tokens", name, policy.source, server.url, _SLOTS.value, _LEN.value)
  print(f"serving {name} at {server.url}", flush=True)
  server.serve_forever()
  logging.info("serve: stopped")


if __name__ == "__main__":
  app.run(main)
