r"""Serve a corpus over Search-R1's retrieval API (POST /retrieve, GET /health) on this machine.

  python launch/retrieval_server.py --corpus=corpus.jsonl --index=/tmp/kb_index --port=8000 [--dense]

Corpus: JSONL lines {"id", "contents": "title\\ntext"} or {"id", "title", "text"}. The BM25 index (and with
--dense the faiss index of all-MiniLM-L6-v2 embeddings) is saved under --index and reused while the corpus is
unchanged. Then point the agent at it: `--config.tools.search_backend=retrieval
--config.tools.search_url=http://127.0.0.1:8000`. Requests with more than --max_queries queries or a body over
--max_body_mb answer 413; every error answers JSON. Prints `READY <url>` once it serves.
"""

import logging
import os
import sys

from absl import app, flags

if not __package__:  # run as a script from a checkout (not as `python -m aepo_jax.launch.NAME`)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aepo_jax.tools import MAX_BODY_BYTES, MAX_QUERIES  # noqa: E402

_CORPUS = flags.DEFINE_string("corpus", None, "JSONL corpus file.")
_INDEX = flags.DEFINE_string("index", None, "Directory for the saved index (created if missing).")
_DENSE = flags.DEFINE_bool("dense", False, "Serve dense retrieval (faiss + all-MiniLM-L6-v2) instead of BM25.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "Port.")
_MAX_QUERIES = flags.DEFINE_integer("max_queries", MAX_QUERIES, "Queries per request at most.", lower_bound=1)
_MAX_BODY_MB = flags.DEFINE_float(
  "max_body_mb", MAX_BODY_BYTES / 2**20, "Request body size limit (MiB).", lower_bound=1e-6
)


def main(argv):
  del argv
  from aepo_jax.tools import RetrievalIndex, make_server

  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  index = RetrievalIndex(_CORPUS.value, _INDEX.value, dense=_DENSE.value)
  server = make_server(
    index, _HOST.value, _PORT.value, max_queries=_MAX_QUERIES.value, max_body_bytes=int(_MAX_BODY_MB.value * 2**20)
  )
  logging.info("serving %d docs (%s) on http://%s:%d", len(index.docs), index.method, *server.server_address[:2])
  print(f"READY http://{server.server_address[0]}:{server.server_address[1]}", flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()


def _absl_spelling(argv):
  """--max-queries -> --max_queries (the argparse spelling of earlier versions of this script)."""
  return [
    ("--" + a[2:].split("=", 1)[0].replace("-", "_") + a[2:][len(a[2:].split("=", 1)[0]) :])
    if a.startswith("--")
    else a
    for a in argv
  ]


if __name__ == "__main__":
  flags.mark_flags_as_required(["corpus", "index"])
  app.run(main, argv=_absl_spelling(sys.argv))
