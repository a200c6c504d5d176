"""Real, published Jetstream clients against ``GET /subscribe``: ``@skyware/jetstream`` and
``@atcute/jetstream`` (npm, pinned in ``tests/js/package.json``/``package-lock.json``; ``./run
test`` installs them with ``npm ci``), driven by ``tests/js/skyware_client.mjs`` and
``tests/js/atcute_client.mjs`` in Node against an in-process relay fed by the simulator.

The clients are used unmodified, as their READMEs show for Node.js; ``@atcute/jetstream`` checks
every message against its own schema (a string ``handle`` in every identity event, among others).
Neither has a compressed mode (they never ask for ``compress=true`` and parse every message as
JSON text), so zstd is tested in ``test_jetstream.py`` (the independent decoder, and Jetstream's
own dictionary). Expectations come from
``tests.relay.jetstream_oracle`` (the Jetstream documentation applied to the relay's own
``subscribeRepos`` frames), never from the relay's conversion code.
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

import httpx
import pytest

from sim import SimConfig, SimFleet
from tests.relay import jetstream_oracle as oracle
from tests.relay.conftest import RunningRelay
from tests.relay.e2e import metric_value
from tests.relay.test_jetstream import expected_messages, generate, running, started
from tests.waiting import until, until_async

JS_DIR = Path(__file__).resolve().parent.parent / "js"
SCRIPT = JS_DIR / "skyware_client.mjs"
ATCUTE_SCRIPT = JS_DIR / "atcute_client.mjs"
EVENT_TYPES = ("commit", "identity", "account")


@dataclass
class SkywareClient:
    """One Node process running the client; its stdout lines collected in the background."""

    proc: asyncio.subprocess.Process
    lines: list[dict[str, Any]] = field(default_factory=list)
    stderr: bytes = b""

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            self.lines.append(json.loads(raw))

    def of(self, *types: str) -> list[dict[str, Any]]:
        return [line["event"] for line in self.lines if line["type"] in types]

    def events(self) -> list[dict[str, Any]]:
        return self.of(*EVENT_TYPES)

    def count(self, kind: str) -> int:
        return sum(1 for line in self.lines if line["type"] == kind)

    async def command(self, cmd: str, **fields: Any) -> None:
        """Send a command and wait for the script's acknowledgement of it."""
        assert self.proc.stdin is not None
        acks = sum(1 for line in self.lines if line == {"type": "ack", "cmd": cmd})
        self.proc.stdin.write((json.dumps({"cmd": cmd, **fields}) + "\n").encode())
        await self.proc.stdin.drain()
        await until(lambda: sum(1 for line in self.lines if line == {"type": "ack", "cmd": cmd}) > acks,
                    f"the client's ack of {cmd}")


@contextlib.asynccontextmanager
async def skyware(relay: RunningRelay, **options: Any) -> AsyncIterator[SkywareClient]:
    """``@skyware/jetstream``: its endpoint is the full ``/subscribe`` URL."""
    options["endpoint"] = relay.url.replace("http://", "ws://") + "/subscribe"
    async with node_client(SCRIPT, "@skyware/jetstream", options) as client:
        yield client


@contextlib.asynccontextmanager
async def atcute(relay: RunningRelay, **options: Any) -> AsyncIterator[SkywareClient]:
    """``@atcute/jetstream`` (``tests/js/atcute_client.mjs``): its endpoint is the relay's base URL;
    a message its schema refuses is a line of type ``invalid``."""
    options["endpoint"] = relay.url.replace("http://", "ws://")
    async with node_client(ATCUTE_SCRIPT, "@atcute/jetstream", options) as client:
        yield client
        assert not [line for line in client.lines if line["type"] == "invalid"], client.lines


