"""Child process for the crash-safety test: sequences upstream events ``first..last`` of one
host into the store at URL, printing ``PUBLISHED <seq>`` after each durable batch.

``--stall-at K`` freezes the writer *inside* the transaction of the first batch whose host cursor
reaches K (after its events were written, before host cursor and commit) and prints ``STALL``,
so the parent can SIGKILL it mid-batch deterministically.

    python -m tests.backfill.crash_child URL FIRST LAST [--stall-at K]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from backfill import postgres_store, sqlite_store
from backfill.backends import open_store
from backfill.sequencer import Sequencer
from backfill.store import BatchWrite
from firehose.state import SequencedEvent
from tests.backfill.helpers import commit_event


def _reaches(batch: BatchWrite, stall_at: int) -> bool:
    return any(c is not None and c >= stall_at for c, _, _ in batch.host_updates.values())


def install_stall(stall_at: int) -> None:
    pg_original = postgres_store._PgLease._write_hosts
    sqlite_original = sqlite_store._write_hosts

    async def pg_stall(self: postgres_store._PgLease, batch: BatchWrite) -> None:
        if _reaches(batch, stall_at):
            print("STALL", flush=True)
            await asyncio.sleep(3600)
        await pg_original(self, batch)

    def sqlite_stall(conn, batch: BatchWrite) -> None:  # type: ignore[no-untyped-def]
        if _reaches(batch, stall_at):
            print("STALL", flush=True)
            time.sleep(3600)
        sqlite_original(conn, batch)

    postgres_store._PgLease._write_hosts = pg_stall  # type: ignore[method-assign]
    sqlite_store._write_hosts = sqlite_stall


async def run(url: str, first: int, last: int) -> None:
    store = await open_store(url)
    await store.migrate()

    async def publish(events: list[SequencedEvent]) -> None:
        print(f"PUBLISHED {events[-1].seq}", flush=True)

    seq = Sequencer(store, publish, max_batch=25, max_delay=0.001, wait_for_lock=True, lock_timeout=30)
    async with seq:
        futures = [await seq.enqueue(commit_event(n)) for n in range(first, last + 1)]
        await asyncio.gather(*futures)
    await store.close()
    print("DONE", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("first", type=int)
    parser.add_argument("last", type=int)
    parser.add_argument("--stall-at", type=int, default=None)
    args = parser.parse_args()
    if args.stall_at is not None:
        install_stall(args.stall_at)
    asyncio.run(run(args.url, args.first, args.last))


if __name__ == "__main__":
    main()
