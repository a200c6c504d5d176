"""The host gauges come from memory (``relay.hosts.HostBoard``): they follow every host status
and account-count change, and neither a scrape nor the housekeeping status watch reads the
``hosts`` table."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from backfill.sqlite_store import SqliteStore
from backfill.store import BatchWrite
from backfill.types import HostState
from relay.config import RelayConfig
from relay.hosts import HOST_STATUSES, HostBoard, HostPolicy
from tests.relay.helpers import running_relay


class CountingStore(SqliteStore):
    """A real SQLite store that records every statement it runs (the seam all queries pass)."""

    statements: list[str]

    async def _fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        self.statements.append(sql)
        return await super()._fetch(sql, *args)

    async def _fetchval(self, sql: str, *args: Any) -> Any:
        self.statements.append(sql)
        return await super()._fetchval(sql, *args)

    async def _execute(self, sql: str, *args: Any) -> int:
        self.statements.append(sql)
        return await super()._execute(sql, *args)

    def host_reads(self) -> list[str]:
        return [s for s in self.statements if " hosts" in s]


async def open_counting(path: Path) -> CountingStore:
    store = await CountingStore.open(str(path))
    await store.migrate()
    assert isinstance(store, CountingStore)
    store.statements = []
    return store


async def truth(store: SqliteStore, policy: HostPolicy) -> tuple[dict[str, int], dict[str, tuple[int, int | None]]]:
    """Hosts per status, and accounts/limit per host not banned, as the store has them."""
    counts = dict.fromkeys(HOST_STATUSES, 0)
    accounts: dict[str, tuple[int, int | None]] = {}
    for host in await store.list_hosts(limit=100_000):
        counts[host.status] += 1
        if host.status != "banned":
            accounts[host.hostname] = (host.account_count, policy.account_limit(host))
    return counts, accounts


async def test_board_follows_status_and_account_changes(tmp_path: Path) -> None:
    """Each way a host row changes (a status set through the board, a stored row, a committed
    batch's account counts creating or changing hosts) leaves the board equal to the store."""
    store = await open_counting(tmp_path / "relay.sqlite")
    try:
        policy = HostPolicy(RelayConfig(default_account_limit=5, trusted_domains=("trusted.example",)))
        for i in range(3):
            await store.upsert_host(HostState(hostname=f"h{i}.example", status="active", account_count=i))
        board = HostBoard(store, policy)
        await board.ensure_loaded()
        assert (board.counts(), board.accounts()) == await truth(store, policy)
        for status in ("idle", "offline", "throttled", "banned", "active", "banned"):
            assert await board.set_status("h1.example", status)
            assert (board.counts(), board.accounts()) == await truth(store, policy)
        assert not await board.set_status("nowhere.example", "idle")  # no such row: nothing changes
        new = HostState(hostname="new.trusted.example", status="active")
        await store.upsert_host(new)
        board.stored(new)
        limited = HostState(hostname="h2.example", status="active", account_limit=9)
        await store.upsert_host(limited)
        board.stored(limited)
        assert (board.counts(), board.accounts()) == await truth(store, policy)
        # what the sequencer reports after a committed batch, written as the batch writes it
        deltas = {"h0.example": 2, "h2.example": -1, "carried.example": 1}
        lease = await store.acquire_writer()
        try:
            await lease.commit_batch(BatchWrite(expected_high_water=0, new_high_water=0,
                                                host_updates={h: (None, None, d) for h, d in deltas.items()}))
        finally:
            await lease.release()
        board.add_accounts(deltas)
        assert (board.counts(), board.accounts()) == await truth(store, policy)
        # a row written behind the board's back joins it when its status is next set
        await store.upsert_host(HostState(hostname="behind.example", status="active"))
        assert await board.set_status("behind.example", "offline")
        assert (board.counts(), board.accounts()) == await truth(store, policy)
    finally:
        await store.close()


def _gauges(text: str) -> tuple[dict[str, float], dict[str, float]]:
    hosts: dict[str, float] = {}
    accounts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "relay_hosts":
                hosts[s.labels["status"]] = s.value
            elif s.name == "relay_host_accounts":
                accounts[s.labels["host"]] = s.value
    return hosts, accounts


async def test_scrapes_follow_host_statuses_without_reading_the_store(tmp_path: Path) -> None:
    """A running relay's ``relay_hosts{status}`` follows a host going offline (the status watch)
    and being banned and unbanned (admin), and a ``/metrics`` scrape, a status-watch pass or a
    status-healer tick runs no statement reading the ``hosts`` table."""
    store = await open_counting(tmp_path / "relay.sqlite")
    for i in range(20):
        await store.upsert_host(HostState(hostname=f"gone{i}.example", status="banned", account_count=i))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    async with running_relay(store=store, database_url=str(tmp_path / "relay.sqlite"),
                             allow_insecure_hosts=True) as relay, \
            httpx.AsyncClient(base_url=relay.url) as http:
        ingest = relay.service.upstreams
        hosts = relay.service.hosts
        assert ingest is not None and hosts is not None
        ingest.backoff_base = 0.02
        await store.upsert_host(HostState(hostname=dead, status="active"))
        await ingest.start_host(HostState(hostname=dead, status="active"))

        async def scrape() -> tuple[dict[str, float], dict[str, float]]:
            store.statements.clear()
            text = (await http.get("/metrics")).text
            assert store.host_reads() == [], store.host_reads()
            return _gauges(text)

        counts, accounts = await scrape()
        assert counts["banned"] == 20 and counts["active"] == 1 and dead in accounts
        for _ in range(600):  # the subscriber fails to connect until the watch calls it offline
            store.statements.clear()
            await ingest.watch_hosts(offline_after=3)
            assert all(not s.lstrip().upper().startswith("SELECT") for s in store.host_reads())
            if relay.service.hosts.board.status(dead) == "offline":
                break
            await asyncio.sleep(0.05)
        counts, _ = await scrape()
        assert counts["offline"] == 1 and counts["active"] == 0
        healer = relay.service.healer
        assert healer is not None
        store.statements.clear()
        await healer.step()  # the status healer's tick learns its hosts from the board too
        assert store.host_reads() == [], store.host_reads()
        assert (await store.get_host(dead)).status == "offline"  # type: ignore[union-attr]
        await hosts.block(dead)
        counts, accounts = await scrape()
        assert counts["banned"] == 21 and counts["offline"] == 0 and dead not in accounts
        await hosts.unblock(dead)
        counts, accounts = await scrape()
        assert counts["banned"] == 20 and counts["active"] == 1 and dead in accounts


async def test_account_gauges_follow_the_sequencers_batches(tmp_path: Path) -> None:
    """Accounts first seen on a host reach ``relay_host_accounts`` through the sequencer's
    committed batches (no store read at the scrape), equal to the stored count."""
    from sim import SimConfig, SimFleet
    from tests.relay.e2e import Consumer, commits_of, crawl

    store = await open_counting(tmp_path / "relay.sqlite")
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=3, seed=2702))
    await fleet.start()
    try:
        async with running_relay(store=store, database_url=str(tmp_path / "relay.sqlite"), allow_insecure_hosts=True,
                                 plc_url=fleet.plc_url, validation_workers=0) as relay, \
                Consumer(relay.ws_url, cursor=0) as consumer, httpx.AsyncClient(base_url=relay.url) as http:
            await crawl(relay.url, fleet.hosts[0].hostname)
            await fleet.generate(6)
            for account in fleet.accounts:
                await consumer.wait_for(lambda evs, a=account: a.repo.rev in commits_of(consumer, a.did))
            host = fleet.hosts[0].hostname
            stored = await store.get_host(host)
            assert stored is not None and stored.account_count == 3
            store.statements.clear()
            _, accounts = _gauges((await http.get("/metrics")).text)
            assert store.host_reads() == []
            assert accounts[host] == 3
    finally:
        await fleet.stop()