@contextlib.asynccontextmanager
async def node_client(script: Path, package: str, options: dict[str, Any]) -> AsyncIterator[SkywareClient]:
    node = shutil.which("node")
    assert node is not None, "Node.js is required (./run test installs it with the npm packages)"
    assert (JS_DIR / "node_modules" / package).is_dir(), \
        "tests/js/node_modules is missing: ./run test installs it (npm ci in tests/js)"
    proc = await asyncio.create_subprocess_exec(node, str(script), json.dumps(options), cwd=JS_DIR,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, limit=1 << 24)
    client = SkywareClient(proc)
    reader = asyncio.create_task(client._read())
    try:
        await until(lambda: client.count("open") >= 1 or reader.done(), "the client's connection")
        assert client.count("open") == 1, f"the client did not connect: {client.lines}"
        yield client
        assert not [line for line in client.lines if line["type"] == "error"], client.lines
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def stored_times(relay: RunningRelay) -> dict[int, int]:
    """seq → the event's ``time_us`` as documented (the stored sequencing time in microseconds)."""
    events = await relay.service.store.read_after(0, 100_000)
    return {e.seq: round(e.time * 1_000_000) for e in events}


def stripped(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [oracle.strip(m) for m in messages]


async def options_updated(relay: RunningRelay) -> bool:
    """The relay counted an ``options_update`` (it counts once the connection's filters are replaced)."""
    async with httpx.AsyncClient(base_url=relay.url) as http:
        text = (await http.get("/metrics")).text
    return metric_value(text, "relay_jetstream_total", event="options_update") >= 1


@pytest.fixture
async def sim() -> AsyncIterator[SimFleet]:
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=5, seed=1515))
    await fleet.start()
    try:
        yield fleet
    finally:
        await fleet.stop()


