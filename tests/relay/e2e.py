"""Shared pieces of the end-to-end tests: a consumer over a real WebSocket and truth checks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect

from firehose.frames import decode_frame
from sim import SimConfig, SimFleet
from tests.relay.helpers import RunningRelay
from tests.waiting import until

#: the admin token the tests' relays are started with when they need the admin API
ADMIN_TOKEN = "test-admin"


@dataclass
class Received:
    seq: int
    t: str
    did: str
    rev: str | None
    body: dict[str, Any]


def parse(frame: bytes) -> Received | None:
    f = decode_frame(frame)
    if f.is_error or f.t == "#info":
        return None
    did = f.body.get("repo") if f.t == "#commit" else f.body.get("did")
    return Received(int(f.body["seq"]), str(f.t), str(did), f.body.get("rev"), f.body)


class Consumer:
    """A subscribeRepos consumer collecting events in a background task."""

    def __init__(self, ws_url: str, cursor: int | None = None) -> None:
        self.url = ws_url if cursor is None else f"{ws_url}?cursor={cursor}"
        self.events: list[Received] = []
        self.infos: list[bytes] = []
        self._ws: ClientConnection | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Consumer:
        self._ws = await connect(self.url, max_size=None)
        self._task = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self._ws is not None
        try:
            async for frame in self._ws:
                assert isinstance(frame, bytes)
                ev = parse(frame)
                if ev is None:
                    self.infos.append(frame)
                else:
                    self.events.append(ev)
        except Exception:
            return

    async def wait_for(self, predicate, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not predicate(self.events):
            if time.monotonic() > deadline:
                tail = [(e.t, e.did[-6:], e.rev) for e in self.events[-12:]]
                raise AssertionError(f"timed out; have {len(self.events)} events; last: {tail}")
            await asyncio.sleep(0.05)

    async def __aexit__(self, *exc: object) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._task is not None:
            await asyncio.wait_for(self._task, 5)


def key_of(kind: str, did: str, rev: str | None) -> tuple[str, str, str | None]:
    return (kind, did, rev if kind in ("#commit", "#sync") else None)


def check_stream(events: list[Received]) -> None:
    """seq strictly increasing; per account, commit revs strictly increasing."""
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), "seq not strictly increasing"
    last: dict[str, str] = {}
    for e in events:
        if e.t in ("#commit", "#sync") and e.rev is not None:
            assert e.rev > last.get(e.did, ""), f"rev order broken for {e.did}"
            last[e.did] = e.rev


async def crawl(relay_url: str, hostname: str) -> None:
    async with httpx.AsyncClient(base_url=relay_url) as http:
        r = await http.post("/xrpc/com.atproto.sync.requestCrawl", json={"hostname": hostname})
        assert r.status_code == 200, r.text


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample family filtered by labels."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def add_relay(downstream: RunningRelay, upstream_url: str) -> None:
    """Have ``downstream`` follow the relay at ``upstream_url`` (admin API, ``relay: true``)."""
    async with httpx.AsyncClient(base_url=downstream.url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
        r = await http.post("/admin/hosts", json={"hostname": upstream_url.removeprefix("http://"), "relay": True})
        assert r.status_code == 200 and r.json()["relay"] is True, r.text


async def settled(relay: RunningRelay, upstream_url: str, timeout: float = 60.0) -> int:
    """Wait until ``relay`` has read every event the upstream relay at ``upstream_url`` holds now
    and settled each of them (stored or dropped); returns ``relay``'s latest seq then."""
    hostname = upstream_url.removeprefix("http://")
    upstreams = relay.service.upstreams
    assert upstreams is not None
    async with httpx.AsyncClient() as http:
        target = (await http.get(f"{upstream_url}/_health")).json()["seq"]
    await until(lambda: (upstreams.last_read(hostname) or 0) >= target,
                f"the relay to read up to seq {target} from {hostname}", timeout=timeout)
    await upstreams.settle_read(hostname)
    return await relay.service.store.latest_seq()
async def settle(fleet: Any, consumer: Consumer, timeout: float = 30.0, among: list[Any] | None = None,
                 relay: RunningRelay | None = None) -> list[Any]:
    """End a "nothing else arrives" check on events, not on a sleep: a marker commit from every
    active account of ``fleet`` (``SimFleet.markers``), awaited on ``consumer``. Anything such an
    account sent before its marker that the relay passes on has arrived once the marker has. With
    ``relay``, also wait until the relay has read and settled everything every host sent and the
    consumer has the relay's latest seq (covers accounts that are not active). Returns the
    markers' truth events (count them in what you expect)."""
    markers = await fleet.markers(among)
    revs = {t.rev for t in markers}
    await consumer.wait_for(lambda evs: revs <= {e.rev for e in evs if e.t == "#commit"}, timeout=timeout)
    if relay is not None:
        upstreams = relay.service.upstreams
        assert upstreams is not None
        for host in fleet.hosts:
            await until(lambda host=host: (upstreams.last_read(host.hostname) or 0) >= host.published_seq,
                        f"the relay to read {host.hostname}", timeout=timeout)
            await upstreams.settle_read(host.hostname)
        latest = await relay.service.store.latest_seq()
        await consumer.wait_for(lambda evs: bool(evs) and evs[-1].seq >= latest, timeout=timeout)
    return markers


def commits_of(consumer: Consumer, did: str) -> list[str | None]:
    return [e.rev for e in consumer.events if e.t == "#commit" and e.did == did]


@contextlib.asynccontextmanager
async def one_account(relay_factory: Any, *, seed: int) -> AsyncIterator[tuple[SimFleet, Any, Consumer]]:
    """A simulated host with one account, a relay following it and a consumer that has seen the
    account's first two commits."""
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=1, seed=seed))
    await fleet.start()
    try:
        settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0}
        async with relay_factory(**settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
            account = fleet.accounts[0]
            await crawl(relay.url, fleet.hosts[0].hostname)
            await fleet.generate(2)
            await consumer.wait_for(lambda evs: account.repo.rev in commits_of(consumer, account.did))
            yield fleet, relay, consumer
    finally:
        await fleet.stop()
