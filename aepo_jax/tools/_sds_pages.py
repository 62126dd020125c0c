"""The SDS browser's page text ("SDS", spec §2.5): `fetch_page_text` is the official `extract_text_from_url` (HTML: the
visible text as BeautifulSoup's `get_text(" ", strip=True)` gives it, first 20,000 characters; PDF: `extract_pdf_text`,
the first 600 words; the official error texts), with its request headers and timeout. Used by `_sds.SdsBrowseTool`.
"""

from __future__ import annotations

import html.parser
import re

PAGE_CHARS = 20_000  # extract_text_from_url: text[:20000]
PDF_WORDS = 600  # extract_pdf_text: " ".join(full_text.split()[:600])
FETCH_TIMEOUT_S = 20.0  # session.get(url, timeout=20)
# search_tool_sds.py `headers`, sent with every page request.
FETCH_HEADERS = {
  "User-Agent": "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) "
  "Chrome/58.0.3029.110 Safari/537.36",
  "Referer": "https://www.google.com/",
  "Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,image/webp,*/*;q=0.8",
  "Accept-Language": "en-US,en;q=0.5",
  "Connection": "keep-alive",
  "Upgrade-Insecure-Requests": "1",
}


class _VisibleText(html.parser.HTMLParser):
  """Text nodes as BeautifulSoup's get_text keeps them: not inside script, style, template, rt or rp (bs4's
  string containers), comments and declarations left out."""

  _HIDDEN = ("script", "style", "template", "rt", "rp")

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.nodes, self._buf, self._hidden = [], [], 0

  def _flush(self):
    if self._buf:
      self.nodes.append("".join(self._buf))
      self._buf = []

  def handle_starttag(self, tag, attrs):
    self._flush()
    self._hidden += tag in self._HIDDEN

  def handle_startendtag(self, tag, attrs):
    self._flush()

  def handle_endtag(self, tag):
    self._flush()
    if tag in self._HIDDEN and self._hidden:
      self._hidden -= 1

  def handle_comment(self, data):
    self._flush()

  def handle_data(self, data):
    if not self._hidden:
      self._buf.append(data)


def visible_text(markup: str) -> str:
  """`BeautifulSoup(markup).get_text(separator=" ", strip=True)`: each text node stripped, the non-empty ones joined
  by one space."""
  parser = _VisibleText()
  parser.feed(markup)
  parser.close()
  parser._flush()
  return " ".join(s for s in (node.strip() for node in parser.nodes) if s)


def pdf_text(data: bytes) -> str:
  """`extract_pdf_text`: pdfplumber's text of every page, concatenated, cut to its first 600 words."""
  try:
    import pdfplumber
  except ImportError:
    raise ImportError("reading PDF pages needs pdfplumber, the official browser's PDF reader: pip install pdfplumber")
  import io

  with pdfplumber.open(io.BytesIO(data)) as pdf:
    full_text = "".join(page.extract_text() or "" for page in pdf.pages)
  return " ".join(full_text.split()[:PDF_WORDS])


def _charset(content_type: str) -> str:
  """The encoding `requests` decodes `response.text` with: the header's charset, ISO-8859-1 for text/* without
  one (RFC 2616), else UTF-8 (requests would guess)."""
  m = re.search(r"charset=([\w.:-]+)", content_type, re.I)
  if m:
    return m.group(1).strip("'\"")
  return "ISO-8859-1" if "text" in content_type else "utf-8"


def fetch_page_text(url: str, *, timeout_s: float = FETCH_TIMEOUT_S) -> str:
  """`extract_text_from_url(url)`: the page's visible text (first 20,000 characters), a PDF's first 600 words, or
  the official error text ("HTTP error occurred: ...", "Error: Connection error occurred", "Error: Request timed
  out after 20 seconds", "Unexpected error: ..."); a PDF that cannot be read gives "Error: ..." (its own text, as
  `extract_pdf_text`). Raises ImportError for a PDF when pdfplumber is not installed."""
  from aepo_jax.tools._http import http_request

  headers = {}
  try:
    status, body = http_request(
      "GET", url, headers=FETCH_HEADERS, timeout_s=timeout_s, max_bytes=64 << 20, response_headers=headers
    )
  except TimeoutError:
    return "Error: Request timed out after 20 seconds"
  except ValueError as e:  # larger than max_bytes
    return f"Unexpected error: {e}"
  except OSError:
    return "Error: Connection error occurred"
  if status >= 400:
    return f"HTTP error occurred: {status} Error for url: {url}"
  content_type = headers.get("content-type", "")
  if "pdf" in content_type:
    try:
      return pdf_text(body)
    except ImportError:
      raise
    except Exception as e:  # noqa: BLE001 -- the official returns any reader failure as the page's text
      return f"Error: {e}"
  try:
    return visible_text(body.decode(_charset(content_type), errors="replace"))[:PAGE_CHARS]
  except LookupError as e:  # an unknown charset
    return f"Unexpected error: {e}"
