"""The OpenAI-compatible server against the engine it wraps: throughput with 1, 4 and 16 concurrent streaming
clients vs the engine's own batch-16 throughput, and time to first token at idle vs the engine's.

  python bench/serve.py                       # SmolLM2-135M-Instruct, 64 tokens per request (~5 min on 2 cores)
  python bench/serve.py --quick               # 16 tokens per request, fewer requests
  python bench/serve.py --model tiny          # a tiny random model (no download; checks the plumbing)

The server runs in this process (aepo_jax.serve.Server on loopback, 16 slots); the clients run in a child process
(`--client`, plain http.client, one thread each) so their Python does not share the server's interpreter lock.
Every request streams (stream=True) `--max_tokens` tokens (ignore_eos) from a chat-templated question at
temperature 1. Each client sends requests back to back; throughput = generated tokens / wall time of the round.

Engine baseline: the same engine shape (16 slots, same max_len, `steps_per_call` steps per decode call) fed the
same 16 prompts at once, prefill included: generated tokens / time. Engine time to first token: `add` of one
prompt plus its first decode step (prefill computes no logits; the first step makes the first token), at idle.
Server time to first token: from sending the request to the first streamed text, at idle. Engine and server
rounds alternate (`--repeats`) and the best of each is compared, so load from other processes slows both alike.
The server compiles every prefill variant before it is measured (`warmup(full=True)`), and every configuration
runs once untimed first.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time

QUESTIONS = [
  "What is the capital of France?",
  "Explain photosynthesis in one paragraph.",
  "Write a haiku about the sea.",
  "How many legs does a spider have?",
  "Name three prime numbers.",
  "What is 12 times 34?",
  "Describe a cat to someone who has never seen one.",
  "Why is the sky blue?",
  "Give me a recipe for pancakes.",
  "What does a compiler do?",
  "Summarise the plot of Hamlet.",
  "List the planets of the solar system.",
  "What is the boiling point of water?",
  "Translate 'good morning' into French.",
  "How do vaccines work?",
  "What is a prime number?",
]


# ------------------------------------------------------------------------------------------------------
# Client process
# ------------------------------------------------------------------------------------------------------
def _stream_one(url: str, body: dict):
  """(seconds to the first streamed text, generated tokens, total seconds) of one streaming completion."""
  host, port = url.removeprefix("http://").split(":")
  conn = http.client.HTTPConnection(host, int(port), timeout=600)
  t0 = time.perf_counter()
  conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
  resp = conn.getresponse()
  if resp.status != 200:
    raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
  first, tokens = None, 0
  for line in resp:
    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
      continue
    chunk = json.loads(line[6:])
    if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
      first = time.perf_counter() - t0
    if chunk.get("usage"):
      tokens = chunk["usage"]["completion_tokens"]
  conn.close()
  return first, tokens, time.perf_counter() - t0


def client_main(args):
  """Runs `concurrency` threads of `requests` back-to-back streaming completions; prints a JSON summary."""
  prompts = json.loads(args.prompts)
  out = {"tokens": 0, "ttft": [], "errors": []}
  lock = threading.Lock()

  def worker(k):
    for r in range(args.requests):
      body = {
        "prompt": prompts[(k + r) % len(prompts)],
        "max_tokens": args.max_tokens,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": True,
        "seed": k * 1000 + r,
      }
      try:
        first, tokens, _ = _stream_one(args.client, body)
      except Exception as e:  # noqa: BLE001 (reported)
        with lock:
          out["errors"].append(str(e))
        return
      with lock:
        out["tokens"] += tokens
        out["ttft"].append(first)

  threads = [threading.Thread(target=worker, args=(k,)) for k in range(args.concurrency)]
  t0 = time.perf_counter()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  out["seconds"] = time.perf_counter() - t0
  print(json.dumps(out), flush=True)


def run_clients(url: str, prompts, concurrency: int, requests: int, max_tokens: int) -> dict:
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    "--client",
    url,
    "--concurrency",
    str(concurrency),
    "--requests",
    str(requests),
    "--max_tokens",
    str(max_tokens),
    "--prompts",
    json.dumps(prompts),
  ]
  res = subprocess.run(cmd, capture_output=True, text=True, check=True)
  out = json.loads(res.stdout.strip().splitlines()[-1])
  if out["errors"]:
    raise RuntimeError(f"client errors: {out['errors'][:3]}")
  return out


# ------------------------------------------------------------------------------------------------------
# Server process
# ------------------------------------------------------------------------------------------------------
def load(model: str):
  from aepo_jax.model import ModelConfig, Tokenizer, init_params, load_pretrained, pretrained_dir

  if model == "tiny":
    import tempfile
    import jax
    from aepo_jax.testing import tiny_tokenizer

    tok = Tokenizer.from_dir(tiny_tokenizer(tempfile.mkdtemp()))
    cfg = ModelConfig(
      family="qwen3",
      vocab_size=tok.vocab_size,
      hidden_size=64,
      intermediate_size=128,
      num_layers=2,
      num_heads=4,
      num_kv_heads=2,
      head_dim=16,
      qk_norm=True,
      eos_token_ids=tuple(tok.eos_ids),
    )
    return cfg, init_params(cfg, jax.random.PRNGKey(0)), tok
  cfg, params = load_pretrained(model)
  return cfg, params, Tokenizer.from_dir(pretrained_dir(model))


def engine_batch(engine, params, prompts, max_tokens: int, steps: int) -> float:
  """Seconds for the engine to generate max_tokens for each prompt, all at once, prefill included."""
  import jax

  state = engine.init_decode_state()
  t0 = time.perf_counter()
  state = engine.add(params, state, list(range(len(prompts))), prompts, list(range(len(prompts))), max_tokens)
  done = 0
  while done < max_tokens:
    state, out = engine.decode(params, state, min(steps, max_tokens - done))
    jax.device_get(out.token)
    done += steps
  return time.perf_counter() - t0


def engine_first_token(engine, params, prompt) -> float:
  """Seconds from `add` of one prompt (idle engine) to its first token on the host."""
  import jax

  state = engine.init_decode_state()
  jax.block_until_ready(state.tokens)
  t0 = time.perf_counter()
  state = engine.add(params, state, [0], [prompt], [0], 4)
  state, out = engine.decode(params, state, 1)
  jax.device_get(out.token)
  return time.perf_counter() - t0


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--max_tokens", type=int, default=64)
  ap.add_argument("--max_len", type=int, default=1024)
  ap.add_argument("--steps_per_call", type=int, default=8)
  ap.add_argument("--requests", type=int, default=2, help="requests per client per round")
  ap.add_argument("--repeats", type=int, default=3, help="alternating engine / 16-client rounds")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--client", help=argparse.SUPPRESS)
  ap.add_argument("--concurrency", type=int, default=1, help=argparse.SUPPRESS)
  ap.add_argument("--prompts", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.client:
    return client_main(args)
  if args.quick:
    args.max_tokens, args.requests, args.repeats = 16, 1, 1

  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from aepo_jax.parallel import use_cpu_xla_flags

  use_cpu_xla_flags()
  import jax
  from aepo_jax.rollout import Engine, SamplingParams
  from aepo_jax.serve import Server

  cfg, params, tok = load(args.model)
  texts = [tok.render_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
  ids = [tok.encode(t, add_bos=False) for t in texts]
  print(
    f"model {args.model}, {jax.devices()[0].platform}, prompts {min(map(len, ids))}-{max(map(len, ids))} "
    f"tokens, {args.max_tokens} new tokens per request, 16 slots x {args.max_len}, "
    f"{args.steps_per_call} steps per call",
    flush=True,
  )

  # The engine alone (same shape as the server's; shares its compiled functions). Engine and server rounds
  # alternate and the best of each counts, so a busy machine slows both sides alike.
  engine = Engine(cfg, max_slots=16, max_len=args.max_len, eos_ids=(), sampling=SamplingParams(1.0))
  idle = Engine(cfg, max_slots=16, max_len=args.max_len, eos_ids=(), per_slot_sampling=True)
  engine_batch(engine, params, ids, args.max_tokens, args.steps_per_call)  # compile
  engine_first_token(idle, params, ids[0])
  server = Server(
    cfg,
    params,
    tok,
    model_name=args.model,
    max_slots=16,
    max_len=args.max_len,
    port=0,
    steps_per_call=args.steps_per_call,
  ).start()
  t0 = time.perf_counter()
  server.warmup(full=True)
  print(f"server warmup (every prefill variant): {time.perf_counter() - t0:.0f} s", flush=True)
  rows, pairs, firsts = {}, [], []
  try:
    for _ in range(6):  # time to first token at idle, engine and server alternately
      firsts.append((engine_first_token(idle, params, ids[0]), run_clients(server.url, texts[:1], 1, 1, 4)["ttft"][0]))
    for c in (1, 4, 16):
      run_clients(server.url, texts, c, 1, min(args.max_tokens, 16))  # compile this concurrency's variants
    for _ in range(args.repeats):
      batch_s = engine_batch(engine, params, ids, args.max_tokens, args.steps_per_call)
      for c in (1, 4, 16) if not rows else (16,):
        out = run_clients(server.url, texts, c, args.requests, args.max_tokens)
        rows.setdefault(c, []).append(out["tokens"] / out["seconds"])
      pairs.append((16 * args.max_tokens / batch_s, rows[16][-1]))
  finally:
    server.shutdown(5)

  engine_tps = max(e for e, _ in pairs)
  print(
    f"\nengine, batch 16 at once (prefill included): best {engine_tps:.1f} tok/s of "
    f"{', '.join(f'{e:.1f}' for e, _ in pairs)}"
  )
  print("| streaming clients | server tok/s (best) | of engine batch-16 (best) | rounds |")
  print("|---|---|---|---|")
  for c, tps in rows.items():
    print(f"| {c} | {max(tps):.1f} | {max(tps) / engine_tps:.0%} | {', '.join(f'{t:.1f}' for t in tps)} |")
  ratios = [srv / eng for eng, srv in pairs]
  print(f"16 clients / engine batch-16, round by round: {', '.join(f'{r:.0%}' for r in ratios)}")
  eng_ms = statistics.median(e for e, _ in firsts[1:]) * 1e3
  srv_ms = statistics.median(s for _, s in firsts[1:]) * 1e3
  diff_ms = statistics.median((s - e) for e, s in firsts[1:]) * 1e3
  print(
    f"\ntime to first token at idle (median of {len(firsts) - 1}): server {srv_ms:.1f} ms, engine (add + first "
    f"step) {eng_ms:.1f} ms; server - engine, pair by pair: median {diff_ms:+.1f} ms"
  )


if __name__ == "__main__":
  main()
