"""Scale: the relay on a store that already knows many accounts.

Set-up (not measured): a simulated fleet whose ``--working-set`` accounts are the only ones that
post; a store bulk-loaded (the store's own batched SQL writers, rows made batch by batch as they are
written, so the loader's memory does not grow with ``--accounts``) with ``--accounts`` account rows
(the working set at its real heads, the rest synthetic: real-looking DIDs, TIDs, CIDs, spread over
the fleet's hosts), a persisted identity for every one of them (fetched within the last 12 h, so
all fresh), and ``--events`` events (real ``#commit`` frames of a scratch fleet, re-sequenced,
their times spread over the last 70 h of the replay window).

Measured, each printed as a ``RESULT`` line:

* ``scale_commits_per_s`` (median over ``--phases`` phases; each phase's commits come from its own
  slice of the working set, so every phase brings accounts the relay has not touched yet: the
  working set rotates), ``scale_cpu_ms_per_commit`` (main process + validation workers) and
  ``scale_cpu_main_ms_per_commit``; ``scale_rss_mb`` / ``scale_rss_main_mb`` after the phases;
* restart: the relay is stopped, ``--restart-commits`` more commits are emitted while it is down,
  and it is started again on the same store: ``scale_restart_listening_s`` (process start to
  listening), ``scale_restart_full_speed_s`` (process start until the delivery rate over the last
  second reaches 90 % of the phases' median), ``scale_restart_caught_up_s`` (until every commit is
  delivered) and ``scale_restart_identity_requests`` (requests the PLC directory got meanwhile:
  0 when every identity is fresh in the store);
* ``scale_listrepos_accounts_per_s``: ``com.atproto.sync.listRepos`` paged through every account
  (limit 1000);
* ``scale_replay_seek_ms_{start,middle,end}``: a consumer connecting with a cursor at the start,
  middle and end of the window, until its first frame (median of 3).

    .venv/bin/python bench/scale.py --quick          # 20,000 accounts, 200,000 events: minutes
    .venv/bin/python bench/scale.py                  # 1,000,000 accounts, 10,000,000 events
    .venv/bin/python bench/scale.py --db postgres    # the same on PostgreSQL (a fresh schema)
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cbrrr  # noqa: E402
import httpx  # noqa: E402

from backfill.backends import open_store  # noqa: E402
from backfill.identities import Identity  # noqa: E402
from backfill.store import BatchWrite, Store  # noqa: E402
from bench._common import (  # noqa: E402
    PG_DSN,
    CountingConsumer,
    RelayProc,
    cpu_seconds,
    load_average,
    note,
    relay,
    result,
    rss_bytes,
)
from firehose.frames import decode_frame  # noqa: E402
from firehose.framing import encode_unsequenced, frame_header, splice_seq  # noqa: E402
from firehose.state import AccountState  # noqa: E402
from firehose.validate import cid_text, outgoing_body  # noqa: E402
from sim import SimConfig, SimFleet  # noqa: E402
from sim.host import SimAccount  # noqa: E402
from sim.ident import SigningKey, tid_from_micros  # noqa: E402

HOUR = 3600.0
BATCH = 10_000


# -- set-up ------------------------------------------------------------------------------------
async def sample_frames(n: int = 400) -> list[tuple[str, bytes, int]]:
    """``(did, unsequenced body, seq offset)`` of real ``#commit`` frames from a scratch fleet."""
    scratch = SimFleet(SimConfig(hosts=1, accounts_per_host=25, seed=99, announce_accounts=False))
    await scratch.start()
    try:
        await scratch.generate(n)
        out = []
        for entry in scratch.hosts[0].log.entries:
            frame = decode_frame(entry.frame)
            if frame.t == "#commit":
                body, offset = encode_unsequenced(outgoing_body(frame.t, frame.body))
                out.append((str(frame.body["repo"]), body, offset))
        return out
    finally:
        await scratch.stop()


def _cid(i: int, salt: bytes) -> str:
    return str(cbrrr.CID.cidv1_dag_cbor_sha256_32_from(salt + i.to_bytes(8, "big")).encode())


#: the base32 alphabet in ASCII order, so that synthetic DIDs made from increasing numbers sort as strings
_SORTED_B32 = "234567abcdefghijklmnopqrstuvwxyz"


def _synthetic_did(value: int) -> str:
    """A syntactically valid ``did:plc:`` from a 120-bit number (24 base32 characters); larger
    numbers give larger strings."""
    return "did:plc:" + "".join(_SORTED_B32[(value >> (115 - 5 * i)) & 31] for i in range(24))


