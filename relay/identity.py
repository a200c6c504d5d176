"""Identity resolution: DID → signing key (did:key), PDS endpoint and claimed handle.

* ``did:plc`` documents come from the configured PLC directory (``RELAY_PLC_URL``, an operator
  setting, so not SSRF-checked); ``did:web`` documents from ``https://<domain>/.well-known/did.json``
  through the SSRF-checked client.
* ``parse_did_document`` is pure: it finds the ``#atproto`` verification method in its current
  (``Multikey``) and legacy (``EcdsaSecp256k1VerificationKey2019`` / ``…r1…``) forms, the
  ``#atproto_pds`` service endpoint and the first ``at://`` handle.
* Results are cached behind ``IdentityCache`` (bounded LRU+TTL in process, or Redis for
  scale-out) and persisted in the database (``relay.identity_store``: read through on a cache
  miss, so a restarted relay or a new replica does not resolve known accounts again); purged on
  ``#identity``, re-resolved once on a signature failure (``fresh``) and when older than
  ``stale_after`` (RELAY_IDENTITY_MAX_AGE). Network resolutions are rate-limited (token bucket)
  and concurrent resolutions of one DID are coalesced.
* ``verify_handle(handle, did)`` checks that the handle resolves back to the DID: via a
  ``resolveHandle`` service when configured; else the DNS TXT record ``_atproto.<handle>``
  (``did=<did>``, the spec's preferred method; a DNS answer naming another DID is final) and,
  when DNS has no answer, ``https://<handle>/.well-known/atproto-did``.

Failures raise ``IdentityError`` with a ``reason`` from ``REASONS``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote, unquote, urlencode, urlsplit

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver
import httpx

from backfill.identities import Identity as Identity  # re-exported: the resolver's result type
from firehose import ratelimit
from firehose.lru import BoundedLRU
from mst.errors import ReasonError
from relay.keepalive import HttpError, KeepAliveClient
from relay.metrics import RelayMetrics
from relay.ssrf import SafeClient, SSRFError

if TYPE_CHECKING:
    from relay.identity_store import PersistedIdentities

log = logging.getLogger("relay.identity")

REASONS = (
    "bad_did",
    "did_not_found",
    "bad_did_document",
    "no_signing_key",
    "resolution_failed",
    "rate_limited",
)

#: failures that say nothing about the document (the directory did not answer): a stored identity
#: past its age may still be used (see ``IdentityResolver.resolve``)
UNREACHABLE = ("resolution_failed", "rate_limited")
#: default ``stale_after``: a persisted identity older than this is resolved again (RELAY_IDENTITY_MAX_AGE)
DEFAULT_MAX_AGE = 24 * 3600.0

LEGACY_KEY_TYPES = ("EcdsaSecp256k1VerificationKey2019", "EcdsaSecp256r1VerificationKey2019")
MAX_DOC_BYTES = 64 * 1024


#: ``name -> TXT record strings`` (empty when the name has none); raises on lookup failure
TxtLookup = Callable[[str], Awaitable[list[str]]]


def dns_txt_lookup(nameservers: list[tuple[str, int]] | None = None, timeout: float = 3.0) -> TxtLookup | None:
    """A TXT lookup over DNS (dnspython): ``nameservers`` or the system's ``/etc/resolv.conf``.
    ``None`` when there is no resolver configuration at all (the DNS method is then skipped)."""
    try:
        resolver = dns.asyncresolver.Resolver(configure=not nameservers)
    except dns.resolver.NoResolverConfiguration:
        log.warning("no DNS resolver configured: handles are verified over HTTPS only")
        return None
    if nameservers:
        resolver.nameservers = [dns.nameserver.Do53Nameserver(a, p) for a, p in nameservers]
    resolver.lifetime = timeout

    async def lookup(name: str) -> list[str]:
        try:
            answer = await resolver.resolve(name, "TXT", search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        return [b"".join(rdata.strings).decode("utf-8", "replace") for rdata in answer]

    return lookup


def did_from_txt(records: list[str]) -> str | None:
    """The DID named by ``_atproto`` TXT records: values starting ``did=``, others ignored; none,
    or several different DIDs (ambiguous, per the handle spec), give ``None``."""
    dids = {r[4:].strip() for r in records if r.startswith("did=")}
    return dids.pop() if len(dids) == 1 else None


class IdentityError(ReasonError):
    """A DID could not be resolved to a usable identity; ``str(exc)`` is the message alone."""

    show_reason = False


def _matches_fragment(entry_id: object, did: str, fragment: str) -> bool:
    return isinstance(entry_id, str) and entry_id in (f"#{fragment}", f"{did}#{fragment}")


def _signing_key_from(method: dict[str, Any]) -> str:
    from mst import crypto  # lazy: the repository core is only needed when a document is parsed

    key_type = method.get("type")
    multibase = method.get("publicKeyMultibase")
    if not isinstance(multibase, str) or not multibase.startswith("z"):
        raise IdentityError("no_signing_key", "verification method without publicKeyMultibase")
    try:
        if key_type == "Multikey":
            did_key = "did:key:" + multibase
            crypto.parse_did_key(did_key)
            return did_key
        if key_type in LEGACY_KEY_TYPES:
            return crypto.parse_multibase_key(key_type, multibase).did_key()
    except IdentityError:
        raise
    except Exception as exc:  # the key codec's typed errors all mean "unusable key"
        raise IdentityError("no_signing_key", f"unusable #atproto key: {exc}") from None
    raise IdentityError("no_signing_key", f"unsupported key type {key_type!r}")


def parse_did_document(did: str, doc: object) -> Identity:
    """Extract the identity from a DID document (pure). Raises ``IdentityError``."""
    if not isinstance(doc, dict):
        raise IdentityError("bad_did_document", "DID document is not an object")
    if doc.get("id") != did:
        raise IdentityError("bad_did_document", "DID document id does not match the DID")
    methods = doc.get("verificationMethod") or []
    if not isinstance(methods, list):
        raise IdentityError("bad_did_document", "verificationMethod is not a list")
    signing_key = None
    for method in methods:
        if isinstance(method, dict) and _matches_fragment(method.get("id"), did, "atproto"):
            signing_key = _signing_key_from(method)
            break
    if signing_key is None:
        raise IdentityError("no_signing_key", "no #atproto verification method")
    pds = None
    services = doc.get("service") or []
    if isinstance(services, list):
        for service in services:
            if (isinstance(service, dict) and _matches_fragment(service.get("id"), did, "atproto_pds")
                    and service.get("type") == "AtprotoPersonalDataServer"):
                endpoint = service.get("serviceEndpoint")
                if isinstance(endpoint, str) and urlsplit(endpoint).scheme in ("https", "http"):
                    pds = endpoint.rstrip("/")
                break
    handle = None
    aka = doc.get("alsoKnownAs") or []
    if isinstance(aka, list):
        for entry in aka:
            if isinstance(entry, str) and entry.startswith("at://"):
                handle = entry[5:].lower()
                break
    return Identity(did=did, signing_key=signing_key, pds=pds, handle=handle)


def did_web_url(did: str) -> str:
    """``did:web:example.com`` → ``https://example.com/.well-known/did.json`` (no paths allowed)."""
    rest = did[len("did:web:"):]
    if not rest or ":" in rest:
        raise IdentityError("bad_did", "did:web must be a bare domain (no path, port-encoded only)")
    host = unquote(rest).lower()
    if "/" in host or not host:
        raise IdentityError("bad_did", "bad did:web domain")
    scheme = "http" if host.startswith(("localhost", "127.0.0.1")) else "https"
    return f"{scheme}://{host}/.well-known/did.json"


