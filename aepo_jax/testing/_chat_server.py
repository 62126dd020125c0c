"""A fake OpenAI-compatible chat server on 127.0.0.1 for tests of the judge and the browse summariser."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from typing import Callable, Union


@contextlib.contextmanager
def chat_server(reply: Callable[[dict], Union[str, int]]):
  """Serves `POST <base>/chat/completions` in a thread. `reply(request_body)` returns the assistant's text, or an
  int HTTP status to fail with. Yields (base_url, requests): the bodies received, in order."""
  requests: list = []

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 -- http.server's name
      body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
      requests.append(body)
      answer = reply(body)
      if isinstance(answer, int):
        self.send_response(answer)
        self.end_headers()
        return
      out = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
      self.send_response(200)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(out)))
      self.end_headers()
      self.wfile.write(out)

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", requests
  finally:
    server.shutdown()
    server.server_close()