def account_batches(fleet: SimFleet, total: int, now: float, rng: random.Random) -> Iterator[list[AccountState]]:
    """``total`` account rows in DID order, ``BATCH`` at a time, made as they are written (nothing
    held for the whole network): the working set at its real heads, merged with synthetic accounts
    (real-looking DIDs spread evenly over the DID space at random offsets, TIDs, CIDs, spread over
    the fleet's hosts)."""
    real = sorted((AccountState(a.did, a.host.hostname, rev=a.repo.rev, commit_cid=cid_text(a.repo.head),
                                data_cid=cid_text(a.repo.data_root), updated_at=now) for a in fleet.accounts),
                  key=lambda r: r.did)
    hosts = [h.hostname for h in fleet.hosts]
    base = int((now - 400 * 86400) * 1e6)
    n = max(0, total - len(real))
    stride = (1 << 120) // max(1, n)

    def synthetic() -> Iterator[AccountState]:
        for i in range(n):
            micros = base + rng.randrange(390 * 86400 * 10**6)
            yield AccountState(_synthetic_did(i * stride + rng.randrange(stride)), hosts[i % len(hosts)],
                               rev=tid_from_micros(micros), commit_cid=_cid(i, b"c"), data_cid=_cid(i, b"d"),
                               updated_at=now - rng.random() * 30 * 86400)

    batch: list[AccountState] = []
    for row in heapq.merge(real, synthetic(), key=lambda r: r.did):
        batch.append(row)
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def identity_rows(sim: dict[str, SimAccount], accounts: list[AccountState], keys: list[str], now: float,
                  rng: random.Random, first: int) -> list[Identity]:
    """A persisted identity per account, fetched within the last 12 h (fresh); synthetic accounts
    take their keys from ``keys`` in turn (``first``: the number of the batch's first account)."""
    out = []
    for i, row in enumerate(accounts, first):
        fetched = now - rng.random() * 12 * HOUR
        acct = sim.get(row.did)
        if acct is not None:
            out.append(Identity(acct.did, acct.key.did_key(), acct.host.url, acct.handle, fetched))
        else:
            out.append(Identity(row.did, keys[i % len(keys)], f"https://pds-{i % 97}.example.com",
                                f"user{i}.example.com", fetched, True, fetched))
    return out


async def load_store(store: Store, fleet: SimFleet, n_accounts: int, n_events: int) -> None:
    """Bulk-load accounts, identities and events, a batch of each at a time (the store's own bulk
    writers: one transaction a batch, host account counts kept); rows are made as they are
    written, so ten million accounts need no more memory than ten thousand."""
    rng = random.Random(7)
    now = time.time()
    sim = {a.did: a for a in fleet.accounts}
    keys = [SigningKey.generate(rng.choice(["k256", "p256"]), rng).did_key() for _ in range(500)]
    frames = await sample_frames()
    t = time.perf_counter()
    batches = account_batches(fleet, n_accounts, now, rng)
    lease = await store.acquire_writer()
    try:
        high = await lease.high_water()
        span = 70 * HOUR
        start = now - span - 60
        e = a = 0
        while True:
            chunk = next(batches, [])
            if e >= n_events and not chunk:
                break
            if chunk:
                await store.write_identities(identity_rows(sim, chunk, keys, now, rng, a))
            batch = BatchWrite(expected_high_water=high, new_high_water=high)
            for _ in range(min(BATCH, n_events - e)):
                did, body, offset = frames[e % len(frames)]
                seq = high + 1
                high = seq
                batch.events.append((seq, did, "#commit", start + span * e / max(1, n_events),
                                     splice_seq(body, seq, frame_header("#commit"), offset)))
                e += 1
            batch.new_high_water = high
            a += len(chunk)
            batch.accounts = chunk
            counts: dict[str, int] = {}
            for acct in chunk:
                counts[acct.host or ""] = counts.get(acct.host or "", 0) + 1
            batch.host_updates = {h: (None, None, c) for h, c in counts.items()}
            await lease.commit_batch(batch)
            if a and a % 1_000_000 == 0:
                note(f"scale: {a} accounts loaded, {time.perf_counter() - t:.0f}s")
    finally:
        await lease.release()
    note(f"scale: {e} events, {a} accounts and identities written in {time.perf_counter() - t:.0f}s")


