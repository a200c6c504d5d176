"""Per-account ingest over real sockets: no account waits for another of its host, the host cursor
is a watermark, a slow handle never holds its own account for long, per-host account counts count
stored accounts only, and a first-seen account chained on history the relay should have read is
resynchronised.

The slow parts are held on events, never on time: a test resolveHandle service (the relay's
``handle_resolver_url``) answers chosen handles only once the test releases them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sim import SimConfig, SimFleet
from tests.relay.e2e import Consumer, check_stream, crawl, key_of, metric_value
from tests.relay.helpers import RunningRelay, serve_asgi
from tests.waiting import until


class HeldHandles:
    """A resolveHandle service over the simulator's handles; ``hold(handle)`` makes that handle's
    answers wait until ``release(handle)``; ``asked`` counts the questions per handle."""

    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet
        self.held: dict[str, asyncio.Event] = {}
        self.asked: Counter[str] = Counter()

    def hold(self, handle: str) -> None:
        self.held[handle] = asyncio.Event()

    def release(self, handle: str) -> None:
        self.held[handle].set()

    async def _resolve(self, request: Request) -> Response:
        handle = request.query_params.get("handle", "")
        self.asked[handle] += 1
        gate = self.held.get(handle)
        if gate is not None:
            await gate.wait()
        did = self.fleet.plc.handles.get(handle)
        if did is None:
            return JSONResponse({"error": "HandleNotFound"}, status_code=400)
        return JSONResponse({"did": did})

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        app = Starlette(routes=[Route("/xrpc/com.atproto.identity.resolveHandle", self._resolve)])
        async with serve_asgi(app) as url:
            yield url


@contextlib.asynccontextmanager
async def _held_handle(relay_factory, *, accounts: int, seed: int,  # type: ignore[no-untyped-def]
                       handle_wait: float) -> AsyncIterator[tuple[SimFleet, HeldHandles, RunningRelay, Consumer]]:
    """One simulated host of ``accounts`` announced accounts whose first account's handle check is
    held (``HeldHandles``), a relay following it with ``handle_wait`` and a consumer from cursor 0."""
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=accounts, seed=seed, announce_accounts=True))
    await fleet.start()
    service = HeldHandles(fleet)
    service.hold(fleet.accounts[0].handle)
    try:
        async with service.serving() as resolver_url, relay_factory(
                allow_insecure_hosts=True, plc_url=fleet.plc_url, handle_resolver_url=resolver_url,
                handle_wait=handle_wait, validation_workers=0) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
            await crawl(relay.url, fleet.hosts[0].hostname)
            yield fleet, service, relay, consumer
    finally:
        await fleet.stop()


def _accepted(fleet: SimFleet, did: str, start: int = 0) -> list[tuple[str, str, str | None]]:
    return [key_of(t.kind, t.did, t.rev) for t in fleet.ground_truth[start:] if t.did == did and t.verdict == "accept"]


async def test_an_account_waiting_for_its_handle_holds_no_other_account_of_its_host(relay_factory) -> None:  # type: ignore[no-untyped-def]
    """One account's ``#identity`` waits on a handle check that does not answer: every other
    account of the same host keeps flowing (its later events reach the consumer), and the waiting
    account's own events follow, in its order, once the check answers. Exactly once each."""
    async with _held_handle(relay_factory, accounts=6, seed=81, handle_wait=3600.0) as (fleet, service, relay, consumer):
        slow = fleet.accounts[0]
        await fleet.generate(60)
        others = [a for a in fleet.accounts if a is not slow]
        # every other account's events arrive, though the slow #identity came before them all
        wanted = Counter(k for a in others for k in _accepted(fleet, a.did))
        await consumer.wait_for(lambda evs: not wanted - Counter(key_of(e.t, e.did, e.rev) for e in evs))
        assert service.asked[slow.handle] == 1  # still being checked
        assert not [e for e in consumer.events if e.did == slow.did]
        service.release(slow.handle)
        mine = _accepted(fleet, slow.did)
        await consumer.wait_for(lambda evs: len([e for e in evs if e.did == slow.did]) >= len(mine))
        await relay.service.upstreams.settle_read(fleet.hosts[0].hostname)
        latest = await relay.service.store.latest_seq()
        await consumer.wait_for(lambda evs: evs[-1].seq >= latest)
        check_stream(consumer.events)
        assert [key_of(e.t, e.did, e.rev) for e in consumer.events if e.did == slow.did] == mine  # its order
        got = Counter(key_of(e.t, e.did, e.rev) for e in consumer.events)
        assert got == Counter(k for a in fleet.accounts for k in _accepted(fleet, a.did))  # each once
        identity = next(e for e in consumer.events if e.did == slow.did and e.t == "#identity")
        assert identity.body.get("handle") == slow.handle  # waited for: verified


