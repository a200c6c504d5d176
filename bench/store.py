"""Benchmark of the event store and the sequencer, on PostgreSQL and SQLite.

    .venv/bin/python bench/store.py [--backend pg|sqlite|both] [--events N] [--batch N]
                                    [--body cbor|dict] [--pg-dsn DSN]

For each backend, on a fresh schema (Postgres) or file (SQLite):

* ``<b>_sequence_events_per_s``: ``#commit`` events with 2-4 KB bodies (incompressible CAR-like
  bytes, one op, CIDs), 10,000 accounts, submitted through ``Sequencer`` (batching, seq
  assignment, frame encoding or seq splicing, COPY/insert, account upsert, host cursor, commit)
  — from first enqueue to the last acknowledgement awaited (in order, like a subscriber);
* ``<b>_replay_events_per_s``: one reader paging through the whole window with ``read_after``
  (2,000 per page) right after it was written; ``<b>_replay_warm_events_per_s``: a second pass;
* ``<b>_retention_delete_per_s``: ``trim`` of the whole window (batches of 5,000).

* ``<b>_sequence_client_cpu_us_per_event`` / ``pg_sequence_server_cpu_us_per_event``: CPU time per
  sequenced event in this process and in the Postgres backends — unlike the rates, these hardly
  depend on what else the shared machine is running;
* ``<b>_sequence_cores_used_x100``: (client + server CPU) / wall time, in hundredths of a core —
  how much of the shared machine the run got;
* ``producer_encode_cpu_us_per_event`` (default ``--body cbor``): CPU to pre-encode each body the
  way a validation worker would (``firehose.framing.encode_unsequenced``), spent outside the
  sequencer and not included in the sequencing figures; ``--body dict`` makes the sequencer
  encode every body itself instead;
* ``pg_copy_only_events_per_s``: context only — bare binary COPY of the same frames into a scratch
  table, i.e. what this machine's Postgres can absorb at all at that moment.

Prints ``RESULT <name>=<value>`` lines. Targets (Postgres, 2 cores): sequence >= 20,000/s,
replay >= 50,000/s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import asyncpg
import cbrrr

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backfill.backends import open_store  # noqa: E402
from backfill.postgres_store import PostgresStore  # noqa: E402
from backfill.sequencer import Sequencer  # noqa: E402
from backfill.store import Store  # noqa: E402
from firehose.frames import encode_frame  # noqa: E402
from firehose.framing import encode_unsequenced  # noqa: E402
from firehose.state import AccountState, PendingEvent, SequencedEvent  # noqa: E402

ACCOUNTS = 10_000
HOSTS = 20


def tid(n: int) -> str:
    alphabet = "234567abcdefghijklmnopqrstuvwxyz"
    value = (1 << 52) + n
    return "".join(alphabet[(value >> (5 * i)) & 31] for i in reversed(range(13)))


def make_events(count: int, seed: int = 1) -> list[PendingEvent]:
    rng = random.Random(seed)
    events = []
    for n in range(1, count + 1):
        account = rng.randrange(ACCOUNTS)
        did = f"did:plc:{account:024d}"
        rev = tid(n)
        blocks = rng.randbytes(rng.randrange(2000, 3800))
        commit = cbrrr.CID.cidv1_dag_cbor_sha256_32_from(blocks[:64])
        record = cbrrr.CID.cidv1_dag_cbor_sha256_32_from(blocks[64:128])
        body = {
            "repo": did,
            "rev": rev,
            "since": tid(n - 1),
            "commit": commit,
            "blocks": blocks,
            "ops": [{"action": "create", "path": f"app.bsky.feed.post/{rev}", "cid": record, "prev": None}],
            "prevData": record,
            "time": "2026-11-22T00:00:00.000Z",
            "blobs": [],
            "rebase": False,
            "tooBig": False,
        }
        host = f"pds{account % HOSTS}.example"  # an account lives on one host
        state = AccountState(did, host=host, rev=rev, commit_cid=commit.encode(), data_cid=record.encode())
        events.append(PendingEvent("#commit", did, body, rev=rev, account=state, host=host, upstream_seq=n))
    return events


def preencode(events: list[PendingEvent]) -> None:
    """Do what a validation worker would: encode each body (without seq) and note where seq goes
    (``PendingEvent.body_cbor``/``seq_offset``), so the sequencer only splices seq in."""
    for event in events:
        event.body_cbor, event.seq_offset = encode_unsequenced(event.body)


async def noop_publish(events: list[SequencedEvent]) -> None:
    return None


async def bench_backend(name: str, store: Store, events: list[PendingEvent], batch: int) -> dict[str, float]:
    await store.migrate()
    # The input set is pre-built (hundreds of MB of live objects a real relay never holds at
    # once); keep the cyclic GC from re-walking it on every collection.
    gc.collect()
    gc.freeze()
    results: dict[str, float] = {}

    seq = Sequencer(store, noop_publish, max_batch=batch, max_delay=0.002, max_pending=50_000)
    await seq.start()
    backends = await backend_pids(store, seq)
    wal0 = await wal_position(store)
    cpu0, server0 = time.process_time(), sum(map(process_cpu, backends))
    t0 = time.perf_counter()
    # Like an upstream subscriber: keep events in flight and await their acks in order, dropping
    # each result once acknowledged (holding all 60,000 frames would cost page faults a relay
    # never pays).
    acks: deque[asyncio.Future[SequencedEvent | None] | None] = deque()
    more = asyncio.Event()

    async def acknowledge() -> None:
        while True:
            while not acks:
                more.clear()
                await more.wait()
            future = acks.popleft()
            if future is None:
                return
            await future

    acker = asyncio.create_task(acknowledge())
    for event in events:
        acks.append(await seq.enqueue(event))
        more.set()
    acks.append(None)
    more.set()
    await acker
    elapsed = time.perf_counter() - t0
    cpu1, server1 = time.process_time(), sum(map(process_cpu, backends))
    wal1 = await wal_position(store)
    await seq.close()
    results[f"{name}_sequence_events_per_s"] = len(events) / elapsed
    # CPU spent per event, independent of how busy the shared machine is: this process (batching,
    # encoding, drivers; SQLite's own work included) and, on Postgres, the server backends.
    results[f"{name}_sequence_client_cpu_us_per_event"] = (cpu1 - cpu0) / len(events) * 1e6
    if backends:
        results[f"{name}_sequence_server_cpu_us_per_event"] = (server1 - server0) / len(events) * 1e6
    # How much of the 2-core machine the sequencing actually got (client + server CPU / wall):
    # on an idle machine this approaches the pipeline's own limit, on a shared one it shows the share.
    results[f"{name}_sequence_cores_used_x100"] = ((cpu1 - cpu0) + (server1 - server0)) / elapsed * 100
    if wal0 is not None and wal1 is not None:
        # Checkpoints that ran meanwhile explain most run-to-run spread (each one makes the server
        # write full page images and flush dirty buffers while the sequencer is writing).
        results[f"{name}_sequence_checkpoints"] = wal1[0] - wal0[0]
        results[f"{name}_sequence_wal_bytes_per_event"] = (wal1[1] - wal0[1]) / len(events)
    print(f"# {name}: sequenced {len(events)} in {elapsed:.2f}s, {seq.stats.batches} batches", flush=True)

    # First replay right after writing (Postgres still sets hint bits), then a warm one.
    for label in ("replay", "replay_warm"):
        t0 = time.perf_counter()
        cursor, read = 0, 0
        while True:
            page = await store.read_after(cursor, 2000)
            if not page:
                break
            read += len(page)
            cursor = page[-1].seq
        elapsed = time.perf_counter() - t0
        assert read == len(events), (read, len(events))
        results[f"{name}_{label}_events_per_s"] = read / elapsed

    if isinstance(store, PostgresStore):
        results["pg_copy_only_events_per_s"] = await copy_ceiling(store, events)

    t0 = time.perf_counter()
    deleted = await store.trim(older_than_seconds=-3600, batch=5000)
    elapsed = time.perf_counter() - t0
    assert deleted == len(events), deleted
    results[f"{name}_retention_delete_per_s"] = deleted / elapsed
    return results


async def wal_position(store: Store) -> tuple[int, int] | None:
    """(checkpoints so far, WAL bytes so far) of the Postgres server; None on SQLite."""
    if not isinstance(store, PostgresStore):
        return None
    row = await store._pool.fetchrow(
        "SELECT checkpoints_timed + checkpoints_req, pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8"
        " FROM pg_stat_bgwriter"
    )
    return int(row[0]), int(row[1])


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a local process (a Postgres backend), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def backend_pids(store: Store, seq: Sequencer) -> list[int]:
    """Server pids of the writer connection and the (single) pool connection, on Postgres."""
    if not isinstance(store, PostgresStore):
        return []
    async with store._pool.acquire() as conn:
        reader = conn.get_server_pid()
    return [seq._lease._conn.get_server_pid(), reader]  # type: ignore[union-attr]


async def copy_ceiling(store: PostgresStore, events: list[PendingEvent]) -> float:
    """Context for the sequencing figure: bare binary COPY of the same rows (no seq logic, no
    account state, no cursor) into a scratch table shaped like ``events``, same batch size."""
    rows = [
        (n, e.did, e.kind, time.time(), encode_frame(e.kind, {**e.body, "seq": n}))
        for n, e in enumerate(events, 1)
    ]
    async with store._pool.acquire() as conn:
        await conn.execute("DROP TABLE IF EXISTS copy_ceiling")
        await conn.execute(
            "CREATE TABLE copy_ceiling (LIKE events INCLUDING ALL) WITH (toast_tuple_target = 8160)"
        )
        await conn.execute("ALTER TABLE copy_ceiling ALTER COLUMN frame SET STORAGE EXTERNAL")
        t0 = time.perf_counter()
        for i in range(0, len(rows), 2000):
            async with conn.transaction():
                await conn.copy_records_to_table("copy_ceiling", records=rows[i : i + 2000])
        elapsed = time.perf_counter() - t0
        await conn.execute("DROP TABLE copy_ceiling")
    return len(rows) / elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["pg", "sqlite", "both"], default="both")
    parser.add_argument("--events", type=int, default=60_000)
    parser.add_argument("--batch", type=int, default=2000, help="sequencer max_batch")
    parser.add_argument(
        "--body",
        choices=["cbor", "dict"],
        default="cbor",
        help="cbor: bodies pre-encoded as a validation worker would (PendingEvent.body_cbor, "
        "the sequencer splices seq in; the encoding CPU is reported separately); dict: the "
        "sequencer encodes every body itself",
    )
    parser.add_argument(
        "--pg-dsn", default=os.environ.get("RELAY_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    )
    args = parser.parse_args()
    results: dict[str, float] = {}

    def build() -> list[PendingEvent]:
        events = make_events(args.events)
        if args.body == "cbor":
            cpu0 = time.process_time()
            preencode(events)
            # CPU the producers (validation workers, other processes) spend instead of the
            # sequencer: not part of the sequencing figures below.
            results["producer_encode_cpu_us_per_event"] = (time.process_time() - cpu0) / len(events) * 1e6
        return events

    events = build()
    size = sum(len(e.body["blocks"]) for e in events) / len(events)
    print(f"# {len(events)} events, mean blocks size {size:.0f} bytes, bodies: {args.body}", flush=True)
    if args.backend in ("pg", "both"):
        schema = f"bench_store_{os.getpid()}"
        store = await open_store(args.pg_dsn, schema=schema, pool_size=1)
        try:
            results |= await bench_backend("pg", store, events, args.batch)
        finally:
            await store.close()
            conn = await asyncpg.connect(args.pg_dsn)
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            await conn.close()
        events = build()  # fresh objects (the sequencer stamps account state)
    if args.backend in ("sqlite", "both"):
        with tempfile.TemporaryDirectory() as tmp:
            store = await open_store(str(Path(tmp) / "bench.sqlite"))
            try:
                results |= await bench_backend("sqlite", store, events, args.batch)
            finally:
                await store.close()
    for key, value in results.items():
        print(f"RESULT {key}={value:.0f}")


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())
