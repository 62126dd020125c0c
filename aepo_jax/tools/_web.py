"""Commercial web-search backends (Serper, Brave, Bing v7), chosen by name; API key from an environment variable.

The official training tool queried Bing and kept only the snippets; SearchTool does the same by default
(include_titles=False). `base_url` is overridable, so tests point the backends at a loopback fake server.
"""

import os

from aepo_jax.tools._http import JsonClient
from aepo_jax.tools._search import SearchError, SearchHit


def _api_key(env_var: str, name: str) -> str:
  key = os.environ.get(env_var, "")
  if not key:
    raise SearchError(
      f"the {name} search backend needs an API key in the environment variable {env_var} "
      f"(or pass api_key_env='OTHER_VAR')"
    )
  return key


def _items(payload: dict, path: tuple[str, ...], backend: str) -> list[dict]:
  node = payload
  for key in path:
    if not isinstance(node, dict):
      raise SearchError(f"{backend} response has no {'.'.join(path)}: {str(payload)[:200]}")
    node = node.get(key, [])
  if not isinstance(node, list):
    raise SearchError(f"{backend} response field {'.'.join(path)} is not a list: {str(node)[:200]}")
  return node


class _WebBackend:
  NAME, DEFAULT_URL, DEFAULT_KEY_ENV = "", "", ""

  def __init__(self, api_key_env: str | None = None, base_url: str | None = None, **client_kwargs):
    self.api_key_env = api_key_env or self.DEFAULT_KEY_ENV
    self.key = _api_key(self.api_key_env, self.NAME)  # fail at construction, not at the first call
    self.base_url = base_url or self.DEFAULT_URL
    self.client = JsonClient(**client_kwargs)


class SerperBackend(_WebBackend):
  """google.serper.dev: POST {"q", "num"} with header X-API-KEY; hits in `organic[].{title, link, snippet}`."""

  NAME, DEFAULT_URL, DEFAULT_KEY_ENV = "serper", "https://google.serper.dev/search", "SERPER_API_KEY"

  def search(self, query: str, topk: int) -> list[SearchHit]:
    payload = self.client.request(
      "POST", self.base_url, body={"q": query, "num": topk}, headers={"X-API-KEY": self.key}
    )
    return [
      SearchHit(title=r.get("title", ""), text=r.get("snippet", ""), url=r.get("link", ""))
      for r in _items(payload, ("organic",), self.NAME)
    ][:topk]


class BraveBackend(_WebBackend):
  """Brave Search API: GET ?q=&count= with X-Subscription-Token; hits in `web.results[].{title, url, description}`."""

  NAME, DEFAULT_URL, DEFAULT_KEY_ENV = "brave", "https://api.search.brave.com/res/v1/web/search", "BRAVE_API_KEY"

  def search(self, query: str, topk: int) -> list[SearchHit]:
    payload = self.client.request(
      "GET", self.base_url, params={"q": query, "count": min(topk, 20)}, headers={"X-Subscription-Token": self.key}
    )
    return [
      SearchHit(title=r.get("title", ""), text=r.get("description", ""), url=r.get("url", ""))
      for r in _items(payload, ("web", "results"), self.NAME)
    ][:topk]


class BingBackend(_WebBackend):
  """Bing Web Search v7 (and compatible APIs): GET ?q=&count=&mkt= with Ocp-Apim-Subscription-Key;
  hits in `webPages.value[].{name, url, snippet}`."""

  NAME, DEFAULT_URL, DEFAULT_KEY_ENV = "bing", "https://api.bing.microsoft.com/v7.0/search", "BING_API_KEY"

  def __init__(self, *args, market: str = "en-US", **kwargs):
    super().__init__(*args, **kwargs)
    self.market = market

  def search(self, query: str, topk: int) -> list[SearchHit]:
    payload = self.client.request(
      "GET",
      self.base_url,
      params={"q": query, "count": topk, "mkt": self.market},
      headers={"Ocp-Apim-Subscription-Key": self.key},
    )
    return [
      SearchHit(title=r.get("name", ""), text=r.get("snippet", ""), url=r.get("url", ""))
      for r in _items(payload, ("webPages", "value"), self.NAME)
    ][:topk]


WEB_BACKENDS = {"serper": SerperBackend, "brave": BraveBackend, "bing": BingBackend}


def make_search_backend(kind: str, *, cache_path: str | None = None, **kwargs):
  """Builds a backend by name, optionally behind a persistent CachedBackend at `cache_path`.

  'retrieval' (url=), 'local' (corpus=, index_dir=, dense=), 'replay' (path=, on_miss=), and the web backends
  'serper' | 'brave' | 'bing' (api_key_env=, base_url=). Keyword arguments that are None are ignored, so a
  config can pass every field and leave the unused ones empty.
  """
  from aepo_jax.tools._retrieval import LocalIndexBackend, RetrievalBackend
  from aepo_jax.tools._search import CachedBackend, ReplayBackend

  builders = dict(WEB_BACKENDS, retrieval=RetrievalBackend, local=LocalIndexBackend, replay=ReplayBackend)
  if kind not in builders:
    raise ValueError(f"search backend {kind!r} is unknown; choose one of {sorted(builders)}")
  kwargs = {k: v for k, v in kwargs.items() if v is not None}
  try:
    backend = builders[kind](**kwargs)
  except TypeError as e:
    raise TypeError(f"search backend {kind!r}: {e} (given: {sorted(kwargs)})") from None
  return CachedBackend(backend, cache_path, namespace=kind) if cache_path else backend
