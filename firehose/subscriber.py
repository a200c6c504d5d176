"""Upstream subscriber for one host's ``com.atproto.sync.subscribeRepos`` stream.

Contract:

* ``on_frame(UpstreamFrame)`` is called for every message frame that carries a ``seq``
  (``#commit #sync #identity #account``), in order; what it returns is awaited before the next
  frame (the backpressure), unless it is None (the frame was taken at once). A frame
  handed to ``on_frame`` belongs to the owner from then on: it is acknowledged (:meth:`ack`) once
  stored, or the owner replaces this subscriber with a new one from the acked cursor
  (``relay.ingest.hostruns`` does, when one of its events is not stored).
* The durable cursor advances **only** through :meth:`HostSubscriber.ack`, which the sequencer
  calls after the event is durably sequenced. A crash therefore replays, never skips. Reconnects
  ask from the durable cursor, except the one reconnect that skips a message over the transport
  cap (below).
* Per connection ``seq`` must strictly increase; a frame that does not is dropped and counted
  (``seq_not_increasing``). Frames with ``seq <= acked cursor`` are re-deliveries and skipped
  (``duplicate_event``).
* Cursor-reset policy — only when the host's stream really restarted (a wiped or restored host):
  a ``FutureCursor`` error, a first frame whose ``seq`` is below the cursor we asked for, or more
  than ``max_backwards`` consecutive non-increasing frames reset the cursor
  (``on_cursor_reset(old, reason)``, awaited before the cursor changes: the owner settles what is
  still in flight from the old stream first, so no late ``ack`` of it can move the new cursor)
  and the host's new stream is read from its start (cursor 0: what it emitted since it restarted
  is not skipped) instead of idling forever. Nothing else resets the cursor.
* A bad frame costs only itself. A message the codec rejects (``decode_frame``: undecodable
  CBOR header or body, a header or body that is not a map, trailing bytes, an empty message; a
  text message counts as ``bad_header_cbor``) is skipped alone: counted by its reason, logged with
  the host and the ``seq`` of the frame before it, and reading goes on with the next message on
  the same connection. Its ``seq`` cannot be read, so nothing else about it is known; the next
  good frame's ``ack`` moves the cursor past it.
* A message above the transport cap (``max_message_bytes``) cannot be skipped on its connection:
  the WebSocket library closes it (1009) without handing the message over. It is counted
  (``frame_too_large``) and the next connection asks from just past the last ``seq`` read on the
  failed one (``L + 1``; if that connection read nothing, from just past the cursor it asked
  for), so only the oversized message's span is skipped. This works whether the host's cursor is
  inclusive (the spec: ``seq >= cursor``) or exclusive (common servers: ``seq > cursor``): a
  connection whose first message is the oversized one again moves its next ask up by one, and
  every ``seq`` skipped that way is either the oversized message's own or a ``seq`` the host
  does not hold (the oversized message was the first one at or past the ask). The durable cursor
  is **not** moved by this: the frames read before the oversized one may still be in flight
  (delivered, not yet stored), and are acknowledged as they are stored. A later reconnect asks
  from the durable cursor as always; if it meets the oversized message again (frames before it
  were not yet all stored), it is skipped again the same way. Frames over 5 MB but under
  ``max_message_bytes`` are delivered so validation rejects them (``frame_too_large``).
* Rate limits are token buckets awaited before ``on_frame``: backpressure, never drops
  (``SubscriberConfig.for_host(per_second, per_hour, per_day)`` maps a host's stored limits).
* Read-ahead is bounded: the connection stops reading the socket (the upstream host's sends
  then wait in TCP) once more than ``read_ahead_frames`` whole messages (default 0) wait for the
  subscriber, and while the owner holds the reads (:meth:`HostSubscriber.hold_reads`: it is
  about to wait before admitting the frame in hand to its byte budget). So a host whose frame
  waits for admission has that frame in hand and at most the rest of one socket read (up to
  256 KiB, usually part of the next message) outside the owner's budget, not whole messages.
* Reconnects use capped exponential backoff with jitter; WebSocket pings keep the link alive.
* Unknown ``op``/``t`` are skipped and counted; ``#info`` is counted.
* Every count goes to ``counters`` (by :class:`Reason` value) and, when the owner passes
  ``on_count``, to ``on_count(reason)`` too (the relay's metrics).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from firehose.backoff import backoff_delay
from firehose.frames import Frame, FrameError, decode_frame
from firehose.ratelimit import RateLimiter
from firehose.reasons import Reason
from mst.errors import ReasonError

log = logging.getLogger(__name__)

SUBSCRIBE_PATH = "/xrpc/com.atproto.sync.subscribeRepos"


@dataclass(slots=True)
class SubscriberConfig:
    ping_interval: float = 20.0
    ping_timeout: float = 20.0
    open_timeout: float = 10.0
    close_timeout: float = 5.0
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    #: (events, window seconds) buckets; all must have a token.
    rate_limits: list[tuple[float, float]] = field(default_factory=lambda: [(50.0, 1.0), (2500.0, 3600.0)])
    max_backwards: int = 10
    #: Transport cap on one WebSocket message. Frames above the protocol's 5 MB but below this
    #: are still delivered, so validation rejects them with ``frame_too_large`` and the cursor
    #: moves past them; a message above it fails the connection (close 1009) and the next
    #: connection skips just that message (see the module docstring).
    max_message_bytes: int = 16_000_000
    #: Whole messages the connection may hold read ahead of the subscriber (``websockets``'
    #: ``max_queue`` high-water mark; reading resumes once the subscriber has taken them all).
    #: The ingest budget counts a frame only once it is admitted, so this read-ahead is outside
    #: it: with 0 (and the owner's :meth:`HostSubscriber.hold_reads` while it waits to admit a
    #: frame) a waiting host holds the frame in hand and at most the rest of one socket read;
    #: with n, up to n + 1 more whole messages (``max_message_bytes`` each in the worst case).
    read_ahead_frames: int = 0
    #: Decode with the full DRISL rules here too. Off by default: the subscriber only routes
    #: frames, and validation decodes every frame strictly (a non-strict frame becomes a typed
    #: per-frame rejection instead of a dropped connection), at a third of the parent's cost.
    strict_decode: bool = False
    #: Unreadable frames logged one by one per connection; past this, one line per 1,000 (all counted).
    log_skipped: int = 10

    @classmethod
    def for_host(
        cls, per_second: int | None, per_hour: int | None, per_day: int | None, **kw: float
    ) -> SubscriberConfig:
        """A config whose rate limits are a host's stored limits (``None`` = the default)."""
        defaults = dict((int(w), n) for n, w in cls().rate_limits)
        limits = [
            (float(per_second or defaults.get(1, 50.0)), 1.0),
            (float(per_hour or defaults.get(3600, 2500.0)), 3600.0),
        ]
        if per_day:
            limits.append((float(per_day), 86400.0))
        return cls(rate_limits=limits, **kw)  # type: ignore[arg-type]


