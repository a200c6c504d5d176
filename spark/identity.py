"""DID → (signing key, PDS endpoint) for executors, without the relay's web package.

Contract: ``IdentityClient(cfg).resolve(did) -> ResolvedIdentity`` or ``IdentityError(reason)``
with reasons ``unsupported_did_method``, ``did_not_found``, ``bad_did_document``,
``no_signing_key`` and the fetch reasons of ``spark.fetch``. did:plc goes to
``cfg.plc_url``; did:web to ``https://<host>/.well-known/did.json`` (SSRF-checked like any host).
Results are cached for the lifetime of the client (one Spark task).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from mst.errors import ReasonError
from spark.config import FetchConfig
from spark.fetch import FetchError, HostFetcher


class IdentityError(ReasonError):
    """``reason`` is a snake_case label."""


@dataclass(frozen=True, slots=True)
class ResolvedIdentity:
    did: str
    signing_key: str  # did:key:…
    pds: str | None


def parse_did_document(did: str, doc: Any) -> ResolvedIdentity:
    """Extract the ``#atproto`` signing key and ``#atproto_pds`` endpoint (``relay.identity``'s
    pure parser; its reasons ``bad_did_document`` / ``no_signing_key`` are kept)."""
    from relay.identity import IdentityError as RelayIdentityError
    from relay.identity import parse_did_document as parse

    try:
        ident = parse(did, doc)
    except RelayIdentityError as exc:
        raise IdentityError(getattr(exc, "reason", "bad_did_document"), did) from exc
    return ResolvedIdentity(did, ident.signing_key, ident.pds)


class IdentityClient:
    """Resolves DIDs for one task; keeps one fetcher per identity host."""

    def __init__(self, cfg: FetchConfig) -> None:
        self.cfg = cfg
        self.cache: dict[str, ResolvedIdentity | IdentityError] = {}
        self.fetchers: dict[str, HostFetcher] = {}
        self.lock = threading.Lock()

    def _fetcher(self, base: str) -> HostFetcher:
        with self.lock:
            if base not in self.fetchers:
                self.fetchers[base] = HostFetcher(base, self.cfg)
            return self.fetchers[base]

    def close(self) -> None:
        for fetcher in self.fetchers.values():
            fetcher.close()

    def resolve(self, did: str) -> ResolvedIdentity:
        cached = self.cache.get(did)
        if cached is None:
            try:
                cached = self._resolve(did)
            except IdentityError as exc:
                cached = exc
            self.cache[did] = cached
        if isinstance(cached, IdentityError):
            raise cached
        return cached

    def _resolve(self, did: str) -> ResolvedIdentity:
        if did.startswith("did:plc:"):
            base, path = self.cfg.plc_url, "/" + did
        elif did.startswith("did:web:"):
            host = unquote(did[len("did:web:"):])
            if ":" in did[len("did:web:"):] or not host:
                raise IdentityError("unsupported_did_method", did)
            base, path = f"https://{host}", "/.well-known/did.json"
        else:
            raise IdentityError("unsupported_did_method", did)
        try:
            result = self._fetcher(base).get(path, max_bytes=256 * 1024)
        except FetchError as exc:
            reason = "did_not_found" if exc.reason in ("http_404", "http_410") else exc.reason
            raise IdentityError(reason, did) from exc
        try:
            doc = result.json()
        except ValueError as exc:
            raise IdentityError("bad_did_document", did) from exc
        return parse_did_document(did, doc)
