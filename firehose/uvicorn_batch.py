"""uvicorn's sans-I/O WebSocket protocol plus ASGI extensions for the firehose: send a list of
binary messages with a single transport write, probe the peer with a ping, and send a last frame
and close without waiting for a stalled peer.

ASGI has no way to send several WebSocket messages at once, so through the main (ASGI) port every
firehose frame cost an awaited ``send``, a ``data_to_send`` and a ``transport.write`` (a syscall
attempt) of its own. With ``uvicorn.Config(ws=BatchingWebSocketsProtocol)`` the WebSocket scope
advertises ``scope["extensions"][SEND_BATCH]`` and ``[PROBE]``; once the socket is accepted an app
may send:

* ``{"type": SEND_BATCH, "frames": [bytes, …]}``: every frame is framed by the same ``websockets``
  protocol object and all go out in one ``writelines``, after the same backpressure wait as a
  single ``websocket.send``. With ``"text": True`` the frames (UTF-8 bytes) are sent as text
  messages instead (the JSON stream);
* the same with ``"close": (code, reason)``: the frames and a close frame are written at once,
  *without* waiting for backpressure (behind whatever the peer has not read yet), and the
  connection is aborted if the peer has not completed the closing handshake ``close_timeout``
  seconds later (the ASGI ``websocket.close`` would instead wait for the peer to drain first);
* ``{"type": PROBE}``: a ping is written after everything sent so far and the ``send`` returns
  when its pong arrives (a pong answers its ping and every earlier one), i.e. once the peer has
  read all of it. ``ClientDisconnected`` if the connection goes away first.

The scope also advertises ``scope["extensions"][DIRECT_WRITE]["write"]``, a plain (not async)
function ``write(batch: WireBatch, limit: int) -> bool`` for a fan-out that writes to many
connections in one loop turn: the batch goes into the transport at once, without a task switch,
an ASGI message or a backpressure wait — as unmasked binary messages framed once for every
connection (:meth:`firehose.serve_wire.WireBatch.wire`) unless this connection negotiated an
extension. It returns False, writing nothing, when the transport already holds more than
``limit`` unsent bytes (the caller decides what a full buffer means); True when written, and
also when the connection is no longer open (nothing is written; the app sees the disconnect
through ``receive``). The app must not call it while a ``send`` of its own is in progress.

Apps that do not look for the extensions are unaffected (``firehose.serve_asgi`` uses them when
present).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState
from websockets.protocol import State

from firehose.serve_wire import WireBatch, write_live_batch

__all__ = ["DIRECT_WRITE", "PROBE", "SEND_BATCH", "BatchingWebSocketsProtocol"]

#: ASGI message type (and scope extension name) for a batch of binary messages.
SEND_BATCH = "relay.websocket.send_batch"
#: ASGI message type (and scope extension name) for a ping that ``send`` waits to see answered.
PROBE = "relay.websocket.probe"
#: ASGI scope extension name: a synchronous batch write (see the module docstring).
DIRECT_WRITE = "relay.websocket.direct_write"
_probe_ids = itertools.count(1)


class BatchingWebSocketsProtocol(WebSocketsSansIOProtocol):
    """See the module docstring."""

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        self.scope["extensions"][SEND_BATCH] = {}  # the app task has not run yet
        self.scope["extensions"][PROBE] = {}
        self.scope["extensions"][DIRECT_WRITE] = {"write": self.direct_write}
        self._probes: dict[bytes, asyncio.Future[None]] = {}

    async def send(self, message: Any) -> None:
        kind = message["type"]
        if kind == PROBE:
            await self._probe()
            return
        if kind != SEND_BATCH:
            await super().send(message)
            return
        close = message.get("close")
        if close is None:
            await self.writable.wait()
        if self.disconnected:
            raise ClientDisconnected()
        if not self.handshake_complete or self.close_sent or self.initial_response is not None:
            raise RuntimeError(f"{SEND_BATCH} is only allowed on an accepted, open WebSocket")
        try:
            send = self.conn.send_text if message.get("text") else self.conn.send_binary
            for frame in message["frames"]:
                send(frame)
            if close is not None:
                self.conn.send_close(*close)
        except InvalidState:
            raise ClientDisconnected() from None
        self.transport.writelines(self.conn.data_to_send())
        if close is not None:
            self.close_sent = True
            self.queue.put_nowait({"type": "websocket.disconnect", "code": close[0], "reason": close[1]})
            if self.read_paused:  # the peer's close frame must be read to finish the handshake
                self.read_paused = False
                self.transport.resume_reading()
            self.close_timer = self.loop.call_later(self.close_timeout, self.transport.abort)

    def direct_write(self, batch: WireBatch, limit: int) -> bool:
        """See the module docstring (``DIRECT_WRITE``)."""
        conn = self.conn
        if (self.disconnected or self.close_sent or not self.handshake_complete
                or self.initial_response is not None or conn.state is not State.OPEN):
            return True  # not open (any more): the app learns it from receive
        return write_live_batch(conn, self.transport, batch, limit)

    async def _probe(self) -> None:
        if self.disconnected or self.close_sent or not self.handshake_complete:
            raise ClientDisconnected()
        payload = b"relay-probe-%d" % next(_probe_ids)
        answered: asyncio.Future[None] = self.loop.create_future()
        self._probes[payload] = answered
        try:
            self.conn.send_ping(payload)
            self.transport.write(b"".join(self.conn.data_to_send()))
            await answered
        finally:
            self._probes.pop(payload, None)

    def handle_pong(self, event: Any) -> None:
        payload = bytes(event.data)
        if payload not in self._probes:
            super().handle_pong(event)  # uvicorn's keepalive
            return
        for key in list(self._probes):  # in the order sent: this one and every earlier one
            answered = self._probes.pop(key)
            if not answered.done():
                answered.set_result(None)
            if key == payload:
                break

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        for answered in getattr(self, "_probes", {}).values():
            if not answered.done():
                answered.set_exception(ClientDisconnected())
