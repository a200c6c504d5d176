"""``GET /subscribe``: the Jetstream-compatible JSON stream, served from the verified event stream.

Each connection is an ordinary broadcaster session (``firehose.broadcast``: the same bounded live
queue, the same replay → live hand-over with no gap and no duplicate, the same ``ConsumerTooSlow``
rule as ``subscribeRepos``, lag probes included where the server offers them, i.e. under
``firehose.uvicorn_batch``; the cut is a 1008 close written behind the unsent messages); its events
are converted once for everyone
(``firehose.jetstream.JetstreamConverter``) and filtered per connection.

Query parameters (as Jetstream): ``wantedCollections`` and ``wantedDids`` (repeatable),
``maxMessageSizeBytes``, ``cursor`` (unix microseconds: replay every stored event with
``time_us >= cursor``, then live), ``compress=true`` (or a ``Socket-Encoding: zstd`` header: binary
zstd frames made with Jetstream's own dictionary, id 1612007021, the one Jetstream clients bundle;
also served at ``GET /subscribe/zstd-dictionary``), ``zstdDictionary=<id>`` (binary zstd frames made
with the dictionary of that id, as Jetstream's newer protocol opts in: the relay's own, fetched by
id from ``GET /xrpc/network.bsky.jetstream.getZstdDictionary?id=<id>``, which serves the current
one without ``id``; an unknown id is refused before the upgrade, ``400 UnknownZstdDictionary``
naming the current id), ``requireHello=true`` (nothing is sent until the first ``options_update``). Client text messages: ``options_update``
(replaces the filters from the next batch on), ``heartbeat`` (answered ``{"kind": "heartbeat",
"payload"}``); anything else is ignored; an invalid message closes the connection (1008, with the
reason). Bad parameters are refused before the upgrade: ``400 {"error": "InvalidRequest"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from firehose.broadcast import CONSUMER_TOO_SLOW, ERROR_KIND, Broadcaster, pump
from firehose.jetstream import (
    JetstreamConverter,
    JetstreamOptions,
    JetstreamOptionsError,
    ZstdCodec,
    heartbeat_message,
    parse_client_message,
    parse_options,
    select,
    seq_for_time,
)
from firehose.reasons import Reason
from firehose.serve_asgi import deny_websocket
from firehose.state import SequencedEvent
from firehose.uvicorn_batch import PROBE, SEND_BATCH
from relay.consumers import ConsumerRegistry, ConsumerTracking, jetstream_encoding
from relay.metrics import RelayMetrics

log = logging.getLogger("relay.jetstream")

SUBSCRIBE_PATH = "/subscribe"
DICTIONARY_PATH = "/subscribe/zstd-dictionary"
#: Jetstream's dictionary-by-id endpoint (lexicon ``network.bsky.jetstream.getZstdDictionary``).
GET_DICTIONARY_PATH = "/xrpc/network.bsky.jetstream.getZstdDictionary"
#: The largest cursor accepted (unix microseconds fit an int64).
MAX_CURSOR = 2**63 - 1

Count = Callable[[str], None]
CountMessages = Callable[[bool, int], None]


def _parse_cursor(raw: str | None) -> int | None:
    if raw is None or raw == "":
        return None
    if not raw.isascii() or not raw.isdigit() or len(raw) > 19 or int(raw) > MAX_CURSOR:
        raise JetstreamOptionsError(Reason.JETSTREAM_BAD_CURSOR, "cursor must be unix microseconds")
    return int(raw)


@dataclass(slots=True)
class _Connection:
    """The live, replaceable part of one consumer's state (the reader task updates it)."""

    options: JetstreamOptions
    dict_id: int | None  # the zstd dictionary messages are compressed with (None: plain text)
    sent: int = 0


@dataclass(frozen=True, slots=True)
class _AsgiApp:
    """``handler`` as a plain ASGI application."""

    handler: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handler(scope, receive, send)


