"""A JSON-over-HTTP call that never hangs: per-attempt timeout, bounded retries with backoff, a concurrency cap."""
import json
import logging
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from aepo_jax.tools._search import SearchError

log = logging.getLogger(__name__)
_RETRY_STATUS = (429, 500, 502, 503, 504)


class JsonClient:
    """Sends JSON requests with `timeout_s` per attempt and at most `retries` extra attempts.

    Connection errors, timeouts, 429 and 5xx are retried after backoff_s * 2**attempt (+ jitter); other HTTP
    errors fail at once. At most `max_concurrency` requests are in flight; waiting for a slot also times out.
    """

    def __init__(self, timeout_s: float = 10.0, retries: int = 3, backoff_s: float = 0.5, max_concurrency: int = 16):
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self.stats = {"requests": 0, "retries": 0, "failures": 0}
        self._lock = threading.Lock()

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def request(self, method: str, url: str, *, params: dict | None = None, body: dict | None = None,
                headers: dict | None = None) -> dict:
        if params:
            url = url + ("&" if "?" in url else "?") + urllib.parse.urlencode(params)
        data = json.dumps(body).encode() if body is not None else None
        hdrs = {"Accept": "application/json", **(headers or {})}
        if data is not None:
            hdrs["Content-Type"] = "application/json"
        last_error = None
        for attempt in range(self.retries + 1):
            if attempt:
                self._count("retries")
                time.sleep(self.backoff_s * 2 ** (attempt - 1) * (1 + 0.1 * random.random()))
            if not self._slots.acquire(timeout=self.timeout_s * (self.retries + 1)):
                last_error = TimeoutError("no free request slot (concurrency cap reached)")
                continue
            try:
                self._count("requests")
                req = urllib.request.Request(url, data=data, headers=hdrs, method=method)
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    payload = resp.read()
                return json.loads(payload)
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode(errors="replace")
                last_error = SearchError(f"{method} {url.split('?')[0]} returned HTTP {e.code}: {detail}")
                if e.code not in _RETRY_STATUS:
                    break
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last_error = e
            except json.JSONDecodeError as e:
                last_error = SearchError(f"{method} {url.split('?')[0]} returned invalid JSON: {e}")
                break
            finally:
                self._slots.release()
            log.info("attempt %d/%d of %s %s failed: %s", attempt + 1, self.retries + 1, method, url, last_error)
        self._count("failures")
        if isinstance(last_error, SearchError):
            raise last_error
        raise SearchError(f"{method} {url.split('?')[0]} failed after {self.retries + 1} attempts "
                          f"(timeout {self.timeout_s:g} s each): {last_error}")
