"""Upstream subscriber for one host's ``com.atproto.sync.subscribeRepos`` stream.

Contract:

* ``on_frame(UpstreamFrame)`` is awaited for every message frame that carries a ``seq``
  (``#commit #sync #identity #account``), in order; awaiting it is the backpressure.
* The reconnect cursor advances **only** through :meth:`HostSubscriber.ack`, which the sequencer
  calls after the event is durably sequenced. A crash therefore replays, never skips.
* Per connection ``seq`` must strictly increase; a frame that does not is dropped and counted
  (``seq_not_increasing``). Frames with ``seq <= acked cursor`` are re-deliveries and skipped
  (``duplicate_event``).
* Cursor-reset policy (a wiped or restored host): a ``FutureCursor`` error, a first frame whose
  ``seq`` is below the cursor we asked for, or more than ``max_backwards`` consecutive
  non-increasing frames reset the cursor (``on_cursor_reset(old, reason)``, awaited before the
  cursor changes: the owner settles what is still in flight from the old stream first, so no
  late ``ack`` of it can move the new cursor) and the host's new stream is read from its start
  (cursor 0: what it emitted since it restarted is not skipped) instead of idling forever.
* Rate limits are token buckets awaited before ``on_frame``: backpressure, never drops
  (``SubscriberConfig.for_host(per_second, per_hour, per_day)`` maps a host's stored limits).
* Reconnects use capped exponential backoff with jitter; WebSocket pings keep the link alive.
* Malformed frames drop the connection (event-stream spec: invalid framing is a hard error);
  if the same unreadable frame fails the connection twice at the same cursor (a host replaying
  a poison frame), the cursor is reset past it instead of retrying forever. Frames over 5 MB but
  under ``max_message_bytes`` are delivered so validation rejects them (``frame_too_large``).
  Unknown ``op``/``t`` are skipped and counted; ``#info`` is counted.
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
    #: moves past them; a message above it fails the connection (close 1009) and, if that
    #: happens twice at the same cursor, the cursor is reset instead of retrying forever.
    max_message_bytes: int = 16_000_000
    #: Decode with the full DRISL rules here too. Off by default: the subscriber only routes
    #: frames, and validation decodes every frame strictly (a non-strict frame becomes a typed
    #: per-frame rejection instead of a dropped connection), at a third of the parent's cost.
    strict_decode: bool = False


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


class _Poison(ReasonError):
    """A frame that fails the connection (undecodable, or over the transport cap)."""


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
        on_frame: Callable[[UpstreamFrame], Awaitable[None]],
        *,
        cursor: int | None = None,
        config: SubscriberConfig | None = None,
        on_cursor_reset: Callable[[int | None, str], Awaitable[None] | None] | None = None,
        rng: random.Random | None = None,
        resolve: Callable[[str], Awaitable[str]] | None = None,
    ) -> None:
        """``resolve(name) -> address``: the caller's destination policy, asked before every
        connection; the socket then goes to exactly that address (TLS and the Host header still
        use the name) and no proxy, so DNS cannot move the connection after the check. An
        exception from it refuses that attempt (counted as ``connection_failed``, then backoff)."""
        self.host = host
        self.resolve = resolve
        self.on_frame = on_frame
        self.config = config or SubscriberConfig()
        self.on_cursor_reset = on_cursor_reset
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
        self._poison_at: int | None = None  # cursor at which an unreadable frame failed us
        self._delivered = 0  # frames delivered on the current (or last) connection

    # -- cursor
    @property
    def cursor(self) -> int | None:
        """The reconnect cursor: the highest seq acknowledged as durably sequenced."""
        return self._acked

    def ack(self, upstream_seq: int) -> None:
        """Called by the sequencer after the event with this upstream seq is durable."""
        if self._acked is None or upstream_seq > self._acked:
            self._acked = upstream_seq

    async def _reset(self, reason: Reason, resume: int | None = None) -> None:
        """Reset the cursor to ``resume`` (0: the host's whole stream; None: live from now). The
        owner's ``on_cursor_reset`` runs first and must return only once no ``ack`` for the old
        stream can follow (``relay.upstreams`` waits for the run's in-flight frames to settle)."""
        old = self._acked
        self.resets += 1
        self.counters[reason.value] += 1
        log.warning("cursor reset", extra={"host": self.host, "old_cursor": old, "reason": reason.value})
        if self.on_cursor_reset is not None:
            result = self.on_cursor_reset(old, reason.value)
            if isinstance(result, Awaitable):
                await result
        self._acked = resume

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
                if not self._acked:  # nothing to reset (no cursor, or 0): a host that misbehaves anyway
                    self.counters[r.reason] += 1
                    reset_now = False
                else:  # a wiped or restored host: read its new stream from the start
                    await self._reset(Reason(r.reason), resume=0)
                    reset_now = True
            except _Poison as p:
                reset_now = await self._poisoned(p.reason)
            except (OSError, ConnectionClosed, InvalidHandshake, InvalidStatus, TimeoutError) as exc:
                reset_now = False
                if isinstance(exc, ConnectionClosed) and exc.sent is not None and exc.sent.code == 1009:
                    self.counters[Reason.FRAME_TOO_LARGE.value] += 1
                    reset_now = await self._poisoned(Reason.FRAME_TOO_LARGE.value)
                else:
                    self.counters[Reason.CONNECTION_FAILED.value] += 1
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

    async def _poisoned(self, reason: str) -> bool:
        """A frame we cannot read failed the connection. The first time, reconnect (it may have
        been a transient corruption); the second time at the same cursor the host would replay
        it forever, so reset the cursor past it. Returns True when the cursor was reset."""
        if self._poison_at is not None and self._poison_at == self._acked:
            self._poison_at = None
            await self._reset(Reason(reason))
            return True
        self._poison_at = self._acked
        return False

    async def _connect_once(self) -> int:
        asked = self._acked
        url = stream_url(self.host, asked)
        delivered = self._delivered = 0
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
            compression=None,
        ) as ws:
            self._ws = ws
            self.connections += 1
            self.connected_at = time.monotonic()
            self.connected.set()
            last_seq: int | None = None
            backwards = 0
            try:
                async for raw in ws:
                    if isinstance(raw, str):
                        self.counters[Reason.BAD_HEADER_CBOR.value] += 1
                        raise _Poison(Reason.BAD_HEADER_CBOR.value)
                    try:
                        frame = decode_frame(
                            raw, max_bytes=self.config.max_message_bytes, strict=self.config.strict_decode
                        )
                    except FrameError as exc:  # hard error: drop the connection
                        self.counters[exc.reason] += 1
                        raise _Poison(exc.reason) from None
                    ignored = frame.ignored_reason
                    if ignored is not None:
                        self.counters[ignored] += 1
                        continue
                    if frame.is_error:
                        self.counters[Reason.ERROR_FRAME.value] += 1
                        if frame.error == "FutureCursor":
                            raise _Reset(Reason.FUTURE_CURSOR)
                        log.info("upstream error frame", extra={"host": self.host, "error": frame.error})
                        return delivered
                    if frame.t == "#info":
                        name = frame.body.get("name")
                        known = name == "OutdatedCursor"
                        self.counters[(Reason.INFO_OUTDATED_CURSOR if known else Reason.INFO_OTHER).value] += 1
                        continue
                    seq = frame.body.get("seq")
                    if type(seq) is not int or seq < 1:
                        self.counters[Reason.MISSING_SEQ.value] += 1
                        continue
                    if last_seq is None and asked is not None and seq < asked:
                        await self._reset(Reason.SEQ_WENT_BACKWARDS, resume=0)
                        asked = None
                    elif last_seq is not None and seq <= last_seq:
                        self.counters[Reason.SEQ_NOT_INCREASING.value] += 1
                        backwards += 1
                        if backwards > self.config.max_backwards:
                            raise _Reset(Reason.SEQ_WENT_BACKWARDS)
                        continue
                    backwards = 0
                    last_seq = seq
                    if self._acked is not None and seq <= self._acked:
                        self.counters[Reason.DUPLICATE_EVENT.value] += 1
                        continue
                    await self.limiter.acquire()
                    await self.on_frame(UpstreamFrame(self.host, seq, frame, bytes(raw)))
                    delivered += 1
                    self._delivered = delivered
            finally:
                self._ws = None
                self.connected.clear()
        return delivered
