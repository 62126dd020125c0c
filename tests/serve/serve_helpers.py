"""Plain-HTTP helpers for the serve tests (status codes, headers and raw bodies the openai client hides)."""

import http.client
import json

MAX_SLOTS, MAX_LEN = 4, 4096  # the shared test server's engine


def http_request(url: str, method: str, path: str, body=None, raw: bytes = None, timeout: float = 60, headers=None):
  """(status, headers, parsed JSON or text) of one plain HTTP request."""
  host, port = url.removeprefix("http://").split(":")
  conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
  data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
  conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
  resp = conn.getresponse()
  text = resp.read().decode()
  conn.close()
  try:
    return resp.status, dict(resp.getheaders()), json.loads(text)
  except json.JSONDecodeError:
    return resp.status, dict(resp.getheaders()), text


def metric(url: str, name: str) -> float:
  _, _, text = http_request(url, "GET", "/metrics")
  for line in text.splitlines():
    if line.startswith(f"aepo_serve_{name} "):
      return float(line.split()[-1])
  raise KeyError(name)
