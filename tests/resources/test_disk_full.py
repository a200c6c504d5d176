"""A full disk holds the relay's ingest memory to its byte budget and loses nothing.

The relay's SQLite database lives on a small filesystem the test makes: a ``tmpfs`` of 64 MiB
mounted for the test (when it runs as root), then filled to the last byte with a filler file, so
every write the sequencer makes meets a real ``ENOSPC`` (SQLite's ``SQLITE_FULL``). Not root, or
mounting refused: the database is held at its current size with ``max_page_count`` instead, the
same ``SQLITE_FULL`` from SQLite itself.

While the disk is full ten hosts send 3,000 commits. What the relay holds of them — frames read
and not stored, and the events waiting in the sequencer — stays within ``RELAY_INGEST_BUFFER_MB``
(1 MiB here): the relay stops reading the hosts instead of buffering their backlog. Measured from
outside the budget's own accounting: the frames between each host's watermark and the last frame
the relay read (their bytes, from the simulator's log), and the sequencer's own queue. Once the
filler file is removed, every accepted event arrives exactly once, in order.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backfill.backends import open_store
from backfill.sequencer import Sequencer
from backfill.sqlite_store import SqliteStore
from backfill.store import Store
from firehose.state import PendingEvent
from sim import SimConfig, SimFleet, TruthEvent
from tests.faults.observe import RecordingConsumer
from tests.relay.e2e import crawl, key_of
from tests.relay.helpers import running_relay
from tests.waiting import until, until_async

pytestmark = pytest.mark.timeout(240)

HOSTS = 10
OFFERED = 3000  # commits sent while the disk is full: ~15 MB of frames as the budget counts them
BUDGET_MB = 1


@contextlib.contextmanager
def small_filesystem(path: Path, size: str = "64m") -> Iterator[bool]:
    """Mount a ``tmpfs`` of ``size`` on ``path`` (created); yields whether it is mounted (False:
    not root, or mounting refused — ``path`` is then a plain directory)."""
    path.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True, check=False).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


class FullDisk:
    """Fills the filesystem under the store (``fill``) and frees it again (``free``)."""

    def __init__(self, store: Store, directory: Path, mounted: bool) -> None:
        assert isinstance(store, SqliteStore)
        self.store = store
        self.filler = directory / "filler"
        self.mounted = mounted

    async def _pragma(self, sql: str) -> Any:
        return await self.store._writer.call(lambda conn: conn.execute(sql).fetchone())  # noqa: SLF001

    async def fill(self) -> None:
        if not self.mounted:
            pages = (await self._pragma("PRAGMA page_count"))[0]
            await self._pragma(f"PRAGMA max_page_count = {pages}")
            return
        chunk = 1 << 20
        with open(self.filler, "wb", buffering=0) as fh:
            while chunk:
                try:
                    fh.write(b"\0" * chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    chunk //= 2
        assert os.statvfs(self.filler).f_bavail == 0

    async def free(self) -> None:
        if self.mounted:
            self.filler.unlink()
        else:
            await self._pragma("PRAGMA max_page_count = 1073741823")


@contextlib.asynccontextmanager
async def recording(ws_url: str) -> AsyncIterator[RecordingConsumer]:
    """A consumer from cursor 0 that resumes from its last seq if its connection drops (a relay in
    this process is starved while the simulator signs commits; keepalives may time out)."""
    consumer = RecordingConsumer(ws_url)
    await consumer.start()
    try:
        yield consumer
    finally:
        await consumer.stop()


class InFlight:
    """Counts the events handed to the sequencer and not yet settled, and their high-water mark."""

    def __init__(self, sequencer: Sequencer) -> None:
        self.now = 0
        self.high = 0
        append = sequencer._append  # noqa: SLF001 - every queued event passes here (enqueue and enqueue_nowait)

        def counted(event: PendingEvent) -> Any:
            fut = append(event)
            self.now += 1
            self.high = max(self.high, self.now)
            fut.add_done_callback(self._settled)
            return fut

        sequencer._append = counted  # type: ignore[method-assign]  # noqa: SLF001

    def _settled(self, _: Any) -> None:
        self.now -= 1


async def test_a_full_disk_holds_ingest_to_its_budget_and_loses_nothing(tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "disk") as mounted:
        store = await open_store(str(tmp_path / "disk" / "relay.sqlite"))
        disk = FullDisk(store, tmp_path / "disk", mounted)
        async with SimFleet(SimConfig(hosts=HOSTS, accounts_per_host=5, seed=271)) as fleet, \
                running_relay(store=store, database_url=str(tmp_path / "disk" / "relay.sqlite"), allow_insecure_hosts=True, plc_url=fleet.plc_url, validation_workers=0,
                              ingest_buffer_mb=BUDGET_MB) as relay, \
                recording(relay.ws_url) as consumer, httpx.AsyncClient(base_url=relay.url) as http:
            service = relay.service
            upstreams, sequencer = service.upstreams, service.sequencer
            assert upstreams is not None and sequencer is not None
            limit = upstreams.budget.limit
            assert limit == BUDGET_MB << 20
            for host in fleet.hosts:
                await crawl(relay.url, host.hostname)
            warm = await fleet.markers()
            await until(lambda: {t.rev for t in warm} <= {f.rev for f in consumer.frames}, "the first events", timeout=60)
            in_flight = InFlight(sequencer)

            await disk.fill()
            truth: list[TruthEvent] = []
            for _ in range(OFFERED // 100):  # in steps, so the relay (this event loop) keeps up with its sockets
                truth += await fleet.generate(100)
            biggest = max(len(e.frame) for h in fleet.hosts for e in h.log.entries)
            await until(lambda: sequencer.state == "retrying" and upstreams.budget.used + 2 * biggest + 2048 > limit,
                        "the ingest budget to fill while the disk is full", timeout=90)
            ready = await http.get("/_ready")
            assert ready.status_code == 503, ready.text
            assert any(r.startswith("sequencer_retrying: disk_full") for r in ready.json()["reasons"]), ready.text

            # What the relay holds: the frames read and not done (their bytes, from the hosts' logs),
            # as the budget counts them (twice their bytes plus 2 KiB). Each host's reader may hold
            # one more frame, read and waiting for room: the last one it read.
            held = held_cost = waiting_cost = 0
            for host in fleet.hosts:
                low, high = upstreams.watermark(host.hostname) or 0, upstreams.last_read(host.hostname) or 0
                for entry in host.log.entries:
                    if low < entry.seq <= high:
                        held += 1
                        held_cost += 2 * len(entry.frame) + 2048
                        if entry.seq == high:
                            waiting_cost += 2 * len(entry.frame) + 2048
            print(f"held {held} frames costing {held_cost} (last read {waiting_cost}); biggest {biggest}")
            assert held_cost <= limit + waiting_cost, (held, held_cost, waiting_cost)
            assert sum(upstreams.last_read(h.hostname) or 0 for h in fleet.hosts) < sum(h.published_seq for h in fleet.hosts)
            # the sequencer's queue: every event in it belongs to a frame holding at least 2 KiB of the budget
            assert in_flight.high <= limit // 2048, in_flight.high
            print(f"RESULT disk_full filesystem={'tmpfs' if mounted else 'max_page_count'} held_frames={held} "
                  f"held_cost={held_cost} sequencer_in_flight_high={in_flight.high} budget_used={upstreams.budget.used}")

            await disk.free()
            wanted = [key_of(t.kind, t.did, t.rev) for t in fleet.ground_truth if t.verdict == "accept"]
            await until(lambda: len(consumer.frames) >= len(wanted), "every accepted event", timeout=120)
            for host in fleet.hosts:
                await upstreams.settle_read(host.hostname)
                assert upstreams.watermark(host.hostname) == host.published_seq
            seen = consumer.frames
            assert Counter(key_of(f.kind, f.did, f.rev) for f in seen) == Counter(wanted)  # 0 lost, 0 twice
            assert {t.rev for t in truth if t.verdict == "accept"} <= {f.rev for f in seen}
            assert [f.seq for f in seen] == list(range(1, len(seen) + 1))  # in order, no hole

            async def ready_again() -> bool:
                return (await http.get("/_ready")).status_code == 200

            await until_async(ready_again, "readiness once the disk has room again")

