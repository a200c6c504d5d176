"""Helpers for the Spark job tests: a simulated fleet on its own loop thread, seeding the relay
database from it, and job settings that point at it."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

from backfill.backends import open_store
from firehose.state import AccountState
from mst.car import read_car
from mst.cid import cid_str
from spark.config import FetchConfig, JobConfig

T = TypeVar("T")


class FleetThread:
    """A ``sim.SimFleet`` served from a background event loop."""

    def __init__(self, hosts: int, accounts_per_host: int, seed: int, initial_records: int = 3) -> None:
        from sim import SimConfig, SimFleet

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="sim-fleet")
        self.thread.start()
        self.fleet = SimFleet(SimConfig(hosts=hosts, accounts_per_host=accounts_per_host, seed=seed,
                                        initial_records=initial_records, announce_accounts=False))
        self.run(self.fleet.start())

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Any, *args: Any) -> Any:
        """Run a plain function on the fleet's loop thread (the fleet is not thread-safe)."""

        async def wrapper() -> Any:
            return fn(*args)

        return self.run(wrapper())

    def stop(self) -> None:
        try:
            self.run(self.fleet.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            self.loop.close()


def account_state(acct: Any) -> AccountState:
    """What a caught-up relay stores for a simulated account."""
    return AccountState(
        did=acct.did,
        host=acct.host.hostname,
        upstream_status=acct.status,
        rev=acct.repo.rev,
        commit_cid=cid_str(acct.repo.head),
        data_cid=cid_str(acct.repo.data_root),
        sync_state="synced",
    )


def seed_relay(url: str, fleet: FleetThread, skip: set[str] = frozenset()) -> None:
    """Store every simulated account (and host) as a caught-up relay would."""
    from backfill.types import HostState

    states = fleet.call(lambda: [account_state(a) for a in fleet.fleet.accounts if a.did not in skip])
    hosts = [h.hostname for h in fleet.fleet.hosts]

    async def seed() -> None:
        store = await open_store(url)
        try:
            for host in hosts:
                await store.upsert_host(HostState(hostname=host))
            for state in states:
                await store.upsert_account(state)
        finally:
            await store.close()

    asyncio.run(seed())


def job_config(url: str, fleet: FleetThread, run_id: str | None = None, **fetch: Any) -> JobConfig:
    cfg = FetchConfig(allow_private=True, scheme="http", plc_url=fleet.fleet.plc_url, timeout_s=10.0,
                      retries=1, backoff_s=0.05, host_rate=500.0, **fetch)
    return JobConfig(db_url=url, run_id=run_id or f"t-{uuid.uuid4().hex[:8]}", fetch=cfg, write_batch=7,
                     partitions=2)


def tamper(acct: Any) -> None:
    """Make the host serve a repository with one record block altered (its hash no longer matches)."""
    path, cid = sorted(acct.repo.records().items())[0]
    car = acct.repo.export_car()
    raw = bytes(read_car(car).blocks[cid])
    assert b"app.bsky" in raw and car.count(raw) == 1
    tampered = car.replace(raw, raw.replace(b"app.bsky", b"app.bskz", 1))
    acct.repo.export_car = lambda: tampered


async def apply_outbox(url: str, plc_url: str) -> tuple[Any, list[Any]]:
    """Apply the repair outbox as a running relay does: each row in its account's lane
    (``relay.ingest.lanes.AccountLanes.apply_repair``), through the real sequencer. No host is followed
    here, so every row is ready at once. Returns the drain result and the events it stored."""
    from backfill.outbox import drain_repair_outbox
    from backfill.sequencer import Sequencer
    from firehose.pipeline import ValidationPool
    from relay.config import RelayConfig
    from relay.hosts import HostBoard, HostPolicy
    from relay.identity import IdentityResolver
    from relay.ingest.admission import Admission
    from relay.ingest.lanes import AccountLanes
    from relay.ingest.resync_queue import ResyncQueue
    from relay.ssrf import AddressGuard, SafeClient

    async def publish(events: list[Any]) -> None:
        pass

    store = await open_store(url)
    try:
        before = await store.latest_seq()
        config = RelayConfig(allow_insecure_hosts=True, plc_url=plc_url)
        policy = HostPolicy(config)
        identity = IdentityResolver(plc_url=plc_url, safe_client=SafeClient(AddressGuard(allow_insecure=True)))
        pool = ValidationPool(0)
        await pool.start()
        async with Sequencer(store, publish) as sequencer:
            lanes = AccountLanes(store=store, sequencer=sequencer, pool=pool,
                                 admission=Admission(store=store, identity=identity, policy=policy,
                                                     default_account_limit=None, board=HostBoard(store, policy)),
                                 identity=identity, resync=ResyncQueue(), count=lambda kind, reason: None)
            result = await drain_repair_outbox(store, lanes.apply_repair)
        await pool.close()
        events = await store.read_after(before)
    finally:
        await store.close()
    return result, events
