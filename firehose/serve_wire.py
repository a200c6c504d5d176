"""WebSocket wire bytes of a live batch, built once and shared by every consumer.

The fan-out hands the same live batch to every caught-up consumer. Without a negotiated
extension (no permessage-deflate) a server's binary message is exactly an RFC 6455 §5.2 header
(FIN + opcode 0x2, unmasked, the payload length) followed by the payload, identical for every
connection. :class:`WireBatch` therefore frames the batch once, on first use, into one ``bytes``
object; each consumer's transport then gets that object in one ``write`` call (one send attempt
per consumer per batch, instead of one ``send_binary`` and one write per frame per consumer).

No state beyond the cached bytes, no I/O beyond :func:`write_live_batch`'s one write into the
transport it is given. A connection that negotiated an extension must not be sent
:meth:`WireBatch.wire` (its frames differ per connection); it frames ``frames`` itself.
"""

from __future__ import annotations

import asyncio
import struct

from websockets.protocol import Protocol, Side

__all__ = ["WireBatch", "binary_frame_header", "binary_wire", "write_live_batch"]

_BINARY_FIN = 0x82  # FIN + opcode 0x2 (binary); server frames are unmasked
_HEADER16 = struct.Struct("!BBH")
_HEADER64 = struct.Struct("!BBQ")


def binary_frame_header(n: int) -> bytes:
    """RFC 6455 §5.2 header of one unmasked, unfragmented binary frame of ``n`` payload bytes."""
    if n < 126:
        return bytes((_BINARY_FIN, n))
    if n < 1 << 16:
        return _HEADER16.pack(_BINARY_FIN, 126, n)
    return _HEADER64.pack(_BINARY_FIN, 127, n)


def binary_wire(frames: list[bytes]) -> bytes:
    """``frames`` as consecutive unmasked binary WebSocket messages, one ``bytes`` object."""
    parts: list[bytes] = []
    append = parts.append
    header = binary_frame_header
    for frame in frames:
        append(header(len(frame)))
        append(frame)
    return b"".join(parts)


class WireBatch:
    """A live batch's frames (in order), their total size, and — built on the first call of
    :meth:`wire`, then shared — the whole batch as unmasked binary WebSocket messages."""

    __slots__ = ("_wire", "frames", "nbytes")

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames
        self.nbytes = sum(map(len, frames))
        self._wire: bytes | None = None

    def wire(self) -> bytes:
        """The frames as unmasked binary messages without extensions (computed once)."""
        wire = self._wire
        if wire is None:
            wire = self._wire = binary_wire(self.frames)
        return wire


def write_live_batch(protocol: Protocol, transport: asyncio.WriteTransport, batch: WireBatch, limit: int) -> bool:
    """Write ``batch`` to an OPEN connection (the caller checked) in one transport call: False,
    writing nothing, when more than ``limit`` bytes are already unsent. Without extensions the
    shared :meth:`WireBatch.wire`, behind anything the protocol has queued (normally nothing:
    control frames keep their order); with one (permessage-deflate) each frame is framed, and
    compressed, by this connection's ``protocol``."""
    if transport.get_write_buffer_size() > limit:
        return False
    if protocol.extensions or protocol.side is not Side.SERVER or protocol.expect_continuation_frame:
        for frame in batch.frames:
            protocol.send_binary(frame)
        transport.writelines(protocol.data_to_send())
        return True
    pending = protocol.data_to_send()
    if pending:
        transport.writelines(pending)
    transport.write(batch.wire())
    return True
