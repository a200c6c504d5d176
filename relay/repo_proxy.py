"""``com.atproto.sync.getRepo`` served by the relay (``RELAY_GETREPO_PROXY``; off: a 302 to the PDS).

A relay that announces a ``#sync`` (or a consumer resync storm) would otherwise send every
consumer to the account's PDS at once (I-D §4.6: a direct upstream MAY coalesce and cache snapshot
requests). ``RepoProxy.get(did, since, known_rev=…)``:

* **one fetch per repository at a time**: concurrent requests for the same ``(did, since)`` share
  one upstream fetch (a task of its own, so a requester that goes away does not cancel it for the
  others); at most ``max_fetches`` different repositories are fetched at once;
* **verified before it is served**: without ``since``, the whole CAR (``mst.verify.verify_repo_car``:
  the root is the account's signed commit, every block's hash, the full tree, every record); with
  ``since`` (a partial CAR, passed through to the PDS) every block's hash, the root commit, its DID
  and signature. A bad signature re-resolves the identity once (a key rotation). A CAR that fails
  is refused (``RepoRefused``, answered 502) and never cached;
* **a small cache**, bounded in bytes (LRU; a CAR over a quarter of the budget is served, not
  cached); an entry is used only while its rev is not older than the rev the relay holds for the
  account (``known_rev``), so the cache never serves a repository older than the stream;
* **fallback**: a PDS that cannot be reached, answers an error, or sends more than the budget →
  ``RepoUnavailable``, which the caller answers with the usual 302 to the PDS.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass

import httpx

from mst.car import read_car
from mst.commit import decode_commit, verify_commit_sig
from mst.crypto import parse_did_key
from mst.errors import ReasonError
from mst.verify import verify_repo_car
from relay.identity import IdentityError, IdentityResolver
from relay.jsonlog import fields
from relay.metrics import RelayMetrics
from relay.ssrf import SafeClient, SSRFError

log = logging.getLogger("relay.repo_proxy")

GET_REPO = "/xrpc/com.atproto.sync.getRepo"


class RepoFetchError(ReasonError):
    """A repository could not be fetched from its PDS; ``reason`` is a metric label."""

    show_reason = False


class RepoUnavailable(RepoFetchError):
    """The PDS could not be asked or did not answer with a CAR: redirect the client there."""


class RepoRefused(RepoFetchError):
    """The PDS answered a CAR that failed verification: not served, not cached."""


async def fetch_repo_car(safe: SafeClient, pds: str, did: str, *, since: str | None = None,
                         max_bytes: int) -> bytes:
    """``getRepo`` from ``pds`` through the SSRF-checked client; raises ``RepoUnavailable``."""
    params = {"did": did, **({"since": since} if since else {})}
    try:
        status, car, _ = await safe.get(pds.rstrip("/") + GET_REPO, max_bytes=max_bytes, params=params)
    except SSRFError as exc:
        raise RepoUnavailable(exc.reason, str(exc)) from None
    except httpx.HTTPError as exc:
        raise RepoUnavailable("fetch_failed", type(exc).__name__) from None
    if status != 200:
        raise RepoUnavailable("fetch_failed", f"getRepo answered HTTP {status}")
    return car


def verify_served_car(car: bytes, did: str, signing_key: str, since: str | None) -> str:
    """Verify a ``getRepo`` answer (see the module docstring); returns its rev. Raises a
    ``ReasonError`` (``commit_bad_signature`` for a signature that does not verify)."""
    if since is None:
        return verify_repo_car(car, did, signing_key).commit.rev
    parsed = read_car(car)
    block = parsed.blocks.get(parsed.roots[0])
    if block is None:
        raise RepoRefused("commit_missing", "commit block not in CAR")
    commit = decode_commit(block)
    if commit.did != did:
        raise RepoRefused("commit_did_mismatch", "commit is for another DID")
    if not verify_commit_sig(commit, parse_did_key(signing_key)):
        raise RepoRefused("commit_bad_signature", "signature does not verify")
    return commit.rev


@dataclass(frozen=True, slots=True)
class VerifiedCar:
    car: bytes
    rev: str


class CarCache:
    """LRU of verified CARs bounded by their total size."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._data: OrderedDict[tuple[str, str | None], VerifiedCar] = OrderedDict()

    def get(self, key: tuple[str, str | None]) -> VerifiedCar | None:
        found = self._data.get(key)
        if found is not None:
            self._data.move_to_end(key)
        return found

    def put(self, key: tuple[str, str | None], value: VerifiedCar) -> None:
        if len(value.car) * 4 > self.max_bytes:
            return
        old = self._data.pop(key, None)
        if old is not None:
            self.bytes -= len(old.car)
        self._data[key] = value
        self.bytes += len(value.car)
        while self.bytes > self.max_bytes:
            _, evicted = self._data.popitem(last=False)
            self.bytes -= len(evicted.car)