async def test_cursor_filters_and_live_events_reach_the_published_client(relay_factory, sim) -> None:  # type: ignore[no-untyped-def]
    """A time cursor from the middle of the window, with and without filters, then live events;
    the client's per-collection create/update/delete listeners see the same ops."""
    async with running(relay_factory, sim) as relay:
        await started(relay, sim, 30)
        window = await expected_messages(relay)
        times = await stored_times(relay)
        cursor = times[window[len(window) // 2]["_seq"]]
        dids = sorted({m["did"] for m in window})[:2]
        collections = ["app.bsky.feed.like", "app.bsky.graph.*"]
        async with skyware(relay, cursor=cursor) as everything, \
                skyware(relay, cursor=cursor, wantedCollections=collections, wantedDids=dids) as filtered, \
                skyware(relay, cursor=cursor, watch="app.bsky.feed.post") as posts:
            await generate(relay, sim, 30)  # live while connected
            want = await expected_messages(relay)
            times = await stored_times(relay)
            tail = [m for m in want if times[m["_seq"]] >= cursor]
            assert 0 < len(tail) < len(want)
            await until(lambda: len(everything.events()) >= len(tail), "every message from the cursor on", timeout=30)
            assert stripped(everything.events()) == stripped(tail)
            assert [m["time_us"] for m in everything.events()] == [times[m["_seq"]] for m in tail]

            want_filtered = [m for m in tail if oracle.wanted(m, collections, dids)]
            assert 0 < len(want_filtered) < len(tail)
            await until(lambda: len(filtered.events()) >= len(want_filtered), "the filtered messages", timeout=30)
            assert stripped(filtered.events()) == stripped(want_filtered)

            want_posts = [m for m in tail if m["kind"] == "commit" and m["commit"]["collection"] == "app.bsky.feed.post"]
            assert {m["commit"]["operation"] for m in want_posts} >= {"create"}
            await until(lambda: len(posts.of("create", "update", "delete")) >= len(want_posts), "the post listeners")
            for op in ("create", "update", "delete"):
                assert stripped(posts.of(op)) == stripped([m for m in want_posts if m["commit"]["operation"] == op])
            # the client keeps the newest time_us as its cursor
            await everything.command("cursor")
            got = [line["cursor"] for line in everything.lines if line["type"] == "cursor"]
            assert got == [max(times.values())]


async def test_restart_resumes_from_the_clients_cursor(relay_factory, sim) -> None:  # type: ignore[no-untyped-def]
    """close() then start(): the client reconnects with ``cursor=<newest time_us it saw>``; it gets
    that event again (cursors are inclusive), then everything it missed while away, then live."""
    async with running(relay_factory, sim) as relay:
        await started(relay, sim, 20)
        first = await expected_messages(relay)
        async with skyware(relay, cursor=1) as client:
            await until(lambda: len(client.events()) >= len(first), "the whole window", timeout=30)
            assert stripped(client.events()) == stripped(first)
            last = client.events()[-1]["time_us"]
            await client.command("stop")
            await until(lambda: client.count("close") >= 1, "the client's close")
            seen = len(client.events())
            await generate(relay, sim, 20)  # sequenced while the client is away
            await client.command("start")
            await generate(relay, sim, 10)  # and live after it is back
            want = await expected_messages(relay)
            times = await stored_times(relay)
            resumed = [m for m in want if times[m["_seq"]] >= last]
            missed = [m for m in want if m["_seq"] > first[-1]["_seq"]]
            assert len(resumed) > len(missed) > 0
            await until(lambda: len(client.events()) >= seen + len(resumed), "the resumed stream", timeout=30)
            assert client.count("open") == 2
            after = client.events()[seen:]
            assert stripped(after) == stripped(resumed)  # the repeated event, then no gap, no duplicate
            assert all(m["time_us"] == last for m in after[:len(resumed) - len(missed)])


async def test_update_options_changes_the_filters_of_the_live_connection(relay_factory, sim) -> None:  # type: ignore[no-untyped-def]
    async with running(relay_factory, sim) as relay:
        await started(relay, sim, 30)
        window = await expected_messages(relay)
        likes = [m for m in window if oracle.wanted(m, ["app.bsky.feed.like"])]
        async with skyware(relay, cursor=1, wantedCollections=["app.bsky.feed.like"]) as client:
            await until(lambda: len(client.events()) >= len(likes), "the likes of the window", timeout=30)
            assert stripped(client.events()) == stripped(likes)
            boundary = await relay.service.store.latest_seq()
            did = sorted({m["did"] for m in window})[0]
            update = {"wantedCollections": ["app.bsky.feed.post"], "wantedDids": [did]}
            await client.command("update", payload=update)
            await until_async(lambda: options_updated(relay), "the relay applied the update")
            await generate(relay, sim, 40)
            want = await expected_messages(relay)
            after = [m for m in want if m["_seq"] > boundary
                     and oracle.wanted(m, update["wantedCollections"], update["wantedDids"])]
            assert after
            await until(lambda: len(client.events()) >= len(likes) + len(after), "the new filter's messages", timeout=30)
            assert stripped(client.events()) == stripped(likes + after)


async def test_atcute_client_accepts_every_message_replayed_and_live(relay_factory, sim) -> None:  # type: ignore[no-untyped-def]
    """``@atcute/jetstream`` validates each event against its schema: every message of the window
    and of the live stream passes (identity events carry a string handle, ``handle.invalid`` when
    the relay has none), in order, no gap, no duplicate."""
    async with running(relay_factory, sim) as relay:
        await started(relay, sim, 20)
        async with atcute(relay, cursor=0) as client:
            await generate(relay, sim, 20)  # live while connected
            want = await expected_messages(relay)
            identities = [m for m in want if m["kind"] == "identity"]
            assert identities and any(m["identity"]["handle"] == "handle.invalid" for m in identities)
            await until(lambda: len(client.events()) >= len(want), "every message", timeout=30)
            assert stripped(client.events()) == stripped(want)
            assert all(isinstance(m["identity"]["handle"], str) for m in client.of("identity"))
            times = await stored_times(relay)
            await client.command("cursor")
            assert [line["cursor"] for line in client.lines if line["type"] == "cursor"] == [max(times.values())]
