"""Identity: DID document parsing (current and legacy key forms), caches, resolver over HTTP."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from mst.crypto import PrivateKey, base58_encode
from relay.identity import (
    Identity,
    IdentityError,
    IdentityResolver,
    MemoryIdentityCache,
    RedisIdentityCache,
    TokenBucket,
    parse_did_document,
)
from relay.metrics import RelayMetrics
from relay.ssrf import AddressGuard, SafeClient
from tests.relay.helpers import serve_asgi
from tests.waiting import until

DID = "did:plc:ewvi7nxzyoun6zhxrhs64oiz"


def _doc(did: str, method: dict, pds: str = "https://pds.example.com") -> dict:
    return {
        "id": did,
        "alsoKnownAs": ["at://Alice.example.com"],
        "verificationMethod": [{"id": f"{did}#atproto", "controller": did, **method}],
        "service": [{"id": "#atproto_pds", "type": "AtprotoPersonalDataServer", "serviceEndpoint": pds}],
    }


def test_multikey_document() -> None:
    key = PrivateKey.generate_k256()
    multibase = key.did_key()[len("did:key:"):]
    ident = parse_did_document(DID, _doc(DID, {"type": "Multikey", "publicKeyMultibase": multibase}))
    assert ident == Identity(DID, key.did_key(), "https://pds.example.com", "alice.example.com")
    assert ident.pds_hostname == "pds.example.com"


@pytest.mark.parametrize("gen,key_type", [
    (PrivateKey.generate_k256, "EcdsaSecp256k1VerificationKey2019"),
    (PrivateKey.generate_p256, "EcdsaSecp256r1VerificationKey2019"),
])
def test_legacy_key_forms(gen, key_type: str) -> None:  # type: ignore[no-untyped-def]
    key = gen()
    compressed = key.public_key.compressed
    ident = parse_did_document(DID, _doc(DID, {"type": key_type, "publicKeyMultibase": "z" + base58_encode(compressed)}))
    assert ident.signing_key == key.did_key()


@pytest.mark.parametrize("mutate,reason", [
    (lambda d: d.update(id="did:plc:other"), "bad_did_document"),
    (lambda d: d.update(verificationMethod=[]), "no_signing_key"),
    (lambda d: d["verificationMethod"][0].update(publicKeyMultibase="zzzz"), "no_signing_key"),
    (lambda d: d["verificationMethod"][0].update(type="Ed25519VerificationKey2020"), "no_signing_key"),
])
def test_bad_documents(mutate, reason: str) -> None:  # type: ignore[no-untyped-def]
    key = PrivateKey.generate_k256()
    doc = _doc(DID, {"type": "Multikey", "publicKeyMultibase": key.did_key()[8:]})
    mutate(doc)
    with pytest.raises(IdentityError) as err:
        parse_did_document(DID, doc)
    assert err.value.reason == reason


async def test_memory_cache_bounded_and_expiring() -> None:
    now = [100.0]
    cache = MemoryIdentityCache(max_entries=2, ttl=50.0, clock=lambda: now[0])
    for i in range(3):
        await cache.put(Identity(f"did:plc:{i}", "did:key:x"))
    assert len(cache) == 2 and await cache.get("did:plc:0") is None
    assert await cache.get("did:plc:2") is not None
    now[0] = 150.0  # exactly the lifetime: still valid
    assert await cache.get("did:plc:2") is not None
    now[0] = 150.001
    assert await cache.get("did:plc:2") is None


async def test_redis_cache(redis_url: str) -> None:
    client = aioredis.from_url(redis_url)
    cache = RedisIdentityCache(client, ttl=30, prefix="test:identity:")
    try:
        ident = Identity(DID, "did:key:zabc", "https://pds.example.com", None)
        await cache.put(ident)
        assert await cache.get(DID) == ident
        await cache.purge(DID)
        assert await cache.get(DID) is None
    finally:
        await client.delete("test:identity:" + DID)
        await client.aclose()


async def test_redis_cache_survives_redis_being_unreachable() -> None:
    """Nothing listens on port 1: lookups fall back to the in-process copy, never raise."""
    client = aioredis.from_url("redis://127.0.0.1:1/15", socket_connect_timeout=1.0)
    cache = RedisIdentityCache(client, ttl=30, prefix="test:identity:")
    try:
        ident = Identity(DID, "did:key:zabc", "https://pds.example.com", None)
        assert await cache.get(DID) is None and cache.degraded
        await cache.put(ident)
        assert await cache.get(DID) == ident
        await cache.purge(DID)
        assert await cache.get(DID) is None
    finally:
        await client.aclose()


async def test_token_bucket_refuses_beyond_max_wait() -> None:
    bucket = TokenBucket(rate=1.0, burst=2)
    await bucket.acquire()
    await bucket.acquire()
    with pytest.raises(IdentityError) as err:
        await bucket.acquire(max_wait=0.1)
    assert err.value.reason == "rate_limited"


async def test_resolver_plc_cache_purge_and_handles() -> None:
    key = PrivateKey.generate_k256()
    hits: list[str] = []

    async def plc(request: Request) -> JSONResponse:
        did = request.path_params["did"]
        hits.append(did)
        if did != DID:
            return JSONResponse({"message": "not found"}, status_code=404)
        return JSONResponse(_doc(DID, {"type": "Multikey", "publicKeyMultibase": key.did_key()[8:]}))

    async def resolve_handle(request: Request) -> JSONResponse:
        if request.query_params.get("handle") == "alice.example.com":
            return JSONResponse({"did": DID})
        return JSONResponse({"error": "InvalidRequest"}, status_code=400)

    app = Starlette(routes=[Route("/xrpc/com.atproto.identity.resolveHandle", resolve_handle),
                            Route("/{did}", plc)])
    metrics = RelayMetrics()
    async with serve_asgi(app) as url:
        safe = SafeClient(AddressGuard())
        resolver = IdentityResolver(plc_url=url, safe_client=safe, metrics=metrics, handle_resolver_url=url)
        try:
            ident = await resolver.resolve(DID)
            assert ident.signing_key == key.did_key() and ident.handle == "alice.example.com"
            await asyncio.gather(*(resolver.resolve(DID) for _ in range(5)))
            assert hits == [DID]  # cached
            await resolver.purge(DID)
            await resolver.resolve(DID)
            await resolver.resolve(DID, fresh=True)
            assert hits == [DID, DID, DID]
            with pytest.raises(IdentityError) as err:
                await resolver.resolve("did:plc:aaaaaaaaaaaaaaaaaaaaaaaa")
            assert err.value.reason == "did_not_found"
            with pytest.raises(IdentityError) as err:
                await resolver.resolve("did:example:123")
            assert err.value.reason == "bad_did"
            assert await resolver.verify_handle("alice.example.com", DID)
            assert not await resolver.verify_handle("mallory.example.com", DID)
            assert metrics.identity_cache.labels(result="hit")._value.get() >= 5
        finally:
            await resolver.aclose()
            await safe.aclose()


async def test_handle_checks_time_out_are_remembered_and_never_hold_did_resolution() -> None:
    """Handle checks have their own bound: while every handle slot waits on a handle domain that
    does not answer, DIDs still resolve; concurrent checks of one pair share one request
    (``handle_check``). A check over ``handle_timeout`` fails (``timeout``), and a failed check is
    remembered (``failed_cached``: not asked again)."""
    key = PrivateKey.generate_k256()
    gate = asyncio.Event()
    asked: list[str] = []

    async def plc(request: Request) -> JSONResponse:
        return JSONResponse(_doc(DID, {"type": "Multikey", "publicKeyMultibase": key.did_key()[8:]}))

    async def resolve_handle(request: Request) -> JSONResponse:
        handle = request.query_params.get("handle", "")
        asked.append(handle)
        await gate.wait()
        return JSONResponse({"did": DID} if handle.startswith("h") else {"error": "HandleNotFound"},
                            status_code=200 if handle.startswith("h") else 400)

    app = Starlette(routes=[Route("/xrpc/com.atproto.identity.resolveHandle", resolve_handle),
                            Route("/{did}", plc)])
    metrics = RelayMetrics()
    async with serve_asgi(app) as url:
        safe = SafeClient(AddressGuard())
        resolver = IdentityResolver(plc_url=url, safe_client=safe, metrics=metrics, handle_resolver_url=url,
                                    concurrency=2, handle_concurrency=2, handle_timeout=60.0)
        quick = IdentityResolver(plc_url=url, safe_client=safe, metrics=metrics, handle_resolver_url=url,
                                 handle_timeout=0.2)
        try:
            checks = [resolver.handle_check(f"h{i}.example.com", DID) for i in range(2)]
            assert resolver.handle_check("h0.example.com", DID) is checks[0]  # shared while it runs
            await until(lambda: len(asked) == 2, "both handle checks to be asked")
            await asyncio.wait_for(resolver.resolve(DID, fresh=True), 30)  # not held by the handle checks
            assert not checks[0].done()
            gate.set()
            assert [await c for c in checks] == [True, True]

            gate.clear()
            assert not await quick.verify_handle("x.example.com", DID)  # the gate holds it past the timeout
            assert metrics.handle_checks.labels(result="timeout")._value.get() == 1
            assert not await quick.verify_handle("x.example.com", DID)
            assert asked.count("x.example.com") == 1  # remembered: not asked again
            assert metrics.handle_checks.labels(result="failed_cached")._value.get() == 1
        finally:
            gate.set()
            await resolver.aclose()
            await quick.aclose()
            await safe.aclose()


async def test_did_web_goes_through_the_ssrf_guard() -> None:
    safe = SafeClient(AddressGuard())
    resolver = IdentityResolver(plc_url="http://127.0.0.1:9", safe_client=safe)
    try:
        with pytest.raises(IdentityError) as err:
            await resolver.resolve("did:web:localhost")
        assert err.value.reason == "resolution_failed"
    finally:
        await resolver.aclose()
        await safe.aclose()


class _DnsServer(asyncio.DatagramProtocol):
    """A real DNS server on 127.0.0.1 (UDP), answering TXT queries from a table; NXDOMAIN otherwise."""

    def __init__(self, txt: dict[str, list[str]]) -> None:
        self.txt = txt
        self.queries: list[str] = []
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:  # type: ignore[no-untyped-def]
        import dns.message
        import dns.rcode
        import dns.rdatatype
        import dns.rrset

        query = dns.message.from_wire(data)
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True)
        self.queries.append(name)
        response = dns.message.make_response(query)
        records = self.txt.get(name)
        if records is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.TXT:
            quoted = [" ".join(f'"{part}"' for part in r.split("|")) for r in records]  # "|" splits strings
            response.answer.append(dns.rrset.from_text(question.name, 60, "IN", "TXT", *quoted))
        assert self.transport is not None
        self.transport.sendto(response.to_wire(), addr)


async def test_handle_verified_by_dns_txt_first_then_https() -> None:
    from relay.config import parse_nameservers
    from relay.identity import did_from_txt, dns_txt_lookup

    other = "did:plc:aaaaaaaaaaaaaaaaaaaaaaaa"
    table = {
        "_atproto.alice.test": ["v=spf1 -all", f"did={DID}"],  # non-did records are ignored
        "_atproto.split.test": [f"did=|{DID}"],  # one TXT value in two character-strings
        "_atproto.bob.test": [f"did={other}"],  # DNS names another DID: final
        "_atproto.twice.test": [f"did={DID}", f"did={other}"],  # ambiguous: no DNS answer
    }
    server = _DnsServer(table)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: server, local_addr=("127.0.0.1", 0))
    port = transport.get_extra_info("sockname")[1]
    lookup = dns_txt_lookup(parse_nameservers(f"127.0.0.1:{port}"), timeout=2.0)
    assert lookup is not None
    metrics = RelayMetrics()
    safe = SafeClient(AddressGuard())
    resolver = IdentityResolver(plc_url="http://127.0.0.1:9", safe_client=safe, metrics=metrics, txt_lookup=lookup)
    try:
        assert await resolver.verify_handle("alice.test", DID)
        assert await resolver.verify_handle("split.test", DID)
        assert not await resolver.verify_handle("bob.test", DID)
        assert not await resolver.verify_handle("twice.test", DID)  # then HTTPS, which fails here
        assert not await resolver.verify_handle("nobody.test", DID)  # NXDOMAIN, then HTTPS
        assert server.queries == [f"_atproto.{h}" for h in ("alice.test", "split.test", "bob.test",
                                                             "twice.test", "nobody.test")]
        counts = {r: metrics.handle_checks.labels(result=r)._value.get()
                  for r in ("dns_ok", "dns_other_did", "https_ok", "failed")}
        assert counts == {"dns_ok": 2, "dns_other_did": 1, "https_ok": 0, "failed": 2}
        assert did_from_txt([f"did={DID}", f"did= {DID}"]) == DID  # the same DID twice is fine
        assert did_from_txt(["did:plc:x", "DID=did:plc:x"]) is None
    finally:
        transport.close()
        await resolver.aclose()
        await safe.aclose()


async def test_the_synchronous_cache_read_answers_only_what_resolve_would_from_memory() -> None:
    """``IdentityResolver.cached`` (the per-commit read) sees every purge, a cache entry's expiry
    and the age limit, counts a hit, and answers nothing for a Redis-shared cache (whose answer
    another process may have changed: ``resolve`` asks Redis)."""
    now = [1000.0]
    metrics = RelayMetrics()
    safe = SafeClient(AddressGuard())
    cache = MemoryIdentityCache(ttl=60.0, clock=lambda: now[0])
    resolver = IdentityResolver(plc_url="http://127.0.0.1:9", safe_client=safe, cache=cache, metrics=metrics,
                                stale_after=30.0, clock=lambda: now[0])
    try:
        ident = Identity(DID, "did:key:zabc", "https://pds.example.com", fetched_at=now[0])
        assert resolver.cached(DID) is None
        await cache.put(ident)
        assert resolver.cached(DID) == ident == await resolver.resolve(DID)
        assert metrics.identity_cache.labels(result="hit")._value.get() == 2
        await resolver.purge(DID)  # an #identity, a did_not_found
        assert resolver.cached(DID) is None
        await cache.put(ident)
        now[0] += 31.0  # older than stale_after: resolve would fetch it again
        assert resolver.cached(DID) is None
        await cache.put(dataclasses.replace(ident, fetched_at=now[0]))
        now[0] += 61.0  # past the cache entry's lifetime
        assert resolver.cached(DID) is None
        shared = RedisIdentityCache(aioredis.from_url("redis://127.0.0.1:1/15"))
        await shared.local.put(dataclasses.replace(ident, fetched_at=now[0]))
        assert IdentityResolver(plc_url="http://127.0.0.1:9", safe_client=safe, cache=shared,
                                clock=lambda: now[0]).cached(DID) is None
        await shared.redis.aclose()
    finally:
        await resolver.aclose()
        await safe.aclose()


async def test_a_redis_cache_keeps_the_local_cache_it_was_given_even_when_empty() -> None:
    """An empty ``MemoryIdentityCache`` is falsy (``__len__``): the Redis cache must still use it,
    not replace it with a new one the caller cannot see."""
    local = MemoryIdentityCache(ttl=5.0)
    client = aioredis.from_url("redis://127.0.0.1:1/15")
    try:
        shared = RedisIdentityCache(client, local=local)
        assert shared.local is local
    finally:
        await client.aclose()