class RepoProxy:
    """See the module docstring."""

    def __init__(self, *, identity: IdentityResolver, safe: SafeClient, metrics: RelayMetrics,
                 cache_bytes: int, max_fetches: int = 4) -> None:
        self.identity = identity
        self.safe = safe
        self.metrics = metrics
        self.max_repo_bytes = cache_bytes
        self._cache = CarCache(cache_bytes)
        self._inflight: dict[tuple[str, str | None], asyncio.Task[VerifiedCar]] = {}
        self._slots = asyncio.Semaphore(max_fetches)

    async def get(self, did: str, pds: str, *, since: str | None, known_rev: str | None) -> VerifiedCar:
        """The verified repository of ``did`` (from ``pds``, or the cache, or a fetch already
        under way). Raises ``RepoUnavailable`` / ``RepoRefused``."""
        key = (did, since)
        cached = self._cache.get(key)
        if cached is not None and known_rev is not None and cached.rev >= known_rev:
            self.metrics.getrepo.labels(result="cache_hit").inc()
            return cached
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.create_task(self._fetch(did, pds, since), name=f"getRepo:{did}")
            self._inflight[key] = task
            task.add_done_callback(lambda t: self._finished(key, t))
            self.metrics.getrepo.labels(result="fetch").inc()
        else:
            self.metrics.getrepo.labels(result="coalesced").inc()
        return await asyncio.shield(task)

    def _finished(self, key: tuple[str, str | None], task: asyncio.Task[VerifiedCar]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled() and task.exception() is None:
            self._cache.put(key, task.result())

    async def _fetch(self, did: str, pds: str, since: str | None) -> VerifiedCar:
        async with self._slots:
            try:
                car = await fetch_repo_car(self.safe, pds, did, since=since, max_bytes=self.max_repo_bytes)
                rev = await self._verify(did, car, since)
            except RepoFetchError as exc:
                self.metrics.getrepo_fetches.labels(result=exc.reason).inc()
                log.info("getRepo fetch not served", extra=fields(did=did, reason=exc.reason, error=exc.message))
                raise
        self.metrics.getrepo_fetches.labels(result="ok").inc()
        return VerifiedCar(car, rev)

    async def _verify(self, did: str, car: bytes, since: str | None) -> str:
        for fresh in (False, True):  # a bad signature may be a key rotation: re-resolve once
            try:
                key = (await self.identity.resolve(did, fresh=fresh)).signing_key
            except IdentityError as exc:
                raise RepoUnavailable(f"identity_{exc.reason}", str(exc)) from None
            try:
                return await asyncio.to_thread(verify_served_car, car, did, key, since)
            except Exception as exc:  # every verification failure below mst is a typed ReasonError
                reason = exc.reason if isinstance(exc, ReasonError) else "verify_failed"
                if reason == "commit_bad_signature" and not fresh:
                    continue
                raise RepoRefused(reason, str(exc)[:300]) from None
        raise AssertionError("unreachable")
