"""Serve a corpus over Search-R1's retrieval API (POST /retrieve, GET /health) on this machine.

    python launch/retrieval_server.py --corpus corpus.jsonl --index /tmp/kb_index --port 8000 [--dense]

Corpus: JSONL lines {"id", "contents": "title\\ntext"} or {"id", "title", "text"}. The BM25 index (and with
--dense the faiss index of all-MiniLM-L6-v2 embeddings) is saved under --index and reused while the corpus is
unchanged. Then point the agent at it: make_search_backend("retrieval", url="http://127.0.0.1:8000").
Requests with more than --max-queries queries or a body over --max-body-mb answer 413; every error answers JSON.
"""

import argparse
import logging

from aepo_jax.tools import RetrievalIndex, make_server
from aepo_jax.tools._retrieval import MAX_BODY_BYTES, MAX_QUERIES


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--corpus", required=True, help="JSONL corpus file")
  parser.add_argument("--index", required=True, help="directory for the saved index (created if missing)")
  parser.add_argument("--dense", action="store_true", help="serve dense retrieval (faiss + all-MiniLM-L6-v2)")
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--port", type=int, default=8000)
  parser.add_argument("--max-queries", type=int, default=MAX_QUERIES, help="queries per request at most")
  parser.add_argument("--max-body-mb", type=float, default=MAX_BODY_BYTES / 2**20, help="request body size limit")
  args = parser.parse_args()
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  index = RetrievalIndex(args.corpus, args.index, dense=args.dense)
  if args.max_queries < 1 or args.max_body_mb <= 0:
    parser.error(f"--max-queries ({args.max_queries}) and --max-body-mb ({args.max_body_mb}) must be positive")
  server = make_server(
    index, args.host, args.port, max_queries=args.max_queries, max_body_bytes=int(args.max_body_mb * 2**20)
  )
  logging.info("serving %d docs (%s) on http://%s:%d", len(index.docs), index.method, *server.server_address[:2])
  print(f"READY http://{server.server_address[0]}:{server.server_address[1]}", flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()


if __name__ == "__main__":
  main()
