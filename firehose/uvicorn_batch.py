"""uvicorn's sans-I/O WebSocket protocol plus one ASGI extension: send a list of binary messages
with a single transport write.

ASGI has no way to send several WebSocket messages at once, so through the main (ASGI) port every
firehose frame cost an awaited ``send``, a ``data_to_send`` and a ``transport.write`` (a syscall
attempt) of its own. With ``uvicorn.Config(ws=BatchingWebSocketsProtocol)`` the WebSocket scope
advertises ``scope["extensions"][SEND_BATCH]``; an app may then send
``{"type": SEND_BATCH, "frames": [bytes, …]}`` once the socket is accepted: every frame is framed
by the same ``websockets`` protocol object and all go out in one ``writelines``, after the same
backpressure wait as a single ``websocket.send``. With ``"text": True`` the frames (UTF-8 bytes)
are sent as text messages instead (the JSON stream). Apps that do not look for the extension are
unaffected (``firehose.serve_asgi`` uses it when present).
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState

__all__ = ["SEND_BATCH", "BatchingWebSocketsProtocol"]

#: ASGI message type (and scope extension name) for a batch of binary messages.
SEND_BATCH = "relay.websocket.send_batch"


class BatchingWebSocketsProtocol(WebSocketsSansIOProtocol):
    """See the module docstring."""

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        self.scope["extensions"][SEND_BATCH] = {}  # the app task has not run yet

    async def send(self, message: Any) -> None:
        if message["type"] != SEND_BATCH:
            await super().send(message)
            return
        await self.writable.wait()
        if self.disconnected:
            raise ClientDisconnected()
        if not self.handshake_complete or self.close_sent or self.initial_response is not None:
            raise RuntimeError(f"{SEND_BATCH} is only allowed on an accepted, open WebSocket")
        try:
            send = self.conn.send_text if message.get("text") else self.conn.send_binary
            for frame in message["frames"]:
                send(frame)
        except InvalidState:
            raise ClientDisconnected() from None
        self.transport.writelines(self.conn.data_to_send())