# -- measurement -------------------------------------------------------------------------------
class Sampler:
    """Delivered-commit counts and the relay's CPU, sampled every 50 ms."""

    def __init__(self, r: RelayProc, consumer: CountingConsumer) -> None:
        self.main = r.proc.pid
        self.workers = [p for p in r.refresh_pids() if p != self.main]
        self.consumer = consumer
        self.base = consumer.commits
        self.samples: list[tuple[float, int]] = []
        self.cpu_main0 = cpu_seconds([self.main])
        self.cpu_workers0 = cpu_seconds(self.workers)

    async def until(self, expected: int, stall_s: float = 60.0) -> int:
        last_n, last_change = -1, time.monotonic()
        while True:
            n = self.consumer.commits - self.base
            self.samples.append((time.monotonic(), n))
            if n != last_n:
                last_n, last_change = n, time.monotonic()
            if n >= expected or time.monotonic() - last_change > stall_s:
                return n
            await asyncio.sleep(0.05)

    def steady_rate(self) -> float:
        """Commits/s between 10 % and 90 % of the delivered ones (0.0 when none arrived)."""
        delivered = self.samples[-1][1]
        if delivered == 0:
            return 0.0
        lo = next(s for s in self.samples if s[1] >= 0.1 * delivered)
        hi = next(s for s in self.samples if s[1] >= 0.9 * delivered)
        if hi[0] - lo[0] < 0.2:
            first = next(s for s in self.samples if s[1] > 0)
            return delivered / max(1e-9, self.samples[-1][0] - first[0])
        return (hi[1] - lo[1]) / (hi[0] - lo[0])

    def cpu(self) -> tuple[float, float]:
        return cpu_seconds([self.main]) - self.cpu_main0, cpu_seconds(self.workers) - self.cpu_workers0


async def phase(fleet: SimFleet, r: RelayProc, consumer: CountingConsumer, among: list[SimAccount],
                commits: int) -> tuple[float, float, float, int]:
    """Emit ``commits`` commits of ``among`` at once; (rate, cpu main s, cpu workers s, delivered)."""
    fleet.prepare(commits, among)
    sampler = Sampler(r, consumer)
    await fleet.release(None)
    delivered = await sampler.until(commits)
    if consumer.closed_reason:
        raise RuntimeError(f"the relay closed the counting consumer: {consumer.closed_reason}")
    main, workers = sampler.cpu()
    return sampler.steady_rate(), main, workers, delivered


async def seek_ms(ws_url: str, cursor: int) -> float:
    from websockets.asyncio.client import connect

    t = time.perf_counter()
    async with connect(f"{ws_url}?cursor={cursor}", max_size=None, compression=None, open_timeout=60) as ws:
        await asyncio.wait_for(ws.recv(), 60)
        return 1000 * (time.perf_counter() - t)


async def list_repos_rate(url: str) -> tuple[int, float]:
    t = time.perf_counter()
    seen = 0
    cursor = None
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while True:
            params: dict[str, str | int] = {"limit": 1000, **({"cursor": cursor} if cursor else {})}
            body = (await http.get("/xrpc/com.atproto.sync.listRepos", params=params)).json()
            seen += len(body["repos"])
            cursor = body.get("cursor")
            if not cursor or not body["repos"]:
                break
    return seen, seen / (time.perf_counter() - t)


