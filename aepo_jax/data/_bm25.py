"""BM25 over a corpus with the search tool's result text: `Page i: <snippet>` lines (spec §4).

Settings, matching `aepo_jax.tools` (RetrievalIndex + SearchTool with include_titles=False): bm25s
defaults (Lucene BM25, k1=1.5, b=0.75), lower-cased, English stop words, no stemming, zero scores
dropped; snippet = the document text after its title line, stripped, cut to 1000 characters.
Equal scores are ordered by corpus position (see `Bm25Index.search`).
"""

from __future__ import annotations

import sys

NO_RESULTS = "No search results found."


def _import_bm25s():
  # bm25s probes `import jax.lax` when imported; block that so aepo_jax.data stays jax-free.
  if "bm25s" in sys.modules or "jax" in sys.modules:
    import bm25s

    return bm25s
  sys.modules["jax"] = None  # type: ignore[assignment]
  try:
    import bm25s
  finally:
    del sys.modules["jax"]
  return bm25s


def snippet(contents: str, max_chars: int = 1000) -> str:
  """Body of a '"Title"\\ntext' record (the search tool shows text, not titles), cut to max_chars."""
  return contents.partition("\n")[2].strip()[:max_chars]


def format_pages(snippets: list[str]) -> str:
  """'Page 1: ...\\nPage 2: ...' or the tool's empty-result message."""
  if not snippets:
    return NO_RESULTS
  return "\n".join(f"Page {i}: {s}" for i, s in enumerate(snippets, start=1))


class Bm25Index:
  def __init__(self, docs: list[dict]):
    bm25s = _import_bm25s()
    self._bm25s, self.docs = bm25s, docs
    self.retriever = bm25s.BM25()
    tokens = bm25s.tokenize([d["contents"] for d in docs], stopwords="en", show_progress=False)
    self.retriever.index(tokens, show_progress=False)

  def search(self, query: str, k: int) -> list[tuple[int, float]]:
    """[(doc index, score)] best first, only positive scores; equal scores in corpus order.

    Scores every document (the generated corpora are small) so that ties are broken the same
    way whatever top-k routine a server uses; `retrieve`'s partial sort leaves them arbitrary.
    """
    tokens = self._bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)[0]
    scores = self.retriever.get_scores(tokens)
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    return [(i, float(scores[i])) for i in order[:k] if scores[i] > 0]

  def result_text(self, query: str, k: int = 3, max_chars: int = 1000) -> str:
    return format_pages([snippet(self.docs[i]["contents"], max_chars) for i, _ in self.search(query, k)])
