"""Rate-limited, retrying HTTP GETs to one host from inside a Spark task.

Contract: ``HostFetcher(base_url, cfg, share)`` — ``share`` is this task's fraction of the host's
global limits. ``get(path, params) -> FetchResult`` never raises for network/protocol trouble: a
failure is a ``FetchError`` with a snake_case ``reason`` (``ssrf_<reason>``, ``timeout``,
``connect_error``, ``http_<status>``, ``too_large``, ``repo_not_found``, ``repo_takendown``,
``repo_suspended``, ``repo_deactivated``, ``rate_limited``). 5xx, 429, timeouts and connection
errors are retried ``cfg.retries`` times with exponential backoff; other 4xx are final.
"""

from __future__ import annotations

import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from firehose import ratelimit
from firehose.backoff import backoff_delay
from mst.errors import ReasonError
from spark.config import FetchConfig
from spark.ssrf import SsrfError, check_url, pinned_transport

#: XRPC error names that mean "this repository is not available" rather than a host fault.
REPO_ERRORS = {
    "RepoNotFound": "repo_not_found",
    "RepoTakendown": "repo_takendown",
    "RepoSuspended": "repo_suspended",
    "RepoDeactivated": "repo_deactivated",
}


class FetchError(ReasonError):
    """A failed fetch; ``reason`` is a snake_case label."""


@dataclass(slots=True)
class FetchResult:
    status: int
    content: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        import json

        return json.loads(self.content)


class TokenBucket:
    """Thread-safe, blocking: ``acquire()`` blocks until a token is available. One
    :class:`firehose.ratelimit.TokenBucket` (``rate`` at least 0.001/s; ``burst`` defaults to
    ``max(1, rate)``) behind a ``threading.Lock``; the sleep happens outside the lock and the
    check is repeated after it."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        rate = max(rate, 0.001)
        self.bucket = ratelimit.TokenBucket(rate, burst if burst is not None else max(1.0, rate))
        self.lock = threading.Lock()

    def acquire(self) -> None:
        while True:
            with self.lock:
                wait = self.bucket.delay()
                if wait <= 0:
                    self.bucket.take()
                    return
            time.sleep(wait)


_SSL_CONTEXT: ssl.SSLContext | None = None
_SSL_LOCK = threading.Lock()


def shared_ssl_context() -> ssl.SSLContext:
    """One verifying TLS context per process: building one loads the CA bundle (~0.1 s), which
    would otherwise be paid for every host in every task."""
    global _SSL_CONTEXT
    with _SSL_LOCK:
        if _SSL_CONTEXT is None:
            try:
                import certifi

                _SSL_CONTEXT = ssl.create_default_context(cafile=certifi.where())
            except ImportError:  # pragma: no cover - certifi comes with httpx
                _SSL_CONTEXT = ssl.create_default_context()
        return _SSL_CONTEXT


def base_url_for(host: str, scheme: str) -> str:
    """``host`` may be a bare host name (``pds.example:443``) or already a URL."""
    if host.startswith(("http://", "https://")):
        return host.rstrip("/")
    return f"{scheme}://{host}"


class HostFetcher:
    """GETs against one host with this task's share of its rate and concurrency limits."""

    def __init__(self, base_url: str, cfg: FetchConfig, share: float = 1.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.cfg = cfg
        self.concurrency = max(1, int(cfg.host_concurrency * share))
        self.bucket = TokenBucket(cfg.host_rate * share)
        self.slots = threading.BoundedSemaphore(self.concurrency)
        self.client = httpx.Client(
            timeout=cfg.timeout_s,
            headers={"user-agent": cfg.user_agent},
            follow_redirects=False,
            transport=pinned_transport(shared_ssl_context(), self.concurrency, cfg.allow_private),
            trust_env=False,  # no proxy from the environment: it would connect in our place
        )
        self.ssrf_error: SsrfError | None = None
        try:
            check_url(self.base_url, cfg.allow_private)
        except SsrfError as exc:
            self.ssrf_error = exc

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> HostFetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, path: str, params: dict[str, str] | None = None, max_bytes: int | None = None) -> FetchResult:
        """GET ``base_url + path``; see the module docstring for errors and retries."""
        if self.ssrf_error is not None:
            raise FetchError(f"ssrf_{self.ssrf_error.reason}", self.base_url)
        limit = max_bytes or self.cfg.max_repo_bytes
        last: FetchError | None = None
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                time.sleep(backoff_delay(attempt - 1, self.cfg.backoff_s))
            self.bucket.acquire()
            with self.slots:
                try:
                    result = self._once(path, params, limit)
                except FetchError as exc:
                    last = exc
                    if exc.reason in ("timeout", "connect_error", "rate_limited", "read_error") or (
                        exc.reason.startswith("http_5")
                    ):
                        continue
                    raise
            return result
        assert last is not None
        raise last

    def _once(self, path: str, params: dict[str, str] | None, limit: int) -> FetchResult:
        url = self.base_url + path
        try:
            with self.client.stream("GET", url, params=params) as resp:
                declared = resp.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > limit:
                    raise FetchError("too_large", declared)
                chunks: list[bytes] = []
                size = 0
                for chunk in resp.iter_bytes():
                    size += len(chunk)
                    if size > limit:
                        raise FetchError("too_large", str(size))
                    chunks.append(chunk)
                body = b"".join(chunks)
                status = resp.status_code
                headers = dict(resp.headers)
        except SsrfError as exc:  # the address changed to a refused one since check_url
            raise FetchError(f"ssrf_{exc.reason}", url) from exc
        except httpx.TimeoutException as exc:
            raise FetchError("timeout", url) from exc
        except httpx.ConnectError as exc:
            raise FetchError("connect_error", url) from exc
        except httpx.HTTPError as exc:
            raise FetchError("read_error", f"{url}: {exc}") from exc
        if status == 429:
            raise FetchError("rate_limited", url)
        if status >= 400:
            raise FetchError(_error_reason(status, body), url)
        return FetchResult(status, body, headers)


def _error_reason(status: int, body: bytes) -> str:
    try:
        import json

        name = json.loads(body).get("error")
    except (ValueError, AttributeError):
        name = None
    if isinstance(name, str) and name in REPO_ERRORS:
        return REPO_ERRORS[name]
    return f"http_{status}"