class IdentityCache(Protocol):
    """Where resolved identities are kept between resolutions."""

    async def get(self, did: str) -> Identity | None: ...

    async def put(self, identity: Identity) -> None: ...

    async def purge(self, did: str) -> None: ...


class MemoryIdentityCache:
    """Bounded in-process LRU with a time-to-live per entry."""

    def __init__(self, max_entries: int = 100_000, ttl: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl = ttl
        self.clock = clock
        self._entries: BoundedLRU[str, tuple[float, Identity]] = BoundedLRU(max_entries)

    async def get(self, did: str) -> Identity | None:
        item = self._entries.get(did)
        if item is None:
            return None
        expires, identity = item
        if expires < self.clock():
            self._entries.pop(did)
            return None
        return identity

    async def put(self, identity: Identity) -> None:
        self._entries.put(identity.did, (self.clock() + self.ttl, identity))

    async def purge(self, did: str) -> None:
        self._entries.pop(did, None)

    def get_nowait(self, did: str) -> Identity | None:
        """What :meth:`get` returns, without a coroutine (the per-commit look-up)."""
        item = self._entries.get(did)
        if item is None:
            return None
        if item[0] < self.clock():
            self._entries.pop(did)
            return None
        return item[1]

    def __len__(self) -> int:
        return len(self._entries)


class RedisIdentityCache:
    """Identity cache shared by every relay process through Redis (``SETEX`` JSON values), with an
    in-process cache in front. Redis being unreachable never fails a lookup: reads fall back to
    the local copy (then to a fresh resolution), writes and purges still reach the local copy,
    and the outage is logged once (``degraded``) until Redis answers again — so a Redis outage
    costs DID resolutions, never events."""

    def __init__(self, redis: Any, ttl: float = 3600.0, prefix: str = "relay:identity:",
                 local: MemoryIdentityCache | None = None) -> None:
        self.redis = redis
        self.ttl = ttl
        self.prefix = prefix
        self.local = local if local is not None else MemoryIdentityCache(ttl=ttl)
        self.degraded = False

    def _failed(self, exc: Exception) -> None:
        if not self.degraded:
            log.warning("identity cache: Redis unavailable, using the in-process cache",
                        extra={"error": f"{type(exc).__name__}: {exc}"[:200]})
        self.degraded = True

    def _ok(self) -> None:
        if self.degraded:
            log.info("identity cache: Redis available again")
        self.degraded = False

    async def get(self, did: str) -> Identity | None:
        try:
            raw = await self.redis.get(self.prefix + did)
        except Exception as exc:
            self._failed(exc)
            return await self.local.get(did)
        self._ok()
        if raw is None:  # Redis, when it answers, is the shared truth (another process may have purged)
            await self.local.purge(did)
            return None
        try:
            identity = Identity(**json.loads(raw))
        except (ValueError, TypeError):
            return None
        await self.local.put(identity)
        return identity

    async def put(self, identity: Identity) -> None:
        await self.local.put(identity)
        try:
            await self.redis.set(self.prefix + identity.did, json.dumps(asdict(identity)),
                                 ex=max(1, int(self.ttl)))
        except Exception as exc:
            self._failed(exc)
        else:
            self._ok()

    async def purge(self, did: str) -> None:
        await self.local.purge(did)
        try:
            await self.redis.delete(self.prefix + did)
        except Exception as exc:
            self._failed(exc)
        else:
            self._ok()


def identity_concurrency(rate: int) -> int:
    """DID resolutions in flight for a rate limit of ``rate`` per second: enough that the rate,
    not the concurrency, bounds throughput against a directory with a slow tail (by Little's law,
    ``rate`` × a mean latency of 0.5 s), at least 64 and at most 256."""
    return min(256, max(64, rate // 2))


class TokenBucket:
    """At most ``rate`` acquisitions per second on average, bursts up to ``burst``: one
    :class:`firehose.ratelimit.TokenBucket`. Unlike ``firehose.ratelimit.RateLimiter`` (pure
    backpressure), callers are served FIFO (one at a time sleeps, holding a lock) and a wait
    longer than ``max_wait`` is refused rather than waited out."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._bucket = ratelimit.TokenBucket(rate, burst)
        self._lock = asyncio.Lock()

    async def acquire(self, max_wait: float = 30.0) -> None:
        """Wait for a token; raise ``IdentityError('rate_limited')`` past ``max_wait`` seconds."""
        async with self._lock:
            wait = self._bucket.delay()
            if wait > 0:
                if wait > max_wait:
                    raise IdentityError("rate_limited", "identity resolution rate limit")
                await asyncio.sleep(wait)
                self._bucket.refill()
            self._bucket.take()


class IdentityResolver:
    """Resolves DIDs with caching, persistence, coalescing and rate limiting.

    Lookup order: ``cache`` (memory, or Redis with memory in front), then ``persisted`` (the
    database, when given), then the network. An identity fetched more than ``stale_after``
    seconds ago (wall clock; 0 = never) is resolved again; if the directory cannot be reached
    (``UNREACHABLE``) the old identity is still used (counted ``stale_served``), because its
    key and PDS are checked on every event anyway — a rotated key fails the signature and is
    resolved fresh, a moved account fails host binding and is resolved fresh — while refusing it
    would reject every event of the account for as long as the directory is down."""

    def __init__(self, *, plc_url: str, safe_client: SafeClient, cache: IdentityCache | None = None,
                 metrics: RelayMetrics | None = None, rate: float = 50.0, burst: int = 100,
                 handle_resolver_url: str = "", timeout: float = 10.0, concurrency: int = 64,
                 txt_lookup: TxtLookup | None = None, persisted: PersistedIdentities | None = None,
                 stale_after: float = DEFAULT_MAX_AGE, clock: Callable[[], float] = time.time,
                 handle_concurrency: int = 64, handle_timeout: float = 10.0, handle_negative_ttl: float = 60.0) -> None:
        """``txt_lookup`` enables the DNS TXT handle method (see :func:`dns_txt_lookup`);
        ``clock`` is the wall clock of ``Identity.fetched_at``. ``concurrency``: DID resolutions in
        flight at once (64: by Little's law, 16 in flight against a directory answering in ~0.2 s on
        average caps first sight near 80 accounts/s, far below the ``rate`` politeness limit, which
        is what bench/weather.py's 100,000 first-seen accounts showed). Handle checks have their own
        bound (``handle_concurrency`` at once, each given up after ``handle_timeout`` seconds), so
        slow handle domains never hold DID resolution; a failed check is remembered for
        ``handle_negative_ttl`` seconds."""
        self.plc_url = plc_url.rstrip("/")
        self.txt_lookup = txt_lookup
        self.safe = safe_client
        self.cache = cache if cache is not None else MemoryIdentityCache()
        self.persisted = persisted
        self.stale_after = stale_after
        self.clock = clock
        self.metrics = metrics
        self.bucket = TokenBucket(rate, burst)
        self.handle_resolver_url = handle_resolver_url.rstrip("/")
        #: the PLC directory (the hot path: see ``relay.keepalive``)
        self._plc = KeepAliveClient(self.plc_url, max_connections=concurrency, timeout=timeout)
        #: the handle resolver service (``handle_resolver_url``)
        #: the handle resolver service (``handle_resolver_url``): the same small keep-alive client as
        #: the directory, as many connections as handle checks may run at once (through httpx, a
        #: check cost ~45 % of the main process in a profile of bench/weather.py at 1,000 hosts)
        self._resolver = (KeepAliveClient(self.handle_resolver_url, max_connections=handle_concurrency,
                                          timeout=timeout) if self.handle_resolver_url else None)
        #: bounds requests in flight (httpx's pool does O(n²) work with many queued requests)
        self._network = asyncio.Semaphore(concurrency)
        self._inflight: dict[str, asyncio.Future[Identity]] = {}
        #: did → when this process last resolved it from the network
        self._resolved_at: BoundedLRU[str, float] = BoundedLRU(100_000)
        #: (handle, did) → expiry of a successful bidirectional check
        self._handles_ok: BoundedLRU[tuple[str, str], float] = BoundedLRU(100_000)
        self.handle_ttl = 60.0
        #: (handle, did) → expiry of a failed check
        self._handles_bad: BoundedLRU[tuple[str, str], float] = BoundedLRU(100_000)
        self.handle_negative_ttl = handle_negative_ttl
        self.handle_timeout = handle_timeout
        self._handle_slots = asyncio.Semaphore(handle_concurrency)
        self._handle_checks: dict[tuple[str, str], asyncio.Task[bool]] = {}
        self._hits: Any = None  # ``relay_identity_cache_total{result="hit"}`` (``cached``)

    async def aclose(self) -> None:
        checks = list(self._handle_checks.values())
        for task in checks:
            task.cancel()
        if checks:
            await asyncio.wait(checks, timeout=1.0)
        await self._plc.aclose()
        if self._resolver is not None:
            await self._resolver.aclose()

    def _count(self, metric: str, result: str) -> None:
        if self.metrics is not None:
            self.metrics.child(getattr(self.metrics, metric), result).inc()

    def _young(self, identity: Identity) -> bool:
        """Fetched less than ``stale_after`` ago (an identity of unknown age counts as young)."""
        return (self.stale_after <= 0 or identity.fetched_at <= 0
                or self.clock() - identity.fetched_at < self.stale_after)

    def cached(self, did: str) -> Identity | None:
        """The identity :meth:`resolve` would return from the in-process cache (counted a
        ``hit``), without awaiting; None when that needs more than a memory read — not cached,
        too old, or the cache is shared through Redis (whose answer is the truth: another process
        may have purged it) — and then :meth:`resolve` decides. Every purge reaches it."""
        cache = self.cache
        if type(cache) is not MemoryIdentityCache:
            return None
        found = cache.get_nowait(did)
        if found is None or not self._young(found):
            return None
        if self.metrics is not None:
            hits = self._hits
            if hits is None:
                hits = self._hits = self.metrics.child(self.metrics.identity_cache, "hit")
            hits.inc()
        return found

    async def resolve(self, did: str, *, fresh: bool = False, max_age: float = 0.0) -> Identity:
        """The identity of ``did``; ``fresh`` bypasses (and refreshes) the caches, unless this
        process resolved it from the network less than ``max_age`` seconds ago."""
        if fresh and max_age > 0:
            stamp = self._resolved_at.peek(did)
            if stamp is not None and time.monotonic() - stamp < max_age:
                cached = await self.cache.get(did)
                if cached is not None:
                    self._count("identity_cache", "recent")
                    return cached
        stale = None
        if not fresh:
            cached = await self.cache.get(did)
            if cached is not None and self._young(cached):
                self._count("identity_cache", "hit")
                return cached
            stored = await self.persisted.get(did) if self.persisted is not None else None
            if stored is not None and self._young(stored):
                self._count("identity_cache", "stored")
                await self.cache.put(stored)
                return stored
            stale = stored or cached
            self._count("identity_cache", "stale" if stale is not None else "miss")
        try:
            return await self._resolve_coalesced(did)
        except IdentityError as exc:
            if stale is None or exc.reason not in UNREACHABLE:
                raise
            self._count("identity_cache", "stale_served")
            log.info("identity past its age used: the directory is unreachable",
                     extra={"fields": {"did": did, "fetched_at": stale.fetched_at, "reason": exc.reason}})
            return stale

    async def _resolve_coalesced(self, did: str) -> Identity:
        """One network resolution of ``did`` at a time (later callers share it); the result is
        cached and persisted, a DID the directory does not know is purged."""
        pending = self._inflight.get(did)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Identity] = asyncio.get_running_loop().create_future()
        self._inflight[did] = future
        try:
            identity = await self._resolve_network(did)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters (if any) re-raise it themselves
            if isinstance(exc, IdentityError) and exc.reason == "did_not_found":
                await self.purge(did)
            raise
        else:
            future.set_result(identity)
            await self.cache.put(identity)
            if self.persisted is not None:
                self.persisted.put(identity)
            self._resolved_at.put(did, time.monotonic())
            return identity
        finally:
            self._inflight.pop(did, None)

    async def purge(self, did: str) -> None:
        """Forget ``did``'s identity everywhere (its document changed): the next lookup resolves
        it from the network. Returns once the persisted row is purged (or queued, see
        ``PersistedIdentities.purge``)."""
        await self.cache.purge(did)
        if self.persisted is not None:
            await self.persisted.purge(did, self.clock())

    async def _resolve_network(self, did: str) -> Identity:
        await self.bucket.acquire()
        async with self._network:
            return await self._resolve_network_now(did)

    async def _resolve_network_now(self, did: str) -> Identity:
        started = self.clock()
        try:
            if did.startswith("did:plc:"):
                doc = await self._fetch_plc(f"/{quote(did, safe=':')}")
            elif did.startswith("did:web:"):
                doc = await self._fetch_safe(did_web_url(did))
            else:
                raise IdentityError("bad_did", f"unsupported DID method in {did!r}")
            identity = parse_did_document(did, doc)
        except IdentityError as exc:
            self._count("identity_resolutions", exc.reason)
            raise
        self._count("identity_resolutions", "ok")
        return replace(identity, fetched_at=started)

    async def _fetch_plc(self, target: str) -> object:
        url = self.plc_url + target
        try:
            status, body = await self._plc.get(target, max_bytes=MAX_DOC_BYTES)
        except HttpError as exc:
            raise IdentityError("resolution_failed", f"{url}: {exc}") from None
        if status in (404, 410):
            raise IdentityError("did_not_found", f"{url}: HTTP {status}")
        if status != 200:
            raise IdentityError("resolution_failed", f"{url}: HTTP {status}")
        try:
            return json.loads(body)
        except ValueError:
            raise IdentityError("bad_did_document", f"{url}: not JSON") from None

    async def _fetch_safe(self, url: str) -> object:
        try:
            status, body, _ = await self.safe.get(url, max_bytes=MAX_DOC_BYTES)
        except SSRFError as exc:
            raise IdentityError("resolution_failed", f"{url}: {exc.reason}") from None
        except httpx.HTTPError as exc:
            raise IdentityError("resolution_failed", f"{url}: {exc}") from None
        if status == 404:
            raise IdentityError("did_not_found", f"{url}: HTTP 404")
        if status != 200:
            raise IdentityError("resolution_failed", f"{url}: HTTP {status}")
        try:
            return json.loads(body)
        except ValueError:
            raise IdentityError("bad_did_document", f"{url}: not JSON") from None

    def handle_check(self, handle: str, did: str) -> asyncio.Future[bool]:
        """``verify_handle`` as a task, shared by every caller asking about the same pair while it
        runs (a caller may stop waiting for it without cancelling it for the others)."""
        key = (handle, did)
        running = self._handle_checks.get(key)
        if running is not None:
            return running
        task = asyncio.get_running_loop().create_task(self.verify_handle(handle, did), name=f"handle:{handle}")
        self._handle_checks[key] = task
        task.add_done_callback(lambda _: self._handle_checks.pop(key, None))
        return task

    async def resolve_handle(self, handle: str) -> str | None:
        """The DID ``handle`` names (``_handle_did``), only when that DID's document claims the
        handle back (bidirectional); None otherwise. For operator look-ups (not cached)."""
        handle = handle.strip().lower().lstrip("@")
        try:
            async with asyncio.timeout(self.handle_timeout):
                did, _ = await self._handle_did(handle)
        except TimeoutError:
            return None
        if did is None:
            return None
        try:
            ident = await self.resolve(did)
        except IdentityError:
            return None
        return did if ident.handle == handle else None

    async def verify_handle(self, handle: str, did: str) -> bool:
        """True when ``handle`` resolves back to ``did`` (bidirectional verification).

        Successful checks are remembered for ``handle_ttl`` seconds, failed ones for
        ``handle_negative_ttl``; a check that takes longer than ``handle_timeout`` fails."""
        key = (handle, did)
        now = time.monotonic()
        # A remembered outcome is recorded too: the identity may have been re-resolved (an
        # #identity purges it) since the check, and its new row must carry the outcome.
        expiry = self._handles_ok.peek(key)
        if expiry is not None and expiry > now:
            await self._record_handle_check(did, handle, True)
            return True
        failed_until = self._handles_bad.peek(key)
        if failed_until is not None and failed_until > now:
            self._count("handle_checks", "failed_cached")
            await self._record_handle_check(did, handle, False)
            return False
        try:
            async with asyncio.timeout(self.handle_timeout):
                ok = await self._check_handle(handle, did)
        except TimeoutError:
            self._count("handle_checks", "timeout")
            ok = False
        if ok:
            self._handles_ok.put(key, time.monotonic() + self.handle_ttl)
            self._handles_bad.pop(key, None)
        else:
            self._handles_bad.put(key, time.monotonic() + self.handle_negative_ttl)
        await self._record_handle_check(did, handle, ok)
        return ok

    async def _record_handle_check(self, did: str, handle: str, ok: bool) -> None:
        """Keep the outcome with the cached (and persisted) identity whose handle it checked."""
        ident = await self.cache.get(did)
        if ident is None or ident.handle != handle:
            return
        checked = replace(ident, handle_verified=ok, handle_checked_at=self.clock())
        await self.cache.put(checked)
        if self.persisted is not None:
            self.persisted.put(checked)

    async def _check_handle(self, handle: str, did: str) -> bool:
        async with self._handle_slots:
            return await self._check_handle_now(handle, did)

    async def _check_handle_now(self, handle: str, did: str) -> bool:
        """Counted in ``relay_handle_checks_total{result}``: ``resolver_ok``, ``dns_ok``,
        ``dns_other_did`` (DNS names another DID: final, DNS is preferred), ``https_ok``, ``failed``."""
        found, method = await self._handle_did(handle)
        ok = found == did
        if method == "dns":
            self._count("handle_checks", "dns_ok" if ok else "dns_other_did")
        else:
            self._count("handle_checks", f"{method}_ok" if ok else "failed")
        return ok

    async def _handle_did(self, handle: str) -> tuple[str | None, str]:
        """The DID ``handle`` names, and the method that gave the answer: ``resolver`` (the
        resolver service; final when configured), else ``dns`` (TXT ``_atproto.<handle>``; final
        when it names a DID), else ``https`` (``https://<handle>/.well-known/atproto-did``). The DID
        is None when that method found none; a failed lookup is not raised."""
        found: object = None
        if self._resolver is not None:
            try:
                status, body = await self._resolver.get(
                    "/xrpc/com.atproto.identity.resolveHandle?" + urlencode({"handle": handle}), max_bytes=MAX_DOC_BYTES)
                found = json.loads(body).get("did") if status == 200 else None
            except (HttpError, ValueError, AttributeError):
                found = None
            return (found if isinstance(found, str) else None), "resolver"
        if self.txt_lookup is not None and len(handle) <= 244:
            try:
                txt = did_from_txt(await self.txt_lookup(f"_atproto.{handle}"))
            except (dns.exception.DNSException, OSError, ValueError) as exc:
                log.debug("handle TXT lookup failed", extra={"handle": handle, "error": type(exc).__name__})
                txt = None
            if txt is not None:
                return txt, "dns"
        try:
            status, raw, _ = await self.safe.get(f"https://{handle}/.well-known/atproto-did", max_bytes=2048)
            text = raw.decode("utf-8", "replace").strip()
            return (text if status == 200 and text.startswith("did:") else None), "https"
        except (httpx.HTTPError, SSRFError, ValueError, AttributeError):
            return None, "https"
