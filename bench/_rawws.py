"""A minimal, cheap WebSocket *receiver* for benchmarks (many consumers in one process).

Only what a firehose consumer needs: the client handshake, then unmasked server frames parsed
straight from the TCP stream (no per-message objects beyond the payload). Pings are answered
with pongs, other control frames skipped; a close frame ends the stream. This keeps the consumers' own CPU small so the figures
describe the server, not the load generator.
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
import zlib
from collections.abc import Callable
from urllib.parse import urlsplit


def _pong(payload: bytes) -> bytes:
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload[:125]))
    return bytes([0x8A, 0x80 | len(masked)]) + mask + masked


class _Inflater:
    """permessage-deflate (RFC 7692) on the receiving side, as the server's response set it up."""

    def __init__(self, response_head: bytes) -> None:
        self._reset = b"server_no_context_takeover" in response_head.lower()
        self._z = zlib.decompressobj(-15)

    def inflate(self, payload: bytes) -> bytes:
        if self._reset:
            self._z = zlib.decompressobj(-15)
        return self._z.decompress(payload + b"\x00\x00\xff\xff")


async def subscribe(url: str, on_message: Callable[[bytes, float], None], *,
                    stop: asyncio.Event, connected: Callable[[], None] | None = None,
                    read_size: int = 1 << 16, stall: bool = False, deflate: bool = False,
                    inflate: bool = True, on_bytes: Callable[[int], None] | None = None) -> str:
    """Receive messages from ``url`` until ``stop`` is set or the server closes; returns why it ended.

    ``deflate`` offers permessage-deflate; if the server accepts, compressed messages are inflated
    before ``on_message`` unless ``inflate`` is False (then they are passed on compressed: a
    consumer that only counts). ``on_bytes(n)`` is told the size of every read from the socket
    (the bytes on the wire after the handshake)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
    key = base64.b64encode(os.urandom(16)).decode()
    offer = "Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits\r\n" if deflate else ""
    writer.write((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                  f"{offer}\r\n").encode())
    head = await reader.readuntil(b"\r\n\r\n")
    if b" 101 " not in head.split(b"\r\n", 1)[0]:
        writer.close()
        return "handshake_failed"
    inflater = _Inflater(head) if deflate and inflate and b"permessage-deflate" in head.lower() else None
    if connected:
        connected()
    if stall:
        writer.transport.pause_reading()
        await stop.wait()
        writer.transport.abort()
        return "stopped"
    buf = b""
    frag: list[bytes] = []
    compressed = False
    stop_task = asyncio.ensure_future(stop.wait())
    try:
        while True:
            read = asyncio.ensure_future(reader.read(read_size))
            done, _ = await asyncio.wait((read, stop_task), return_when=asyncio.FIRST_COMPLETED)
            if read not in done:
                read.cancel()
                return "stopped"
            chunk = read.result()
            if not chunk:
                return "eof"
            now = time.time()
            if on_bytes is not None:
                on_bytes(len(chunk))
            buf = buf + chunk if buf else chunk
            pos = 0
            n = len(buf)
            while n - pos >= 2:
                b0, b1 = buf[pos], buf[pos + 1]
                length = b1 & 0x7F
                hdr = 2
                if length == 126:
                    if n - pos < 4:
                        break
                    length = int.from_bytes(buf[pos + 2:pos + 4], "big")
                    hdr = 4
                elif length == 127:
                    if n - pos < 10:
                        break
                    length = int.from_bytes(buf[pos + 2:pos + 10], "big")
                    hdr = 10
                if n - pos < hdr + length:
                    break
                opcode = b0 & 0x0F
                payload = buf[pos + hdr:pos + hdr + length]
                pos += hdr + length
                if opcode == 8:
                    code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else 0
                    return f"closed:{code}:{payload[2:].decode(errors='replace')[:60]}"
                if opcode == 9:  # ping: answer with a (masked, as a client must) pong
                    writer.write(_pong(payload))
                    continue
                if opcode in (1, 2, 0):
                    if opcode:
                        compressed = bool(b0 & 0x40)  # RSV1 on a message's first frame
                    frag.append(payload)
                    if b0 & 0x80:
                        msg = frag[0] if len(frag) == 1 else b"".join(frag)
                        frag = []
                        if compressed and inflater is not None:
                            msg = inflater.inflate(msg)
                        on_message(msg, now)
            buf = buf[pos:]
    finally:
        stop_task.cancel()
        writer.transport.abort()
