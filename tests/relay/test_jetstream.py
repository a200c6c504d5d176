"""The JSON stream (``GET /subscribe``) over real sockets, against an independent decoder.

Every expectation comes from ``tests.relay.jetstream_oracle`` (the Jetstream documentation applied
to the relay's own ``subscribeRepos`` frames, decoded with other libraries), never from the
relay's conversion code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from sim import SimConfig, SimFleet
from tests.relay import jetstream_oracle as oracle
from tests.relay.conftest import RunningRelay
from tests.relay.e2e import crawl
from tests.waiting import until


@dataclass
class JetClient:
    """One /subscribe connection collecting decoded messages in the background."""

    ws: ClientConnection
    dictionary: bytes | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    binary: int = 0
    text: int = 0
    closed: ConnectionClosed | None = None
    task: asyncio.Task[None] | None = None

    async def _read(self) -> None:
        try:
            async for data in self.ws:
                if isinstance(data, bytes):
                    self.binary += 1
                    assert self.dictionary is not None, "binary message on an uncompressed stream"
                    self.messages.append(oracle.decompress(data, self.dictionary))
                else:
                    self.text += 1
                    self.messages.append(json.loads(data))
        except ConnectionClosed as exc:
            self.closed = exc
        else:
            self.closed = self.ws.close_exc  # type: ignore[assignment]

    def events(self) -> list[dict[str, Any]]:
        return [m for m in self.messages if m.get("kind") != "heartbeat"]

    async def send(self, obj: object) -> None:
        await self.ws.send(json.dumps(obj))


@contextlib.asynccontextmanager
async def jet(relay: RunningRelay, dictionary: bytes | None = None, headers: dict[str, str] | None = None,
              **params: Any) -> AsyncIterator[JetClient]:
    query = urlencode([(k, v) for k, vs in params.items() for v in (vs if isinstance(vs, list) else [vs])])
    url = relay.url.replace("http://", "ws://") + "/subscribe" + (f"?{query}" if query else "")
    async with connect(url, max_size=None, additional_headers=headers or {}) as ws:
        client = JetClient(ws, dictionary)
        client.task = asyncio.create_task(client._read())
        try:
            yield client
        finally:
            client.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await client.task


async def verified_frames(relay: RunningRelay) -> list[bytes]:
    """Every stored event's subscribeRepos frame, read over the relay's own socket (cursor=0)."""
    latest = await relay.service.store.latest_seq()
    frames: list[bytes] = []
    async with connect(relay.ws_url + "?cursor=0", max_size=None) as ws:
        while latest:
            frame = await asyncio.wait_for(ws.recv(), 30)
            assert isinstance(frame, bytes)
            frames.append(frame)
            if oracle.decode_frame(frame)[1].get("seq") == latest:
                break
    return frames


async def expected_messages(relay: RunningRelay) -> list[dict[str, Any]]:
    return oracle.expected(await verified_frames(relay))


def same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [oracle.strip(m) for m in got] == [oracle.strip(m) for m in want]


def check_times(messages: list[dict[str, Any]]) -> None:
    """``time_us``: never decreasing; equal exactly within one commit (one event), else increasing."""
    for a, b in zip(messages, messages[1:], strict=False):
        same_commit = (a["kind"] == b["kind"] == "commit" and a["did"] == b["did"]
                       and a["commit"]["rev"] == b["commit"]["rev"])
        assert (b["time_us"] == a["time_us"]) if same_commit else (b["time_us"] > a["time_us"]), (a, b)


@pytest.fixture
async def sim() -> AsyncIterator[SimFleet]:
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=5, seed=15))
    await fleet.start()
    try:
        yield fleet
    finally:
        await fleet.stop()


def settings(fleet: SimFleet) -> dict[str, object]:
    return {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0,
            "default_account_limit": 1000}


async def started(relay: RunningRelay, fleet: SimFleet, commits: int) -> None:
    """Crawl the fleet and wait until ``commits`` generated events are all stored."""
    await crawl(relay.url, fleet.hosts[0].hostname)
    await generate(relay, fleet, commits)


async def generate(relay: RunningRelay, fleet: SimFleet, commits: int) -> None:
    await fleet.generate(commits)
    await all_stored(relay, fleet)


async def all_stored(relay: RunningRelay, fleet: SimFleet, timeout: float = 60.0) -> None:
    """Wait until every event the ground truth accepts is stored."""
    want = sum(1 for t in fleet.ground_truth if t.verdict == "accept")
    deadline = time.monotonic() + timeout
    while await relay.service.store.count_events() < want:
        assert time.monotonic() < deadline, f"timed out waiting for {want} stored events"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(relay_factory: Callable[..., Any], fleet: SimFleet, **extra: Any) -> AsyncIterator[RunningRelay]:
    async with relay_factory(**settings(fleet), **extra) as relay:
        yield relay


async def test_replay_then_live_matches_the_verified_stream(relay_factory, database_url, sim) -> None:  # type: ignore[no-untyped-def]
    """cursor=0: the whole window, then live, every verified op once, in order, as documented."""
    async with running(relay_factory, sim, database_url=database_url) as relay:
        await started(relay, sim, 20)
        async with jet(relay, cursor="0") as client:
            await generate(relay, sim, 20)  # live while connected
            want = await expected_messages(relay)
            await until(lambda: len(client.events()) >= len(want), timeout=30)
            same(client.events(), want)
            assert client.text == len(want) and client.binary == 0
            check_times(client.events())
            assert {m["kind"] for m in want} == {"commit", "identity", "account"}
            # time_us is the stored event time in microseconds
            stored = await relay.service.store.read_after(0, 1000)
            seq_time = {e.seq: round(e.time * 1_000_000) for e in stored}
            for got, w in zip(client.events(), want, strict=True):
                assert got["time_us"] == seq_time[w["_seq"]]


async def test_time_cursor_replays_across_the_switch_to_live(relay_factory, sim) -> None:  # type: ignore[no-untyped-def]
    async with running(relay_factory, sim) as relay:
        await started(relay, sim, 30)
        async with jet(relay, cursor="0") as first:
            want_now = await expected_messages(relay)
            await until(lambda: len(first.events()) >= len(want_now))
        middle = first.events()[len(first.events()) // 2]
        # the cursor is inclusive (time_us >= cursor): replay from the middle event on, while
        # new events keep being sequenced, then live
        producer = asyncio.create_task(generate(relay, sim, 30))
        async with jet(relay, cursor=str(middle["time_us"])) as client:
            await producer
            want = await expected_messages(relay)
            start = next(i for i, m in enumerate(want) if oracle.strip(m) == oracle.strip(middle))
            if middle["kind"] == "commit":  # a commit's ops share one time_us: replay starts at its first op
                while start and want[start - 1]["_seq"] == want[start]["_seq"]:
                    start -= 1
            tail = want[start:]
            await until(lambda: len(client.events()) >= len(tail), timeout=30)
            same(client.events(), tail)  # no gap, no duplicate
            check_times(client.events())
            assert client.events()[0]["time_us"] == middle["time_us"]
        # a cursor after the newest event: live from now on, nothing replayed
        newest = max(m["time_us"] for m in client.events())
        async with jet(relay, cursor=str(newest + 1)) as live:
            await generate(relay, sim, 5)
            want = await expected_messages(relay)
            fresh = [m for m in want if m["_seq"] > tail[-1]["_seq"]]
            await until(lambda: len(live.events()) >= len(fresh))
            same(live.events(), fresh)


async def test_filters_and_max_message_size(relay_factory, sim) -> None:  # type: ignore[no-untyped-def]
    async with running(relay_factory, sim) as relay:
        await started(relay, sim, 40)
        want = await expected_messages(relay)
        dids = sorted({m["did"] for m in want})[:2]
        collections = ["app.bsky.feed.like", "app.bsky.graph.*"]
        async with jet(relay, cursor="0", wantedCollections=collections, wantedDids=dids) as client:
            filtered = [m for m in want if oracle.wanted(m, collections, dids)]
            assert {m["kind"] for m in filtered} >= {"commit", "identity"} and len(filtered) < len(want)
            await until(lambda: len(client.events()) >= len(filtered))
            same(client.events(), filtered)
        # maxMessageSizeBytes: bigger messages are skipped (compared with the bytes sent)
        sizes = sorted(len(json.dumps(m, separators=(",", ":"), ensure_ascii=False).encode()) for m in want)
        limit = sizes[len(sizes) // 2] + 20
        async with jet(relay, cursor="0", maxMessageSizeBytes=str(limit)) as small, \
                jet(relay, cursor="0") as everything:
            await until(lambda: len(everything.events()) >= len(want))
            raw_sizes = [len(json.dumps(m, separators=(",", ":"), ensure_ascii=False).encode())
                         for m in everything.events()]
            fits = [m for m, n in zip(everything.events(), raw_sizes, strict=True) if n <= limit]
            assert 0 < len(fits) < len(want)
            await until(lambda: len(small.events()) >= len(fits))
            assert small.events() == fits


async def test_options_update_changes_filters_mid_stream(relay_factory, sim) -> None:  # type: ignore[no-untyped-def]
    async with running(relay_factory, sim) as relay:
        await started(relay, sim, 20)
        async with jet(relay, wantedCollections="app.bsky.feed.like") as client:
            await generate(relay, sim, 20)
            want = await expected_messages(relay)
            await until(lambda: any(m["kind"] == "commit" for m in client.events()))
            did = sorted({m["did"] for m in want})[0]
            update = {"wantedCollections": ["app.bsky.feed.post"], "wantedDids": [did]}
            await client.send({"type": "options_update", "payload": update})
            await client.send({"type": "heartbeat", "payload": "sync-1"})
            # client messages are handled in order: once the heartbeat is answered the update holds
            await until(lambda: {"kind": "heartbeat", "payload": "sync-1"} in client.messages)
            boundary = await relay.service.store.latest_seq()
            before = list(client.events())
            assert before and all(m["kind"] != "commit" or m["commit"]["collection"] == "app.bsky.feed.like"
                                  for m in before)
            await generate(relay, sim, 40)
            want = await expected_messages(relay)
            after = [m for m in want if m["_seq"] > boundary and oracle.wanted(m, update["wantedCollections"], [did])]
            assert after
            await until(lambda: len(client.events()) >= len(before) + len(after))
            tail = client.events()[len(before):]
            # messages of events sequenced before the update may still be in flight; after them,
            # exactly the new filter's messages
            assert [oracle.strip(m) for m in tail[-len(after):]] == [oracle.strip(m) for m in after]
            assert all(oracle.wanted(m, ["app.bsky.feed.like"]) for m in tail[:-len(after)])


async def test_require_hello_waits_for_the_first_options_update(relay_factory, sim) -> None:  # type: ignore[no-untyped-def]
    async with running(relay_factory, sim) as relay:
        await started(relay, sim, 20)
        want = await expected_messages(relay)
        async with jet(relay, cursor="0", requireHello="true") as client:
            await client.send({"type": "heartbeat", "payload": "before"})
            await until(lambda: bool(client.messages))
            # the window is stored, yet nothing but the heartbeat answer came before the hello
            assert client.messages == [{"kind": "heartbeat", "payload": "before"}]
            await client.send({"type": "options_update", "payload": {"wantedCollections": ["app.bsky.feed.post"]}})
            filtered = [m for m in want if oracle.wanted(m, ["app.bsky.feed.post"])]
            await until(lambda: len(client.events()) >= len(filtered))
            same(client.events(), filtered)


async def test_zstd_round_trip_with_jetstreams_dictionary(relay_factory, sim, fixtures_dir) -> None:  # type: ignore[no-untyped-def]
    """``compress=true`` (and ``Socket-Encoding: zstd``) is what every Jetstream client expects:
    each message one zstd frame made with Jetstream's dictionary (id 1612007021), read here with
    the copy such a client bundles (the shared fixture, not what the relay serves)."""
    import zstandard

    bundled = (fixtures_dir / "jetstream" / "legacy_subscribe.zdict").read_bytes()
    async with running(relay_factory, sim) as relay:
        await started(relay, sim, 80)
        want = await expected_messages(relay)
        assert len(want) >= 100
        async with jet(relay, bundled, cursor="0", compress="true") as query, \
                jet(relay, bundled, headers={"Socket-Encoding": "zstd"}, cursor="0") as header:
            await until(lambda: len(query.events()) >= len(want) and len(header.events()) >= len(want))
            same(query.events(), want)
            same(header.events(), want)
            assert query.binary == len(want) and query.text == 0
        raw: list[bytes] = []
        async with connect(relay.url.replace("http://", "ws://") + "/subscribe?cursor=0&compress=true") as ws:
            for _ in range(100):
                data = await ws.recv()
                assert isinstance(data, bytes)
                raw.append(data)
        assert {zstandard.get_frame_parameters(data).dict_id for data in raw} == {1612007021}
        with pytest.raises(zstandard.ZstdError):
            zstandard.ZstdDecompressor().decompress(raw[0])  # not readable without the dictionary
        async with httpx.AsyncClient(base_url=relay.url) as http:
            served = await http.get("/subscribe/zstd-dictionary")
            by_id = await http.get("/xrpc/network.bsky.jetstream.getZstdDictionary", params={"id": "1612007021"})
        assert served.content == bundled and served.headers["x-zstd-dictionary-id"] == "1612007021"
        assert by_id.status_code == 200 and by_id.content == bundled


async def test_the_relays_own_dictionary_is_an_opt_in_by_id(relay_factory, sim) -> None:  # type: ignore[no-untyped-def]
    """As Jetstream's newer protocol: fetch the current dictionary (by id, or without one), then
    ask for it with ``zstdDictionary=<id>``; an unknown id is refused before the upgrade."""
    import zstandard

    async with running(relay_factory, sim) as relay:
        await started(relay, sim, 20)
        want = await expected_messages(relay)
        path = "/xrpc/network.bsky.jetstream.getZstdDictionary"
        async with httpx.AsyncClient(base_url=relay.url) as http:
            current = await http.get(path)
            own_id = int(current.headers["x-zstd-dictionary-id"])
            again = await http.get(path, params={"id": str(own_id)})
            missing = await http.get(path, params={"id": "5"})
            bad = await http.get(path, params={"id": "x"})
        assert current.status_code == 200 and own_id not in (0, 1612007021)
        assert again.content == current.content and "immutable" in again.headers["cache-control"]
        assert missing.status_code == 400 and missing.json()["error"] == "DictionaryNotFound"
        assert str(own_id) in missing.json()["message"]
        assert bad.status_code == 400 and bad.json()["error"] == "InvalidRequest"
        async with jet(relay, current.content, cursor="0", zstdDictionary=str(own_id)) as client:
            await until(lambda: len(client.events()) >= len(want))
            same(client.events(), want)
            assert client.binary == len(want) and client.text == 0
        async with connect(relay.url.replace("http://", "ws://") + f"/subscribe?cursor=0&zstdDictionary={own_id}") as ws:
            data = await ws.recv()
            assert isinstance(data, bytes) and zstandard.get_frame_parameters(data).dict_id == own_id
        with pytest.raises(InvalidStatus) as info:
            async with connect(relay.url.replace("http://", "ws://") + "/subscribe?zstdDictionary=5"):
                pass
        assert info.value.response.status_code == 400
        refusal = json.loads(info.value.response.body)
        assert refusal["error"] == "UnknownZstdDictionary" and str(own_id) in refusal["message"]
        async with httpx.AsyncClient(base_url=relay.url) as http:
            metrics = (await http.get("/metrics")).text
        assert 'relay_jetstream_total{event="refused_unknown_zstd_dictionary"} 1.0' in metrics


@pytest.mark.parametrize("query, reason", [
    ("wantedCollections=not..valid", "jetstream_bad_collection"),
    ("wantedCollections=*", "jetstream_bad_collection"),
    ("wantedDids=alice", "jetstream_bad_did"),
    ("maxMessageSizeBytes=big", "jetstream_bad_max_size"),
    ("cursor=-5", "jetstream_bad_cursor"),
    ("cursor=soon", "jetstream_bad_cursor"),
    ("&".join(f"wantedCollections=app.bsky.c{i}.x" for i in range(101)), "jetstream_too_many_collections"),
])
async def test_bad_parameters_are_refused_before_the_upgrade(relay_factory, sim, query: str,  # type: ignore[no-untyped-def]
                                                             reason: str) -> None:
    async with running(relay_factory, sim) as relay:
        with pytest.raises(InvalidStatus) as info:
            async with connect(relay.url.replace("http://", "ws://") + "/subscribe?" + query):
                pass
        assert info.value.response.status_code == 400
        assert json.loads(info.value.response.body)["error"] == "InvalidRequest"
        async with httpx.AsyncClient(base_url=relay.url) as http:
            metrics = (await http.get("/metrics")).text
            plain = await http.get("/subscribe")
        assert f'relay_jetstream_total{{event="refused_{reason}"}} 1.0' in metrics
        assert plain.status_code == 426


async def test_invalid_client_message_closes_with_the_reason(relay_factory, sim) -> None:  # type: ignore[no-untyped-def]
    async with running(relay_factory, sim) as relay:
        async with jet(relay) as client:
            await client.send({"type": "options_update", "payload": {"wantedDids": ["nope"]}})
            await until(lambda: client.closed is not None)
        assert client.closed is not None and client.closed.rcvd is not None
        assert client.closed.rcvd.code == 1008 and "jetstream_bad_did" in client.closed.rcvd.reason
        async with jet(relay) as other:
            await other.ws.send("{not json")
            await until(lambda: other.closed is not None)
        assert other.closed is not None and other.closed.rcvd is not None
        assert other.closed.rcvd.code == 1008 and "jetstream_bad_message" in other.closed.rcvd.reason


async def test_identity_and_account_events_pass_collection_filters(relay_factory, sim) -> None:  # type: ignore[no-untyped-def]
    async with running(relay_factory, sim) as relay:
        await started(relay, sim, 5)
        account = sim.accounts[0]
        sim.set_status(account, "deactivated")
        await generate(relay, sim, 2)  # emits the queued #account too
        async with jet(relay, cursor="0", wantedCollections="com.example.nothing") as client:
            await until(lambda: any(m["kind"] == "account" and m["account"]["active"] is False
                                    for m in client.events()), "the #account of the deactivation")
            want = [m for m in await expected_messages(relay) if m["kind"] != "commit"]
            await until(lambda: len(client.events()) >= len(want))
            same(client.events(), want)
            last = [m for m in client.events() if m["did"] == account.did][-1]
            assert last["kind"] == "account" and last["account"]["active"] is False
            assert last["account"]["status"] == "deactivated"


async def test_a_deeply_nested_options_update_closes_with_the_reason_and_is_counted(relay_factory, sim) -> None:  # type: ignore[no-untyped-def]
    """A 5,000-deep JSON array in an ``options_update`` is a typed refusal (close 1008 with the
    reason, counted), not a crash of the connection's reader."""
    async with running(relay_factory, sim) as relay:
        async with jet(relay) as client:
            nested = "[" * 5000 + "]" * 5000
            await client.ws.send('{"type": "options_update", "payload": {"wantedCollections": ' + nested + "}}")
            await until(lambda: client.closed is not None)
        assert client.closed is not None and client.closed.rcvd is not None
        assert client.closed.rcvd.code == 1008 and "jetstream_bad_message" in client.closed.rcvd.reason
        assert "nested too deeply" in client.closed.rcvd.reason
        async with httpx.AsyncClient(base_url=relay.url) as http:
            metrics = (await http.get("/metrics")).text
        assert 'relay_jetstream_total{event="closed_jetstream_bad_message"} 1.0' in metrics
