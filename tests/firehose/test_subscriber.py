"""Upstream subscriber against a real ``websockets`` server started in the test (127.0.0.1)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qs, urlsplit

import pytest
from websockets.asyncio.server import ServerConnection, serve

from firehose.frames import encode_error_frame, encode_frame, encode_info_frame
from firehose.reasons import Reason
from firehose.subscriber import HostSubscriber, SubscriberConfig, UpstreamFrame, stream_url
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)

Script = Callable[[ServerConnection, int | None], Awaitable[None]]


def msg(seq: int) -> bytes:
    return encode_frame("#identity", {"seq": seq, "did": "did:plc:abc", "time": "2026-01-01T00:00:00Z"})


class Upstream:
    """A scripted upstream host: connection i runs scripts[i] (the last one repeats)."""

    def __init__(self, scripts: list[Script]) -> None:
        self.scripts = scripts
        self.cursors: list[int | None] = []
        #: monotonic time of each connection
        self.connected_at: list[float] = []
        self.server = None

    async def __aenter__(self) -> str:
        async def handler(conn: ServerConnection) -> None:
            q = parse_qs(urlsplit(conn.request.path).query).get("cursor")
            cursor = int(q[0]) if q else None
            self.cursors.append(cursor)
            self.connected_at.append(time.monotonic())
            script = self.scripts[min(len(self.cursors) - 1, len(self.scripts) - 1)]
            await script(conn, cursor)

        self.server = await serve(handler, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()


def sends(*frames: bytes, hold: bool = True) -> Script:
    async def script(conn: ServerConnection, cursor: int | None) -> None:
        for f in frames:
            await conn.send(f)
        if hold:
            await conn.wait_closed()

    return script


def fast_config(**kw) -> SubscriberConfig:
    return SubscriberConfig(backoff_base=0.01, backoff_max=0.05, rate_limits=[(10_000, 1.0)], **kw)


async def run_until(sub: HostSubscriber, pred: Callable[[], bool], timeout: float = 10) -> None:
    task = asyncio.create_task(sub.run())
    try:
        async with asyncio.timeout(timeout):
            while not pred():
                await asyncio.sleep(0.005)
    finally:
        await sub.stop()
        await asyncio.wait_for(task, 5)


def test_stream_url() -> None:
    assert stream_url("pds.example.com", None) == "wss://pds.example.com/xrpc/com.atproto.sync.subscribeRepos"
    assert stream_url("http://127.0.0.1:5/", 9).startswith("ws://127.0.0.1:5/xrpc/")
    assert stream_url("https://a.b", 0).endswith("?cursor=0")


async def test_delivers_in_order_and_cursor_moves_only_by_ack() -> None:
    got: list[int] = []
    async with Upstream([sends(*[msg(i) for i in range(1, 11)], encode_info_frame("OutdatedCursor"))]) as url:
        sub = HostSubscriber(url, lambda f: _append(got, f), config=fast_config())
        await run_until(sub, lambda: len(got) == 10 and sub.counters[Reason.INFO_OUTDATED_CURSOR] == 1)
    assert got == list(range(1, 11))
    assert sub.cursor is None  # nothing acknowledged: the cursor never moved by itself
    sub.ack(7)
    sub.ack(3)
    assert sub.cursor == 7


async def _append(out: list[int], f: UpstreamFrame) -> None:
    out.append(f.seq)


async def test_reconnect_resumes_from_acked_cursor_and_skips_redeliveries() -> None:
    got: list[int] = []
    first = sends(*[msg(i) for i in range(1, 6)], hold=False)  # then the server drops us
    second = sends(*[msg(i) for i in range(3, 9)])  # inclusive replay from cursor 3

    async def on_frame(f: UpstreamFrame) -> None:
        got.append(f.seq)
        if f.seq <= 3:
            sub.ack(f.seq)  # the "sequencer" only made 1..3 durable before the drop

    async with Upstream([first, second]) as url:
        sub = HostSubscriber(url, on_frame, config=fast_config())
        await run_until(sub, lambda: len(got) >= 10)
    assert got[:5] == [1, 2, 3, 4, 5]
    assert got[5:] == [4, 5, 6, 7, 8]  # 3 was acked: skipped as a re-delivery
    assert sub.counters[Reason.DUPLICATE_EVENT] == 1


async def test_non_increasing_seq_is_dropped_and_counted() -> None:
    got: list[int] = []
    async with Upstream([sends(msg(1), msg(2), msg(2), msg(1), msg(3))]) as url:
        sub = HostSubscriber(url, lambda f: _append(got, f), config=fast_config())
        await run_until(sub, lambda: 3 in got)
    assert got == [1, 2, 3]
    assert sub.counters[Reason.SEQ_NOT_INCREASING] == 2


async def test_future_cursor_resets_instead_of_idling() -> None:
    got: list[int] = []
    resets: list[tuple[int | None, str]] = []
    upstream = Upstream([sends(encode_error_frame("FutureCursor"), hold=False), sends(msg(1), msg(2))])
    async with upstream as url:
        sub = HostSubscriber(
            url, lambda f: _append(got, f), cursor=100, config=fast_config(),
            on_cursor_reset=lambda old, reason: resets.append((old, reason)),
        )
        await run_until(sub, lambda: got == [1, 2])
    assert upstream.cursors == [100, 0]  # the wiped host's new stream is read from its start
    assert resets == [(100, "future_cursor")]


async def test_acks_while_the_owner_settles_a_reset_do_not_survive_it() -> None:
    """The owner's ``on_cursor_reset`` settles the old stream's in-flight frames, whose acks land
    meanwhile; the cursor is reset after it returns, so none of them outlives the reset (else the
    new stream's frames up to that old seq would be skipped as re-deliveries)."""
    got: list[int] = []
    upstream = Upstream([sends(encode_error_frame("FutureCursor"), hold=False), sends(msg(1), msg(2))])
    async with upstream as url:
        async def on_reset(old: int | None, reason: str) -> None:
            sub.ack(120)  # a late ack of a frame read before the host was wiped
            await asyncio.sleep(0)

        sub = HostSubscriber(url, lambda f: _append(got, f), cursor=100, config=fast_config(),
                             on_cursor_reset=on_reset)
        await run_until(sub, lambda: got == [1, 2])
    assert upstream.cursors == [100, 0]


async def test_seq_below_cursor_on_new_connection_is_a_reset() -> None:
    got: list[int] = []
    resets: list[tuple[int | None, str]] = []

    async def on_reset(old: int | None, reason: str) -> None:
        resets.append((old, reason))

    async with Upstream([sends(msg(1), msg(2), msg(3))]) as url:
        sub = HostSubscriber(url, lambda f: _append(got, f), cursor=50, config=fast_config(), on_cursor_reset=on_reset)
        await run_until(sub, lambda: got == [1, 2, 3])
    assert resets == [(50, "seq_went_backwards")]


async def test_many_backwards_frames_reset_the_stream() -> None:
    got: list[int] = []
    frames = [msg(100)] + [msg(5)] * 4
    upstream = Upstream([sends(*frames), sends(msg(6), msg(7))])
    async with upstream as url:
        async def on_frame(f: UpstreamFrame) -> None:
            got.append(f.seq)
            sub.ack(f.seq)

        sub = HostSubscriber(url, on_frame, config=fast_config(max_backwards=3))
        await run_until(sub, lambda: got == [100, 6, 7])
    assert sub.resets == 1 and upstream.cursors == [None, 0]  # reset: read from the start, not from 100


def replay(frames: list[tuple[int, bytes]], *, inclusive: bool = False, hold: bool = True) -> Script:
    """A host holding ``frames`` (seq, bytes): asked for a cursor it sends every frame after it
    (``inclusive``: from it, as the spec words it); asked for none (live) it has nothing new."""
    async def script(conn: ServerConnection, cursor: int | None) -> None:
        if cursor is not None:
            for seq, f in frames:
                if seq > cursor or (inclusive and seq == cursor):
                    await conn.send(f)
        if hold:
            await conn.wait_closed()

    return script


BAD_MESSAGES = {
    "bad_header_cbor": b"\xff\x00garbage",
    "bad_body_cbor": encode_frame("#identity", {"seq": 11})[:-3] + b"\xff\xff\xff",
    "header_not_map": b"\x01" + encode_frame("#identity", {"seq": 11})[1:],
    "trailing_bytes": msg(11) + b"\x00",
    "frame_empty": b"",
    "text": "{\"seq\": 11}",
}


@pytest.mark.parametrize("kind", sorted(BAD_MESSAGES))
async def test_an_unreadable_frame_costs_only_itself(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """10 good frames, 1 the codec rejects, 100 good ones: all 110 are delivered, in order, on
    the one connection; the bad one is counted by its reason (also through ``on_count``) and
    logged with the seq before it; the cursor is never reset."""
    reason = "bad_header_cbor" if kind == "text" else kind
    bad: bytes | str = BAD_MESSAGES[kind]
    frames = [(i, msg(i)) for i in range(1, 11)] + [(11, bad)] + [(i, msg(i)) for i in range(12, 112)]  # type: ignore[list-item]
    got: list[int] = []
    counted: list[str] = []

    async def on_frame(f: UpstreamFrame) -> None:
        got.append(f.seq)
        sub.ack(f.seq)

    async with Upstream([replay(frames)]) as url:
        sub = HostSubscriber(url, on_frame, cursor=0, config=fast_config(), on_count=counted.append,
                             on_cursor_reset=lambda old, reason: pytest.fail("cursor reset"))
        with caplog.at_level(logging.WARNING, logger="firehose.subscriber"):
            await run_until(sub, lambda: len(got) == 110)
    assert got == list(range(1, 11)) + list(range(12, 112))
    assert sub.connections == 1 and sub.resets == 0 and sub.cursor == 111
    assert sub.counters[reason] == 1 and counted.count(reason) == 1
    logged = [r for r in caplog.records if r.getMessage() == "unreadable upstream frame skipped"]
    assert [(getattr(r, "host", None), getattr(r, "after_seq", None), getattr(r, "reason", None))
            for r in logged] == [(url, 10, reason)]


async def test_a_host_sending_only_junk_keeps_its_cursor_and_connection() -> None:
    """Junk by the hundred is counted (logged only a few times), never resets the cursor nor
    drops the connection: the good frame after it is still read."""
    got: list[int] = []
    junk = [b"\xff\x00junk"] * 300
    async with Upstream([sends(msg(1), *junk, msg(2))]) as url:
        sub = HostSubscriber(url, lambda f: _append(got, f), cursor=0, config=fast_config(log_skipped=3))
        await run_until(sub, lambda: got == [1, 2])
    assert sub.counters[Reason.BAD_HEADER_CBOR] == 300 and sub.connections == 1 and sub.resets == 0


async def test_unknown_types_are_skipped_and_counted() -> None:
    got: list[int] = []
    async with Upstream([sends(encode_frame("#weird", {"seq": 1}), msg(2))]) as url:
        sub = HostSubscriber(url, lambda f: _append(got, f), config=fast_config())
        await run_until(sub, lambda: got == [2])
    assert sub.counters[Reason.UNKNOWN_TYPE] == 1


async def test_rate_limit_is_backpressure_not_drops() -> None:
    got: list[int] = []
    async with Upstream([sends(*[msg(i) for i in range(1, 31)])]) as url:
        cfg = SubscriberConfig(backoff_base=0.01, rate_limits=[(10, 0.1)])  # 100/s, burst 10
        sub = HostSubscriber(url, lambda f: _append(got, f), config=cfg)
        await run_until(sub, lambda: len(got) == 30)
    assert got == list(range(1, 31))
    assert sub.limiter.waited_s > 0  # it had to wait: throttled, nothing dropped


async def test_backoff_is_capped_exponential_with_jitter() -> None:
    import random

    sub = HostSubscriber("h", lambda f: _append([], f), config=SubscriberConfig(backoff_base=1, backoff_max=30),
                         rng=random.Random(4))
    delays = [sub.backoff_delay(a) for a in range(10)]
    for a, d in enumerate(delays):
        cap = min(30, 2**a)
        assert cap / 2 <= d <= cap
    assert len({round(d, 6) for d in delays[6:]}) > 1  # jittered at the cap


async def test_unreachable_host_backs_off_and_counts() -> None:
    sub = HostSubscriber("http://127.0.0.1:9", lambda f: _append([], f), config=fast_config(open_timeout=1))
    await run_until(sub, lambda: sub.counters[Reason.CONNECTION_FAILED] >= 3)


async def test_ping_keepalive_detects_a_dead_upstream() -> None:
    """An upstream that completes the handshake and then goes silent (answers no pings) is
    detected by the keepalive and reconnected, instead of hanging forever."""
    import base64
    import hashlib

    connections = 0
    writers = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        writers.append(writer)
        head = await reader.readuntil(b"\r\n\r\n")
        key = next(line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
                   if line.lower().startswith(b"sec-websocket-key"))
        accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(30)  # never reads again: pings go unanswered

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        cfg = fast_config(ping_interval=0.1, ping_timeout=0.2, close_timeout=0.2)
        sub = HostSubscriber(f"http://127.0.0.1:{port}", lambda f: _append([], f), config=cfg)
        await run_until(sub, lambda: connections >= 2)
        assert sub.counters[Reason.CONNECTION_FAILED] >= 1
    finally:
        for w in writers:
            w.close()
        server.close()


def test_config_for_host_limits() -> None:
    cfg = SubscriberConfig.for_host(10, None, 5000, backoff_base=2.0)
    assert cfg.rate_limits == [(10.0, 1.0), (2500.0, 3600.0), (5000.0, 86400.0)] and cfg.backoff_base == 2.0


async def test_future_cursor_without_a_cursor_backs_off_instead_of_spinning() -> None:
    upstream = Upstream([sends(encode_error_frame("FutureCursor"), hold=False)])
    async with upstream as url:
        cfg = SubscriberConfig(backoff_base=0.2, backoff_max=0.2, rate_limits=[(1000, 1.0)])
        sub = HostSubscriber(url, lambda f: _append([], f), config=cfg)
        task = asyncio.create_task(sub.run())
        await until(lambda: len(upstream.cursors) >= 4, "four connections")
        await sub.stop()
        await asyncio.wait_for(task, 5)
    # Backed off, not a tight loop: "equal jitter" puts reconnects at least 0.1 s apart (half the
    # 0.2 s cap); a busy machine only stretches the gaps, it never shortens them.
    gaps = [b - a for a, b in zip(upstream.connected_at, upstream.connected_at[1:], strict=False)]
    assert len(gaps) >= 3 and all(g >= 0.095 for g in gaps), gaps
    assert sub.resets == 0 and sub.counters[Reason.FUTURE_CURSOR] >= 1


async def test_frame_over_5mb_is_delivered_for_a_typed_rejection() -> None:
    from firehose.validate import validate_frame

    got: list[UpstreamFrame] = []
    big = encode_frame("#commit", {"seq": 2, "repo": "did:plc:abc", "blocks": b"\x00" * 5_100_000})

    async def keep(f: UpstreamFrame) -> None:
        got.append(f)

    async with Upstream([sends(msg(1), big, msg(3))]) as url:
        sub = HostSubscriber(url, keep, config=fast_config())
        await run_until(sub, lambda: len(got) == 3, timeout=20)
    assert [f.seq for f in got] == [1, 2, 3]  # the stream goes on past it
    v = validate_frame(got[1].raw, None, None, 0.0)
    assert (v.kind, v.reason) == ("reject", Reason.FRAME_TOO_LARGE)


HUGE_CAP = 100_000


def huge(seq: int) -> bytes:
    return encode_frame("#identity", {"seq": seq, "did": "did:plc:abc", "pad": b"\x00" * (HUGE_CAP * 3)})


@pytest.mark.parametrize("inclusive,huge_seq,cursors", [
    (False, 6, [0, 6]),  # common servers: seq > cursor; the next ask excludes just the oversized one
    (True, 6, [0, 6, 7]),  # the spec's seq >= cursor: the oversized one comes first again, one step more
    (False, 8, [0, 6, 7, 8]),  # seqs 6 and 7 do not exist: one step per missing seq, none skipped wrongly
])
async def test_a_message_over_the_transport_cap_costs_only_itself(inclusive: bool, huge_seq: int,
                                                                   cursors: list[int]) -> None:
    """1..5, then a message over ``max_message_bytes`` (the connection closes with 1009), then
    9..12: every good frame is delivered exactly once and in order. Only 1..3 are ever stored
    (acked): the durable cursor stays at 3 throughout, never past 4 and 5 still in flight."""
    frames = [(i, msg(i)) for i in range(1, 6)] + [(huge_seq, huge(huge_seq))] + [(i, msg(i)) for i in range(9, 13)]
    got: list[int] = []
    cursors_seen: list[int | None] = []

    async def on_frame(f: UpstreamFrame) -> None:
        got.append(f.seq)
        cursors_seen.append(sub.cursor)
        if f.seq <= 3:
            sub.ack(f.seq)

    upstream = Upstream([replay(frames, inclusive=inclusive)])
    async with upstream as url:
        sub = HostSubscriber(url, on_frame, cursor=0, config=fast_config(max_message_bytes=HUGE_CAP),
                             on_cursor_reset=lambda old, reason: pytest.fail("cursor reset"))
        await run_until(sub, lambda: got[-1:] == [12], timeout=20)
    assert got == [1, 2, 3, 4, 5, 9, 10, 11, 12]
    assert upstream.cursors == cursors
    assert sub.cursor == 3 and max(c or 0 for c in cursors_seen) == 3
    assert sub.counters[Reason.FRAME_TOO_LARGE] == len(cursors) - 1 and sub.resets == 0


async def test_after_a_skip_a_later_reconnect_asks_from_the_durable_cursor() -> None:
    """The skip moves no durable state: when the connection that skipped the oversized message
    drops, the next one asks from the acked cursor (frames in flight are read again, never
    lost), meets the oversized message again and skips it again."""
    frames = [(i, msg(i)) for i in range(1, 6)] + [(6, huge(6))] + [(i, msg(i)) for i in range(7, 10)]
    got: list[int] = []

    async def on_frame(f: UpstreamFrame) -> None:
        got.append(f.seq)
        if f.seq <= 3:
            sub.ack(f.seq)

    first, dropping = replay(frames), replay(frames, hold=False)
    upstream = Upstream([first, dropping, replay(frames), replay(frames)])
    async with upstream as url:
        sub = HostSubscriber(url, on_frame, cursor=0, config=fast_config(max_message_bytes=HUGE_CAP))
        await run_until(sub, lambda: len(got) == 13 and len(upstream.cursors) == 4, timeout=20)
    assert upstream.cursors == [0, 6, 3, 6]
    assert got == [1, 2, 3, 4, 5, 7, 8, 9, 4, 5, 7, 8, 9]
    assert sub.cursor == 3 and sub.resets == 0 and sub.counters[Reason.FRAME_TOO_LARGE] == 2


async def test_resolve_pins_the_connection_to_the_vetted_address() -> None:
    """The host name does not resolve at all here (.invalid): frames arriving prove the socket went to
    the address ``resolve`` returned, and ``resolve`` is asked again before every reconnect."""
    asked: list[str] = []

    async def resolve(name: str) -> str:
        asked.append(name)
        return "127.0.0.1"

    got: list[int] = []
    async with Upstream([sends(msg(1), msg(2), hold=False), sends(msg(3))]) as url:
        port = urlsplit(url).port
        sub = HostSubscriber(f"http://pds.invalid:{port}", lambda f: _append(got, f), config=fast_config(),
                             resolve=resolve)
        await run_until(sub, lambda: got == [1, 2, 3])
    assert asked[:2] == ["pds.invalid", "pds.invalid"]


async def test_refused_destination_is_counted_and_never_connected() -> None:
    class Refused(Exception):
        reason = "non_public_address"

    async def resolve(name: str) -> str:
        raise Refused(name)

    upstream = Upstream([sends(msg(1))])
    async with upstream as url:
        port = urlsplit(url).port
        sub = HostSubscriber(f"http://pds.invalid:{port}", lambda f: _append([], f), config=fast_config(),
                             resolve=resolve)
        await run_until(sub, lambda: sub.counters[Reason.CONNECTION_FAILED] >= 2)
    assert sub.connections == 0 and upstream.cursors == []  # the server never saw a connection