async def test_a_slow_handle_is_passed_on_stripped_and_follows_once_verified(relay_factory) -> None:  # type: ignore[no-untyped-def]
    """With a short ``handle_wait`` an ``#identity`` whose handle check is slow goes out at once
    without its handle (and the account's commits after it); when the check succeeds, a second
    ``#identity`` carries the verified handle, counted ``handle_verified_late``."""
    async with _held_handle(relay_factory, accounts=2, seed=82, handle_wait=0.0) as (fleet, service, relay, consumer):
        slow = fleet.accounts[0]
        await fleet.generate(10)
        mine = _accepted(fleet, slow.did)
        await consumer.wait_for(lambda evs: len([e for e in evs if e.did == slow.did]) >= len(mine))
        first = [e for e in consumer.events if e.did == slow.did and e.t == "#identity"]
        assert len(first) == 1 and "handle" not in first[0].body  # stripped: not verified yet
        service.release(slow.handle)
        await consumer.wait_for(lambda evs: {(e.did, e.body.get("handle")) for e in evs if e.t == "#identity"}
                                >= {(a.did, a.handle) for a in fleet.accounts})
        async with httpx.AsyncClient(base_url=relay.url) as http:
            text = (await http.get("/metrics")).text
        # with no wait at all every handle comes late: each account's #identity twice, in this order
        for account in fleet.accounts:
            identities = [e for e in consumer.events if e.did == account.did and e.t == "#identity"]
            assert [e.body.get("handle") for e in identities] == [None, account.handle]
        assert metric_value(text, "relay_verdicts_total", reason="handle_verified_late") == len(fleet.accounts)
        check_stream(consumer.events)


async def test_rejected_frames_of_a_new_account_never_count_against_its_host(relay_factory) -> None:  # type: ignore[no-untyped-def]
    """A host with two stored accounts and a limit of three: a never-stored account sending four
    frames that are rejected takes no place, so a valid new account is admitted (not held), the
    host is not throttled, and the stored count is exactly three."""
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=4, seed=83, announce_accounts=False))
    await fleet.start()
    host = fleet.hosts[0]
    a, b, forger, late = fleet.accounts
    try:
        async with relay_factory(allow_insecure_hosts=True, plc_url=fleet.plc_url, validation_workers=0,
                                 default_account_limit=3) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
            await crawl(relay.url, host.hostname)
            fleet.prepare(1, among=[a])
            fleet.prepare(1, among=[b])
            for _ in range(4):
                fleet.inject("bad_signature", forger)  # a frame signed with another key, nothing else
            fleet.prepare(1, among=[late])
            await fleet.release()
            wanted = [key_of(t.kind, t.did, t.rev) for t in fleet.ground_truth if t.verdict == "accept"]
            assert {k[1] for k in wanted} == {a.did, b.did, late.did}
            await consumer.wait_for(lambda evs: len(evs) >= len(wanted))
            await relay.service.upstreams.settle_read(host.hostname)  # type: ignore[union-attr]
            stored = await relay.service.store.get_host(host.hostname)
            assert stored is not None and stored.status == "active" and stored.account_count == 3
            assert await relay.service.store.get_account(forger.did) is None
            assert relay.service.admission.reserved(host.hostname) == 0  # type: ignore[union-attr]
        assert Counter(key_of(e.t, e.did, e.rev) for e in consumer.events) == Counter(wanted)
    finally:
        await fleet.stop()


