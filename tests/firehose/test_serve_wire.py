"""firehose.serve_wire: a live batch framed once is byte-for-byte what ``websockets`` frames."""

from __future__ import annotations

import pytest
from websockets.protocol import Side
from websockets.server import ServerProtocol

from firehose.serve_wire import WireBatch, binary_wire

# every length encoding of RFC 6455 §5.2 on both sides of its boundaries
SIZES = [0, 1, 125, 126, 127, 65_535, 65_536, 70_000]


def _websockets_bytes(frames: list[bytes]) -> bytes:
    """What an OPEN ``websockets`` server protocol without extensions writes for ``frames``."""
    protocol = ServerProtocol()
    protocol.state = protocol.state.__class__.OPEN  # skip the handshake: framing only
    assert protocol.side is Side.SERVER and not protocol.extensions
    for frame in frames:
        protocol.send_binary(frame)
    return b"".join(protocol.data_to_send())


@pytest.mark.parametrize("size", SIZES)
def test_one_frame_matches_websockets(size: int) -> None:
    frame = bytes(range(256)) * (size // 256) + bytes(size % 256)
    assert binary_wire([frame]) == _websockets_bytes([frame])


def test_a_batch_is_the_frames_in_order_and_framed_once() -> None:
    frames = [bytes([i]) * n for i, n in enumerate(SIZES)]
    batch = WireBatch(frames)
    assert batch.nbytes == sum(SIZES)
    wire = batch.wire()
    assert wire == _websockets_bytes(frames)
    assert batch.wire() is wire  # shared: later consumers get the same object