@dataclass(slots=True)
class UpstreamFrame:
    host: str
    seq: int
    frame: Frame
    raw: bytes


class DestinationRefused(OSError):
    """``resolve`` refused the host's address (e.g. it now points somewhere private)."""


class _Reset(ReasonError):
    """The stream must be followed from its current position (``reason`` is a :class:`Reason` value)."""


def stream_url(host: str, cursor: int | None) -> str:
    """``ws[s]://host/xrpc/com.atproto.sync.subscribeRepos[?cursor=N]`` from a hostname or URL."""
    if "://" not in host:
        base = f"wss://{host}"
    else:
        parts = urlsplit(host)
        scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
        if scheme is None:
            raise ValueError(f"unsupported scheme in {host!r}")
        base = f"{scheme}://{parts.netloc}"
    url = base + SUBSCRIBE_PATH
    return url if cursor is None else f"{url}?cursor={cursor}"


class HostSubscriber:
    """Follows one upstream host. ``await run()`` until :meth:`stop`."""

    def __init__(
        self,
        host: str,
        on_frame: Callable[[UpstreamFrame], Awaitable[None] | None],
        *,
        cursor: int | None = None,
        config: SubscriberConfig | None = None,
        on_cursor_reset: Callable[[int | None, str], Awaitable[None] | None] | None = None,
        rng: random.Random | None = None,
        resolve: Callable[[str], Awaitable[str]] | None = None,
        on_count: Callable[[str], None] | None = None,
    ) -> None:
        """``resolve(name) -> address``: the caller's destination policy, asked before every
        connection; the socket then goes to exactly that address (TLS and the Host header still
        use the name) and no proxy, so DNS cannot move the connection after the check. An
        exception from it refuses that attempt (counted as ``connection_failed``, then backoff).
        ``on_count(reason)`` is called with every reason counted in ``counters`` (the owner's
        metrics); it must not raise or block."""
        self.host = host
        self.resolve = resolve
        self.on_frame = on_frame
        self.config = config or SubscriberConfig()
        self.on_cursor_reset = on_cursor_reset
        self.on_count = on_count
        self._acked = cursor
        self._rng = rng or random.Random()
        self.limiter = RateLimiter(self.config.rate_limits)
        self.counters: Counter[str] = Counter()
        self.connections = 0
        self.resets = 0
        self._stopping = asyncio.Event()
        self._ws: ClientConnection | None = None
        self.connected = asyncio.Event()
        #: ``time.monotonic()`` when the current (or last) connection opened
        self.connected_at = 0.0
        self._delivered = 0  # frames delivered on the current (or last) connection
        #: the last failure of a connection: (wall-clock seconds, "reason: detail"); None: none yet
        self.last_error: tuple[float, str] | None = None
        #: the cursor the current (or last) connection asked for, and the last seq read on it
        self._asked: int | None = None
        self._last_seq: int | None = None
        #: the cursor the next connection asks for instead of the durable one (a message over
        #: the transport cap is being skipped); used once
        self._skip_to: int | None = None
        #: the owner holds the current connection's reads (:meth:`hold_reads`)
        self._held = False

    def hold_reads(self) -> None:
        """Stop reading the current connection (if any) until :meth:`release_reads`: the owner is
        about to wait before it admits the frame in hand (its memory budget is full), and nothing
        more is to be read meanwhile. Synchronous; idempotent."""
        ws = self._ws
        if ws is not None and not self._held:
            self._held = True
            ws.transport.pause_reading()

    def release_reads(self) -> None:
        """Read again after :meth:`hold_reads` (unless the connection's own read-ahead bound
        still holds its reads: it resumes them when the subscriber takes its queued messages)."""
        if not self._held:
            return
        self._held = False
        ws = self._ws
        if ws is not None and not ws.recv_messages.paused:
            ws.transport.resume_reading()

    @property
    def reads_held(self) -> bool:
        """The owner holds the current connection's reads (:meth:`hold_reads`)."""
        return self._held

    def _count(self, reason: str) -> None:
        self.counters[reason] += 1
        if self.on_count is not None:
            self.on_count(reason)

    # -- cursor
    @property
    def cursor(self) -> int | None:
        """The reconnect cursor: the highest seq acknowledged as durably sequenced."""
        return self._acked

    def ack(self, upstream_seq: int) -> None:
        """Called by the sequencer after the event with this upstream seq is durable."""
        if self._acked is None or upstream_seq > self._acked:
            self._acked = upstream_seq

    async def _reset(self, reason: Reason) -> None:
        """The host's stream restarted: reset the cursor to 0 (its new stream from the start). The
        owner's ``on_cursor_reset`` runs first and must return only once no ``ack`` for the old
        stream can follow (``relay.ingest.hostruns`` waits for the run's in-flight frames to settle)."""
        old = self._acked
        self.resets += 1
        self._skip_to = None
        self._count(reason.value)
        log.warning("cursor reset", extra={"host": self.host, "old_cursor": old, "reason": reason.value})
        if self.on_cursor_reset is not None:
            result = self.on_cursor_reset(old, reason.value)
            if isinstance(result, Awaitable):
                await result
        self._acked = 0

    def backoff_delay(self, attempt: int) -> float:
        """Capped exponential backoff with "equal jitter": in [cap/2, cap] (``firehose.backoff``)."""
        return backoff_delay(attempt, self.config.backoff_base, self.config.backoff_max, rng=self._rng)

    async def stop(self) -> None:
        self._stopping.set()
        if self._ws is not None:
            await self._ws.close()

    async def run(self) -> None:
        attempt = 0
        while not self._stopping.is_set():
            try:
                await self._connect_once()
                reset_now = False
            except _Reset as r:
                self.last_error = (time.time(), f"{r.reason}: {r}")
                if not self._acked:  # nothing to reset (no cursor, or 0): a host that misbehaves anyway
                    self._count(r.reason)
                    reset_now = False
                else:  # a wiped or restored host: read its new stream from the start
                    await self._reset(Reason(r.reason))
                    reset_now = True
            except (OSError, ConnectionClosed, InvalidHandshake, InvalidStatus, TimeoutError) as exc:
                reset_now = False
                self.last_error = (time.time(), f"{type(exc).__name__}: {exc}"[:300])
                if isinstance(exc, ConnectionClosed) and exc.sent is not None and exc.sent.code == 1009:
                    self._skip_oversized()
                else:
                    self._count(Reason.CONNECTION_FAILED.value)
                log.info("upstream connection ended", extra={"host": self.host, "error": type(exc).__name__})
            if self._stopping.is_set():
                return
            if reset_now:
                continue
            # A connection that delivered frames before it was cut is not a failed attempt: the
            # next one starts from the first delay again (counted here, as the exception that
            # ended the connection carries no count).
            attempt = 0 if self._delivered else attempt + 1
            try:
                await asyncio.wait_for(self._stopping.wait(), self.backoff_delay(attempt))
            except TimeoutError:
                pass

    def _skip_oversized(self) -> None:
        """The connection was closed with 1009: a message above ``max_message_bytes`` follows
        the last seq read on it (or, if it read nothing, the cursor it asked for). Ask the next
        connection from just past that point, so only that message is skipped; the durable
        cursor stays where the acks put it (see the module docstring)."""
        self._count(Reason.FRAME_TOO_LARGE.value)
        before = self._last_seq if self._last_seq is not None else self._asked
        if before is None:
            self._skip_to = None  # we asked for the live stream: asking for it again skips it
        else:
            self._skip_to = max(before + 1, self._acked or 0)
        log.warning("upstream message over the transport cap skipped",
                    extra={"host": self.host, "after_seq": before, "next_cursor": self._skip_to,
                           "reason": Reason.FRAME_TOO_LARGE.value})

    def _skip_unreadable(self, reason: str, skipped: int) -> None:
        """Count and log (the first ``log_skipped`` per connection, then one in 1,000) a message
        that cannot be read; reading goes on with the next one."""
        self._count(reason)
        if skipped <= self.config.log_skipped or skipped % 1000 == 0:
            before = self._last_seq if self._last_seq is not None else self._asked
            log.warning("unreadable upstream frame skipped",
                        extra={"host": self.host, "after_seq": before, "reason": reason,
                               "skipped_on_connection": skipped})

    async def _connect_once(self) -> int:
        asked = self._acked if self._skip_to is None else self._skip_to
        self._skip_to = None
        self._asked, self._last_seq = asked, None
        url = stream_url(self.host, asked)
        delivered = self._delivered = 0
        skipped = 0
        pin: dict[str, object] = {}
        if self.resolve is not None:
            parts = urlsplit(url)
            try:
                address = await self.resolve(parts.hostname or "")
            except Exception as exc:
                reason = getattr(exc, "reason", type(exc).__name__)
                log.warning("upstream destination refused", extra={"host": self.host, "reason": reason})
                raise DestinationRefused(f"{self.host}: {reason}") from exc
            pin = {
                "host": address,
                "port": parts.port or (443 if parts.scheme == "wss" else 80),
                "proxy": None,
            }
        async with connect(
            url,
            **pin,  # type: ignore[arg-type]
            ping_interval=self.config.ping_interval,
            ping_timeout=self.config.ping_timeout,
            open_timeout=self.config.open_timeout,
            close_timeout=self.config.close_timeout,
            max_size=self.config.max_message_bytes,
            max_queue=(self.config.read_ahead_frames, 0),
            compression=None,
        ) as ws:
            self._ws = ws
            self._held = False
            self.connections += 1
            self.connected_at = time.monotonic()
            self.connected.set()
            last_seq: int | None = None
            backwards = 0
            try:
                async for raw in ws:
                    if isinstance(raw, str):
                        skipped += 1
                        self._skip_unreadable(Reason.BAD_HEADER_CBOR.value, skipped)
                        continue
                    try:
                        frame = decode_frame(
                            raw, max_bytes=self.config.max_message_bytes, strict=self.config.strict_decode
                        )
                    except FrameError as exc:  # this message alone is lost: go on with the next
                        skipped += 1
                        self._skip_unreadable(exc.reason, skipped)
                        continue
                    ignored = frame.ignored_reason
                    if ignored is not None:
                        self._count(ignored)
                        continue
                    if frame.is_error:
                        self._count(Reason.ERROR_FRAME.value)
                        if frame.error == "FutureCursor":
                            raise _Reset(Reason.FUTURE_CURSOR)
                        log.info("upstream error frame", extra={"host": self.host, "error": frame.error})
                        return delivered
                    if frame.t == "#info":
                        name = frame.body.get("name")
                        known = name == "OutdatedCursor"
                        self._count((Reason.INFO_OUTDATED_CURSOR if known else Reason.INFO_OTHER).value)
                        continue
                    seq = frame.body.get("seq")
                    if type(seq) is not int or seq < 1:
                        self._count(Reason.MISSING_SEQ.value)
                        continue
                    if last_seq is None and asked is not None and seq < asked:
                        await self._reset(Reason.SEQ_WENT_BACKWARDS)
                        asked = None
                    elif last_seq is not None and seq <= last_seq:
                        self._count(Reason.SEQ_NOT_INCREASING.value)
                        backwards += 1
                        if backwards > self.config.max_backwards:
                            raise _Reset(Reason.SEQ_WENT_BACKWARDS)
                        continue
                    backwards = 0
                    last_seq = self._last_seq = seq
                    if self._acked is not None and seq <= self._acked:
                        self._count(Reason.DUPLICATE_EVENT.value)
                        continue
                    if not self.limiter.take_now():
                        await self.limiter.acquire()
                    pending = self.on_frame(UpstreamFrame(self.host, seq, frame, bytes(raw)))
                    if pending is not None:  # the owner's backpressure (None: taken at once)
                        await pending
                    delivered += 1
                    self._delivered = delivered
            finally:
                self._ws = None
                self._held = False
                self.connected.clear()
        return delivered