class JetstreamServer:
    """The ASGI endpoints of the JSON stream over one ``Broadcaster``."""

    def __init__(self, broadcaster: Broadcaster, converter: JetstreamConverter, *,
                 count: Count | None = None, count_messages: CountMessages | None = None,
                 wrap: Callable[[ASGIApp], ASGIApp] | None = None) -> None:
        """``count(event)`` / ``count_messages(compressed, n)``: metrics hooks; ``wrap``: ASGI
        middleware around the WebSocket endpoint (the relay's consumer registry)."""
        self.broadcaster = broadcaster
        self.converter = converter
        self._count = count or (lambda event: None)
        self._count_messages = count_messages or (lambda compressed, n: None)
        self._wrap = wrap

    def websocket_app(self) -> ASGIApp:
        """The WebSocket endpoint for ``SUBSCRIBE_PATH`` (mounted by ``relay.routes``)."""
        # an ASGI callable, not a bound method: Starlette would call a method as ``endpoint(session)``
        app: ASGIApp = _AsgiApp(self._websocket)
        if self._wrap is not None:
            app = self._wrap(app)
        return app

    async def dictionary(self, request: Request) -> Response:
        """The dictionary of ``compress=true``."""
        return _dictionary_response(self.converter.codec)

    async def dictionary_by_id(self, request: Request) -> Response:
        """A dictionary by its zstd id (``?id``; omitted: the current one): ``400 InvalidRequest``
        for an id that is not a positive integer, ``400 DictionaryNotFound`` for an unknown one."""
        raw = request.query_params.get("id")
        if raw is None or raw == "":
            return _dictionary_response(self.converter.current)
        if not raw.isascii() or not raw.isdigit() or len(raw) > 10 or int(raw) < 1:
            self._count("dictionary_refused_bad_id")
            return JSONResponse({"error": "InvalidRequest", "message": "id must be a positive integer"},
                                status_code=400)
        codec = self.converter.codecs.get(int(raw))
        if codec is None:
            self._count("dictionary_refused_not_found")
            return JSONResponse({"error": "DictionaryNotFound",
                                 "message": f"no dictionary {raw}; current: {self.converter.current.dict_id}"},
                                status_code=400)
        return _dictionary_response(codec, immutable=True)

    def _dict_id(self, ws: WebSocket) -> int | None:
        """The dictionary a connection asks for: ``zstdDictionary=<id>``, else Jetstream's for
        ``compress=true`` or ``Socket-Encoding: zstd``, else None (plain text). Raises
        ``_UnknownDictionary`` for an id the relay does not have."""
        raw = ws.query_params.get("zstdDictionary")
        if raw:
            wanted = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 10 else None
            if wanted is None or wanted not in self.converter.codecs:
                raise _UnknownDictionary(f"unknown zstdDictionary {raw[:20]!r}; current: "
                                         f"{self.converter.current.dict_id}")
            return wanted
        if ws.query_params.get("compress") == "true" or "zstd" in ws.headers.get("socket-encoding", ""):
            return self.converter.codec.dict_id
        return None

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        ws = WebSocket(scope, receive, send)
        q = ws.query_params
        try:
            options = parse_options(q.getlist("wantedCollections"), q.getlist("wantedDids"),
                                    q.get("maxMessageSizeBytes"))
            cursor = _parse_cursor(q.get("cursor"))
        except JetstreamOptionsError as exc:
            self._count(f"refused_{exc.reason}")
            await deny_websocket(ws, 400, "InvalidRequest", exc.message)
            return
        try:
            dict_id = self._dict_id(ws)
        except _UnknownDictionary as exc:
            self._count("refused_unknown_zstd_dictionary")
            await deny_websocket(ws, 400, "UnknownZstdDictionary", str(exc))
            return
        if self.broadcaster.at_capacity:
            self._count("refused_at_capacity")
            await deny_websocket(ws, 429, "RateLimitExceeded", "too many consumers")
            return
        await ws.accept()
        self._count("connected")
        conn = _Connection(options, dict_id)
        hello = asyncio.Event()
        if q.get("requireHello") != "true":
            hello.set()
        reader = asyncio.create_task(self._read(ws, send, conn, hello))
        try:
            await self._stream(ws, send, conn, cursor, hello, reader)
        except (WebSocketDisconnect, OSError, RuntimeError) as exc:
            log.info("jetstream connection ended: %r", exc)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
        with contextlib.suppress(RuntimeError, OSError):
            if ws.application_state.name != "DISCONNECTED" and ws.client_state.name != "DISCONNECTED":
                await ws.close(code=1000)

    async def _stream(self, ws: WebSocket, send: Send, conn: _Connection, cursor: int | None,
                      hello: asyncio.Event, reader: asyncio.Task[str]) -> None:
        """Wait for the hello (if required), then stream; ``send`` is the raw ASGI send (frames
        bypass Starlette's per-message bookkeeping, and may use the batch extension)."""
        waiting = asyncio.ensure_future(hello.wait())
        try:
            await asyncio.wait({waiting, reader}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
        if reader.done():
            await self._close_for(ws, reader)
            return
        start = await seq_for_time(self.broadcaster.store, cursor) if cursor is not None else None
        session = self.broadcaster.session(start)
        batch_ext = SEND_BATCH in ws.scope.get("extensions", {})

        async def send_events(events: list[SequencedEvent]) -> None:
            for ev in events:
                if ev.kind == ERROR_KIND:  # the session ended itself (cannot happen for a time cursor)
                    raise WebSocketDisconnect(1011)
            picked = select(self.converter, events, conn.options, conn.dict_id)
            if not picked.messages:
                return
            conn.sent += len(picked.messages)
            compressed = conn.dict_id is not None
            self._count_messages(compressed, len(picked.messages))
            if batch_ext:
                await send({"type": SEND_BATCH, "frames": picked.messages, "text": not compressed})
            elif compressed:
                for data in picked.messages:
                    await send({"type": "websocket.send", "bytes": data})
            else:
                for data in picked.messages:
                    await send({"type": "websocket.send", "text": data.decode()})

        async def too_slow(_frame: bytes) -> None:
            self._count("too_slow")
            await ws.close(code=1008, reason="ConsumerTooSlow")

        send_final = probe = None
        if batch_ext:  # the close frame behind whatever is unsent, without waiting for the peer

            async def send_final(_frame: bytes) -> None:
                self._count("too_slow")
                await send({"type": SEND_BATCH, "frames": [], "text": True, "close": (1008, CONSUMER_TOO_SLOW)})

        if PROBE in ws.scope.get("extensions", {}):  # lag probes: too slow at any event rate, as subscribeRepos

            async def probe() -> None:
                await send({"type": PROBE})

        await pump(session, too_slow, reader, send_events=send_events, probe=probe, send_final=send_final)
        if session.too_slow.is_set() and send_final is not None:
            return  # the close went out; the protocol finishes the close handshake
        if reader.done():
            await self._close_for(ws, reader)

    async def _close_for(self, ws: WebSocket, reader: asyncio.Task[str]) -> None:
        """The reader ended: the peer left (nothing to do) or sent something invalid (close 1008)."""
        if reader.cancelled() or reader.exception() is not None:
            return
        reason = reader.result()
        if reason:
            with contextlib.suppress(RuntimeError, OSError):
                await ws.close(code=1008, reason=reason[:120])

    async def _read(self, ws: WebSocket, send: Send, conn: _Connection, hello: asyncio.Event) -> str:
        """Handle client messages until the peer leaves (returns "") or sends an invalid message
        (returns the reason to close with)."""
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return ""
            text = message.get("text")
            if text is None:
                continue  # binary client messages are ignored, as Jetstream does
            try:
                parsed = parse_client_message(text)
            except JetstreamOptionsError as exc:
                self._count(f"closed_{exc.reason}")
                log.info("jetstream client message refused", extra={"fields": {"reason": exc.reason}})
                return f"{exc.reason}: {exc.message}"
            if parsed.type == "options_update" and parsed.options is not None:
                conn.options = parsed.options
                self._count("options_update")
                hello.set()
            elif parsed.type == "heartbeat":
                self._count("heartbeat")
                await send({"type": "websocket.send", "text": heartbeat_message(parsed.payload).decode()})


class _UnknownDictionary(Exception):
    """``zstdDictionary`` names no dictionary the relay has."""


def _dictionary_response(codec: ZstdCodec, *, immutable: bool = False) -> Response:
    """The raw zstd dictionary, its id in ``X-Zstd-Dictionary-Id`` (and in every frame made with it)."""
    cache = "public, max-age=31536000, immutable" if immutable else "public, max-age=3600"
    return Response(codec.dictionary, media_type="application/octet-stream",
                    headers={"X-Zstd-Dictionary-Id": str(codec.dict_id), "Cache-Control": cache})


def jetstream_server(broadcaster: Broadcaster, metrics: RelayMetrics, consumers: ConsumerRegistry) -> JetstreamServer:
    """The relay's JSON stream: Jetstream's dictionary for ``compress=true``, the relay's own as
    the current opt-in one, the relay's metrics and consumer registry."""
    converter = JetstreamConverter(ZstdCodec.legacy(), ZstdCodec.default())

    def count(event: str) -> None:
        metrics.child(metrics.jetstream, event).inc()

    def count_messages(compressed: bool, n: int) -> None:
        metrics.child(metrics.jetstream_messages, "true" if compressed else "false").inc(n)

    return JetstreamServer(broadcaster, converter, count=count, count_messages=count_messages,
                           wrap=lambda app: ConsumerTracking(app, consumers, jetstream_encoding))