async def test_first_seen_account_chained_on_history_missed_while_followed_is_resynced(
        relay_factory, database_url: str) -> None:  # type: ignore[no-untyped-def]
    """A host wiped while the relay was away, whose new stream passed the relay's old cursor before
    it came back: the relay resumes past the new account's first commits without any sign of a
    reset. That account's next commit chains (``since``) on a commit made while the relay was
    following the host, which it never read: it is resynchronised (one ``#sync``, counted
    ``unseen_history``), not accepted as if its history were known. Accounts first seen with
    history from before the relay followed the host (their first, unannounced commit) are not."""
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=3, seed=84, announce_accounts=False))
    await fleet.start()
    host = fleet.hosts[0]
    old, fresh = fleet.accounts[:2], fleet.accounts[2]
    try:
        settings = {"database_url": database_url, "allow_insecure_hosts": True, "plc_url": fleet.plc_url,
                    "validation_workers": 0, "host_clock_skew": 0.0}
        async with relay_factory(**settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
            await crawl(relay.url, host.hostname)
            fleet.prepare(6, among=old)
            await fleet.release()
            await until(lambda: (relay.service.upstreams.last_read(host.hostname) or 0) >= host.published_seq,  # type: ignore[union-attr]
                        "the relay to read the host")
            await relay.service.upstreams.settle_read(host.hostname)  # type: ignore[union-attr]
            cursor = await relay.service.store.host_cursor(host.hostname) or 0
            assert cursor == host.published_seq
            before = len(consumer.events)
            assert before == 6 and not [e for e in consumer.events if e.t == "#sync"]
        # the relay is away: the host is wiped and its new stream passes the old cursor
        host.wipe()
        fleet.prepare(cursor + 3, among=[fresh])
        await fleet.release()
        assert host.published_seq == cursor + 3
        async with relay_factory(**settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
            await consumer.wait_for(lambda evs: any(e.did == fresh.did and e.t == "#sync" for e in evs))
            fleet.prepare(1, among=[fresh])
            await fleet.release()
            await consumer.wait_for(lambda evs: evs[-1].did == fresh.did and evs[-1].rev == fresh.repo.rev)
            async with httpx.AsyncClient(base_url=relay.url) as http:
                text = (await http.get("/metrics")).text
        mine = [e for e in consumer.events if e.did == fresh.did]
        syncs = [e for e in mine if e.t == "#sync"]
        assert len(syncs) == 1 and syncs[0].seq > consumer.events[before - 1].seq
        assert metric_value(text, "relay_verdicts_total", reason="unseen_history") == 1
        # the commits read before the #sync were held, not passed on; the one after it follows it
        assert [e.t for e in mine] == ["#sync", "#commit"]
        check_stream(consumer.events)
    finally:
        await fleet.stop()


async def test_frames_held_while_the_store_is_down_are_bounded_in_bytes(relay_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """While nothing can be stored, a host's frames read and not done never exceed its share of
    ``RELAY_INGEST_BUFFER_MB`` (one frame over at most): the relay stops reading that host instead
    of buffering its backlog, and once the store is back every event arrives exactly once."""
    from tests.relay.test_lanes import Faults, faulty_store

    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=8, seed=85, announce_accounts=False))
    await fleet.start()
    host = fleet.hosts[0]
    faults = Faults(OSError("unused"))
    store = await faulty_store(tmp_path / "relay.sqlite", faults)
    try:
        async with relay_factory(store=store, allow_insecure_hosts=True, plc_url=fleet.plc_url,
                                 validation_workers=0, ingest_buffer_mb=1) as relay, \
                Consumer(relay.ws_url, cursor=0) as consumer:
            upstreams = relay.service.upstreams
            assert upstreams is not None
            share = upstreams.max_in_flight_bytes_per_host
            assert share == 1024 * 1024 // 8
            await crawl(relay.url, host.hostname)
            faults.down = True
            await fleet.generate(300)
            biggest = max(2 * len(e.frame) + 2048 for e in host.log.entries)
            run = upstreams._runs[host.hostname]
            await until(lambda: run.outstanding_bytes + biggest > share and faults.refused >= 2,
                        "the host's share to fill while the store is down")
            assert run.outstanding_bytes <= share + biggest
            assert (upstreams.last_read(host.hostname) or 0) < host.published_seq  # the rest is not read
            faults.down = False
            wanted = [key_of(t.kind, t.did, t.rev) for t in fleet.ground_truth if t.verdict == "accept"]
            await consumer.wait_for(lambda evs: len(evs) >= len(wanted), timeout=60)
            await upstreams.settle_read(host.hostname)
            assert upstreams.watermark(host.hostname) == host.published_seq
        assert Counter(key_of(e.t, e.did, e.rev) for e in consumer.events) == Counter(wanted)
        check_stream(consumer.events)
    finally:
        await fleet.stop()


async def test_a_host_whose_frames_come_one_at_a_time_stores_its_cursor_with_its_events(relay_factory) -> None:  # type: ignore[no-untyped-def]
    """A frame at the head of its host's window is stored with its own seq as the host cursor: a
    host sending one frame at a time (most hosts of a large relay) costs one sequencer batch per
    frame, not a second one for a cursor write, and its stored cursor is its last frame's seq."""
    from tests.relay.e2e import commits_of

    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=2, seed=2703))
    await fleet.start()
    try:
        async with relay_factory(allow_insecure_hosts=True, plc_url=fleet.plc_url, validation_workers=0) as relay, \
                Consumer(relay.ws_url, cursor=0) as consumer:
            host = fleet.hosts[0]
            await crawl(relay.url, host.hostname)
            await consumer.wait_for(lambda evs: all(commits_of(consumer, a.did) for a in fleet.accounts))
            await until_cursor(relay, host.hostname, host.seq)
            sequencer = relay.service.sequencer
            assert sequencer is not None
            before = sequencer.stats.batches
            n = 12
            for _ in range(n):  # one frame at a time: each delivered before the next is made
                truth = await fleet.generate(1)
                rev = truth[-1].rev
                await consumer.wait_for(lambda evs, rev=rev: any(e.rev == rev for e in evs))
            await until_cursor(relay, host.hostname, host.seq)
            assert sequencer.stats.batches - before <= n + 2  # not 2 per frame
    finally:
        await fleet.stop()


async def until_cursor(relay: RunningRelay, hostname: str, seq: int) -> None:
    """Wait until the stored cursor of ``hostname`` is ``seq``."""
    from tests.waiting import until_async

    async def stored() -> bool:
        return await relay.service.store.host_cursor(hostname) == seq

    await until_async(stored, f"{hostname}'s stored cursor to reach {seq}")
