"""The published TypeScript firehose client ``@atproto/sync`` (npm, pinned in
``tests/js/package.json``; ``./run test`` installs it with ``npm ci``) against ``subscribeRepos``,
driven by ``tests/js/atproto_sync_client.mjs`` in Node against an in-process relay fed by the
simulator.

The client does what every consumer written for Bluesky's relay does: it hands the relay the last
seq its handler processed as the cursor, on start and on every reconnect, and expects the events
after it — no duplicate (the event-stream spec suggests a client treat a repeated seq as an error).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sim import SimConfig, SimFleet
from tests.relay.conftest import RunningRelay
from tests.relay.test_jetstream import generate, running, started
from tests.waiting import until

JS_DIR = Path(__file__).resolve().parent.parent / "js"
SCRIPT = JS_DIR / "atproto_sync_client.mjs"


@dataclass
class SyncClient:
    """One Node process running the client; its stdout lines collected in the background."""

    proc: asyncio.subprocess.Process
    lines: list[dict[str, Any]] = field(default_factory=list)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            self.lines.append(json.loads(raw))

    def events(self) -> list[dict[str, Any]]:
        return [line for line in self.lines if line["type"] == "event"]

    def seqs(self) -> list[int]:
        """The seq of each event handled, once per event (a commit's ops share their seq)."""
        out: list[int] = []
        for ev in self.events():
            if not out or ev["seq"] != out[-1]:
                out.append(ev["seq"])
        return out

    async def command(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        acks = sum(1 for line in self.lines if line == {"type": "ack", "cmd": cmd})
        self.proc.stdin.write((json.dumps({"cmd": cmd}) + "\n").encode())
        await self.proc.stdin.drain()
        await until(lambda: sum(1 for line in self.lines if line == {"type": "ack", "cmd": cmd}) > acks,
                    f"the client's ack of {cmd}")


@contextlib.asynccontextmanager
async def atproto_sync(relay: RunningRelay, fleet: SimFleet, cursor: int) -> AsyncIterator[SyncClient]:
    node = shutil.which("node")
    assert node is not None, "Node.js is required (./run test installs it with the npm packages)"
    assert (JS_DIR / "node_modules" / "@atproto" / "sync").is_dir(), \
        "tests/js/node_modules is missing: ./run test installs it (npm ci in tests/js)"
    options = {"service": relay.url.replace("http://", "ws://"), "plcUrl": fleet.plc_url, "cursor": cursor}
    proc = await asyncio.create_subprocess_exec(node, str(SCRIPT), json.dumps(options), cwd=JS_DIR,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.DEVNULL, limit=1 << 24)
    client = SyncClient(proc)
    reader = asyncio.create_task(client._read())
    try:
        yield client
        assert not [line for line in client.lines if line["type"] == "error"], client.lines
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


@pytest.fixture
async def sim() -> AsyncIterator[SimFleet]:
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=5, seed=2828))
    await fleet.start()
    try:
        yield fleet
    finally:
        await fleet.stop()


async def test_reconnect_with_the_last_processed_seq_gets_no_duplicate(relay_factory, sim) -> None:  # type: ignore[no-untyped-def]
    """Started with the cursor K, the client gets K+1 first; stopped and started again, it
    reconnects with the last seq it handled and gets what followed it: no duplicate, no gap."""
    async with running(relay_factory, sim) as relay:
        await started(relay, sim, 20)
        latest = await relay.service.store.latest_seq()
        assert latest is not None and latest > 10
        cursor = latest // 2
        async with atproto_sync(relay, sim, cursor) as client:
            await until(lambda: latest in client.seqs(), "the window after the cursor", timeout=30)
            assert client.seqs() == list(range(cursor + 1, latest + 1))
            await client.command("stop")
            seen = len(client.events())
            await generate(relay, sim, 10)  # sequenced while the client is away
            now = await relay.service.store.latest_seq()
            assert now is not None and now > latest
            await client.command("start")  # reconnects with cursor = latest (the last seq handled)
            await until(lambda: now in client.seqs(), "what was sequenced while away", timeout=30)
            resumed = [ev["seq"] for ev in client.events()[seen:]]
            assert resumed[0] == latest + 1  # the last seq handled is not sent again
            assert client.seqs() == list(range(cursor + 1, now + 1))  # no duplicate, no gap