async def run(a: argparse.Namespace) -> None:
    hosts = 4
    fleet = SimFleet(SimConfig(hosts=hosts, accounts_per_host=a.working_set // hosts, seed=5,
                               announce_accounts=False))
    t = time.perf_counter()
    await fleet.start()
    note(f"scale: fleet of {len(fleet.accounts)} accounts up in {time.perf_counter() - t:.0f}s")
    workdir = tempfile.TemporaryDirectory(prefix="relay-scale-")
    if a.db == "postgres":
        database_url = f"{PG_DSN}?schema=bench_scale_{int(time.time())}"
    else:
        database_url = str(Path(workdir.name) / "relay.sqlite")
    try:
        store = await open_store(database_url)
        try:
            await store.migrate()
            await load_store(store, fleet, a.accounts, a.events)
        finally:
            await store.close()
        if a.db == "sqlite":  # a long-running relay's file is checkpointed: fold the loaded WAL in
            import sqlite3

            with sqlite3.connect(database_url) as conn:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        per_phase = a.commits // a.phases
        size = len(fleet.accounts) // a.phases
        rates, cpu_main, cpu_workers, delivered = [], 0.0, 0.0, 0
        async with relay(fleet.plc_url, database_url=database_url) as r:
            await r.crawl([h.hostname for h in fleet.hosts])
            consumer = CountingConsumer(r.ws_url).start()
            await asyncio.wait_for(consumer.connected.wait(), 60)
            for i in range(a.phases):
                rate, main, workers, n = await phase(fleet, r, consumer, fleet.accounts[i * size:(i + 1) * size],
                                                     per_phase)
                note(f"scale: phase {i}: {n}/{per_phase} commits at {rate:.0f}/s")
                rates.append(rate)
                cpu_main += main
                cpu_workers += workers
                delivered += n
            rss_main, rss_all = rss_bytes([r.proc.pid]), r.rss()
            await consumer.stop()
        steady = statistics.median(rates)
        result("scale_accounts", a.accounts)
        result("scale_events", a.events)
        result("scale_working_set", len(fleet.accounts))
        result("scale_commits_per_s", steady)
        result("scale_commits_delivered", delivered)
        result("scale_cpu_ms_per_commit", 1000 * (cpu_main + cpu_workers) / max(1, delivered))
        result("scale_cpu_main_ms_per_commit", 1000 * cpu_main / max(1, delivered))
        result("scale_rss_mb", rss_all / 1e6)
        result("scale_rss_main_mb", rss_main / 1e6)

        # restart: commits emitted while the relay is down, then a new process on the same store
        store = await open_store(database_url)
        try:
            last_seq = await store.latest_seq()
        finally:
            await store.close()
        fleet.prepare(a.restart_commits, fleet.accounts)
        await fleet.release(None)
        requests0 = fleet.plc.requests
        t0 = time.monotonic()
        async with relay(fleet.plc_url, database_url=database_url) as r:
            listening = time.monotonic() - t0
            consumer = CountingConsumer(r.ws_url, cursor=last_seq).start()
            await asyncio.wait_for(consumer.connected.wait(), 60)
            sampler = Sampler(r, consumer)
            got = await sampler.until(a.restart_commits)
            caught_up = time.monotonic() - t0
            full_speed = caught_up
            for i, (at, n) in enumerate(sampler.samples):
                back = next((s for s in sampler.samples[:i] if s[0] >= at - 1.0), None)
                if back is not None and at - back[0] >= 0.5 and (n - back[1]) / (at - back[0]) >= 0.9 * steady:
                    full_speed = at - t0
                    break
            result("scale_restart_listening_s", listening)
            result("scale_restart_full_speed_s", full_speed)
            result("scale_restart_caught_up_s", caught_up)
            result("scale_restart_commits", got)
            result("scale_restart_identity_requests", fleet.plc.requests - requests0)
            await consumer.stop()

            n, rate = await list_repos_rate(r.url)
            result("scale_listrepos_accounts", n)
            result("scale_listrepos_accounts_per_s", rate)

            store = await open_store(database_url)
            try:
                oldest, latest = await store.oldest_seq(), await store.latest_seq()
            finally:
                await store.close()
            assert oldest is not None
            for name, cursor in (("start", oldest), ("middle", (oldest + latest) // 2), ("end", latest - 5)):
                times = [await seek_ms(r.ws_url, cursor) for _ in range(3)]
                result(f"scale_replay_seek_ms_{name}", statistics.median(times))
        result("scale_load_average", load_average())
    finally:
        await fleet.stop()
        workdir.cleanup()
        if a.db == "postgres":
            import asyncpg

            conn = await asyncpg.connect(PG_DSN)
            try:
                schema = database_url.rsplit("schema=", 1)[1]
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            finally:
                await conn.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small defaults: a check that it runs, in minutes")
    p.add_argument("--accounts", type=int, default=None, help="accounts in the store (default 1,000,000)")
    p.add_argument("--events", type=int, default=None, help="events in the store (default 10,000,000)")
    p.add_argument("--working-set", type=int, default=None, help="accounts that post (default 100,000)")
    p.add_argument("--commits", type=int, default=None, help="commits over all phases (default 40,000)")
    p.add_argument("--phases", type=int, default=4, help="working-set slices, one per phase")
    p.add_argument("--restart-commits", type=int, default=None, help="commits emitted while restarting")
    p.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    a = p.parse_args()
    quick = {"accounts": 20_000, "events": 200_000, "working_set": 2_000, "commits": 4_000, "restart_commits": 2_000}
    full = {"accounts": 1_000_000, "events": 10_000_000, "working_set": 100_000, "commits": 40_000,
            "restart_commits": 20_000}
    for key, value in (quick if a.quick else full).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.working_set = min(a.working_set, a.accounts)
    asyncio.run(run(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
