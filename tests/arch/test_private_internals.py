"""Private internals of dependencies that the code relies on, each imported and used here.

A failure names the dependency, its installed version and what moved: fix the user (named in the
message) before raising that dependency's upper bound in pyproject.toml. End-to-end coverage of
the same internals: tests/mst (cbrrr, coincurve), tests/firehose/test_uvicorn_batch.py and
tests/relay/test_http_limits.py (uvicorn),
tests/firehose/test_batched_replay.py and test_broadcast.py (websockets).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import pytest


def check(dist: str, what: str, used_by: str, probe: Callable[[], Any]) -> Any:
    """Run ``probe``; on any failure (or a falsy result) fail with a message naming the dependency."""
    try:
        result = probe()
    except Exception as exc:
        pytest.fail(f"{dist} {version(dist)}: {what} moved or changed ({type(exc).__name__}: {exc}); "
                    f"relied on by {used_by}", pytrace=False)
    if result is False:
        pytest.fail(f"{dist} {version(dist)}: {what} no longer holds; relied on by {used_by}", pytrace=False)
    return result


def attr(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


# -- cbrrr: the C module cbrrr._cbrrr, called directly (mst.cbor, firehose.frames, firehose.framing)

def test_cbrrr_c_module() -> None:
    import cbrrr

    c = check("cbrrr", "module cbrrr._cbrrr", "mst.cbor, firehose.frames, firehose.framing",
              lambda: importlib.import_module("cbrrr._cbrrr"))
    link = cbrrr.CID.cidv1_dag_cbor_sha256_32_from(b"\xa0")
    data = cbrrr.encode_dag_cbor({"a": 1, "l": link})
    seen: list[bytes] = []

    def ctor(raw: bytes) -> bytes:
        seen.append(bytes(raw))
        return bytes(raw)

    check("cbrrr", "_cbrrr.encode_dag_cbor(obj, cid_type, atjson_mode) -> bytes", "mst.cbor.encode",
          lambda: c.encode_dag_cbor({"a": 1, "l": link}, cbrrr.CID, False) == data)
    check("cbrrr", "_cbrrr.decode_dag_cbor(buffer, cid_ctor, atjson_mode) -> (obj, length)",
          "mst.cbor.decode_prefix, firehose.frames, firehose.framing._skip_value",
          lambda: c.decode_dag_cbor(memoryview(data + b"\x00"), ctor, False) == ({"a": 1, "l": seen[0]}, len(data)))
    check("cbrrr", "the CID constructor receives the 36 CID bytes (no 0x00 multibase prefix)",
          "mst.cbor._strict_cid", lambda: seen == [link.cid_bytes] and len(seen[0]) == 36)
    check("cbrrr", "cbrrr.CbrrrDecodeError", "mst.cbor", lambda: issubclass(cbrrr.CbrrrDecodeError, Exception))
    check("cbrrr", "atjson mode renders a tag-42 link as {'$link': base32 string} without calling the ctor",
          "spark.partitioning.cid_strs",
          lambda: c.decode_dag_cbor(data, None, True) == ({"a": 1, "l": {"$link": link.encode()}}, len(data)))


# -- the standard library's C JSON encoder, built once (spark.dagjson._c_encode)

def test_json_c_make_encoder() -> None:
    """Not a pinned dependency (the interpreter's own module): plain asserts."""
    import json.encoder

    from spark.dagjson import _ENCODE, _ENCODER

    assert json.encoder.c_make_encoder is not None, "no C JSON encoder: spark.dagjson falls back (slower)"
    assert _ENCODE != _ENCODER.encode  # the C path is the one in use
    value = {"b": [1, "é\n", None, {"a": 2.5}], "a": True}
    assert _ENCODE(value) == _ENCODER.encode(value) == '{"a":true,"b":[1,"é\\n",null,{"a":2.5}]}'


@pytest.mark.parametrize(("hex_data", "reason"), [
    ("1801", "cbor_non_minimal"), ("a2616201616101", "cbor_map_key_order"), ("a10101", "cbor_unexpected_type"),
    ("9f00ff", "cbor_indefinite_length"), ("fa3f800000", "cbor_float_not_float64"), ("f7", "cbor_simple_value"),
    ("1a0000", "cbor_truncated"),
])
def test_cbrrr_error_messages_still_classify(hex_data: str, reason: str) -> None:
    """mst.cbor._classify maps cbrrr's error *messages* to reasons; new wording would turn them
    all into ``cbor_malformed``."""
    from mst import cbor
    from mst.errors import CBORError

    def probe() -> bool:
        try:
            cbor.decode(bytes.fromhex(hex_data))
        except CBORError as exc:
            return exc.reason == reason
        return False

    check("cbrrr", f"the decode error message for {reason}", "mst.cbor._classify", probe)


# -- coincurve: the cffi bindings (mst.crypto.PublicKey.verify, PrivateKey.sign)

def test_coincurve_cffi_bindings() -> None:
    import hashlib

    import coincurve

    ffi = check("coincurve", "coincurve._libsecp256k1.ffi", "mst.crypto",
                lambda: attr("coincurve._libsecp256k1", "ffi"))
    lib = check("coincurve", "coincurve._libsecp256k1.lib", "mst.crypto",
                lambda: attr("coincurve._libsecp256k1", "lib"))
    ctx = check("coincurve", "coincurve.context.GLOBAL_CONTEXT.ctx", "mst.crypto",
                lambda: attr("coincurve.context", "GLOBAL_CONTEXT").ctx)
    key = coincurve.PrivateKey()
    msg = b"relay"
    sig = check("coincurve", "PrivateKey.sign_recoverable(msg) = r || s || recid (65 bytes, SHA-256)",
                "mst.crypto.PrivateKey.sign", lambda: key.sign_recoverable(msg))
    assert len(sig) == 65
    pub = check("coincurve", "PublicKey.public_key (the secp256k1_pubkey pointer)", "mst.crypto.PublicKey",
                lambda: coincurve.PublicKey(key.public_key.format()).public_key)

    def verify(signature: bytes) -> bool:
        raw = ffi.new("secp256k1_ecdsa_signature *")
        if not lib.secp256k1_ecdsa_signature_parse_compact(ctx, raw, signature):
            return False
        return bool(lib.secp256k1_ecdsa_verify(ctx, raw, hashlib.sha256(msg).digest(), pub))

    check("coincurve", "lib.secp256k1_ecdsa_signature_parse_compact / secp256k1_ecdsa_verify",
          "mst.crypto.PublicKey.verify", lambda: verify(sig[:64]) and not verify(sig[:63] + bytes([sig[63] ^ 1])))

    from mst.crypto import PrivateKey

    k = PrivateKey.generate_k256()
    assert k.public_key.verify(msg, k.sign(msg))  # the real users, together


# -- uvicorn: firehose.uvicorn_batch subclasses the sans-I/O WebSocket protocol and reads its state

def test_uvicorn_sansio_protocol_internals() -> None:
    import uvicorn

    base = check("uvicorn", "uvicorn.protocols.websockets.websockets_sansio_impl.WebSocketsSansIOProtocol",
                 "firehose.uvicorn_batch", lambda: attr("uvicorn.protocols.websockets.websockets_sansio_impl",
                                                        "WebSocketsSansIOProtocol"))
    check("uvicorn", "uvicorn.protocols.utils.ClientDisconnected", "firehose.uvicorn_batch",
          lambda: attr("uvicorn.protocols.utils", "ClientDisconnected"))
    check("uvicorn", "WebSocketsSansIOProtocol.handle_connect(event) and async send(message)",
          "firehose.uvicorn_batch", lambda: list(inspect.signature(base.handle_connect).parameters) == ["self", "event"]
          and inspect.iscoroutinefunction(base.send))
    check("uvicorn", "Config.setup_event_loop (replaced by relay.serve: the loop is already running)",
          "relay.serve", lambda: callable(uvicorn.Config.setup_event_loop))

    from uvicorn.server import ServerState

    from firehose.uvicorn_batch import BatchingWebSocketsProtocol

    async def app(scope: Any, receive: Any, send: Any) -> None:
        return None

    config = uvicorn.Config(app, ws=BatchingWebSocketsProtocol, lifespan="off")
    config.load()
    check("uvicorn", "Config(ws=<protocol class>)", "relay.serve",
          lambda: config.ws_protocol_class is BatchingWebSocketsProtocol)
    loop = asyncio.new_event_loop()
    try:
        proto = check("uvicorn", "WebSocketsSansIOProtocol(config, server_state, app_state, _loop)",
                      "firehose.uvicorn_batch", lambda: BatchingWebSocketsProtocol(config, ServerState(), {}, _loop=loop))
        for name, kind in [("writable", asyncio.Event), ("disconnected", bool), ("handshake_complete", bool),
                           ("close_sent", bool)]:
            check("uvicorn", f"protocol attribute {name} ({kind.__name__})", "firehose.uvicorn_batch.send",
                  lambda name=name, kind=kind: isinstance(getattr(proto, name), kind))
        check("uvicorn", "protocol attributes initial_response, transport", "firehose.uvicorn_batch.send",
              lambda: proto.initial_response is None and hasattr(proto, "transport"))
        check("uvicorn", "protocol.conn is websockets' ServerProtocol (send_binary, data_to_send)",
              "firehose.uvicorn_batch.send", lambda: callable(proto.conn.send_binary) and callable(proto.conn.data_to_send))
    finally:
        loop.close()


# -- uvicorn: relay.connection_limits subclasses the h11 HTTP protocol and hooks its request cycle

def test_uvicorn_h11_protocol_internals() -> None:
    import h11
    import uvicorn
    from uvicorn.server import ServerState

    base = check("uvicorn", "uvicorn.protocols.http.h11_impl.H11Protocol", "relay.connection_limits",
                 lambda: attr("uvicorn.protocols.http.h11_impl", "H11Protocol"))
    for name, params in [("connection_made", ["self", "transport"]), ("connection_lost", ["self", "exc"]),
                         ("data_received", ["self", "data"]), ("handle_events", ["self"]),
                         ("handle_websocket_upgrade", ["self", "event"]), ("on_response_complete", ["self"])]:
        check("uvicorn", f"H11Protocol.{name}({', '.join(params[1:])})", "relay.connection_limits",
              lambda name=name, params=params: list(inspect.signature(getattr(base, name)).parameters) == params)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        return None

    from relay.connection_limits import ConnectionLimits

    http, ws = ConnectionLimits(header_timeout=1, max_connections=1, max_websockets=1).protocols()
    config = uvicorn.Config(app, http=http, ws=ws, lifespan="off")
    config.load()
    check("uvicorn", "Config(http=<protocol class>, ws=<protocol class>)", "relay.serve.build_server",
          lambda: config.http_protocol_class is http and config.ws_protocol_class is ws)
    loop = asyncio.new_event_loop()
    try:
        proto = http(config, ServerState(), {}, _loop=loop)
        check("uvicorn", "H11Protocol attributes conn (h11.Connection), connections (set), loop, client, transport",
              "relay.connection_limits", lambda: isinstance(proto.conn, h11.Connection)
              and isinstance(proto.connections, set) and proto.loop is loop and hasattr(proto, "client")
              and hasattr(proto, "transport"))
    finally:
        loop.close()


# -- websockets: firehose.serve_websockets writes frames itself and waits like Connection.send

async def test_websockets_connection_internals() -> None:
    from websockets.asyncio.server import ServerConnection
    from websockets.protocol import Side, State
    from websockets.server import ServerProtocol

    protocol = ServerProtocol()
    for name in ("extensions", "side", "state", "expect_continuation_frame"):
        check("websockets", f"Protocol.{name}", "firehose.serve_websockets._write_binary_frames",
              lambda name=name: hasattr(protocol, name))
    check("websockets", "Protocol.side is Side.SERVER, Protocol.data_to_send()/send_binary()",
          "firehose.serve_websockets._write_binary_frames",
          lambda: protocol.side is Side.SERVER and callable(protocol.data_to_send) and callable(protocol.send_binary)
          and State.OPEN is not None)
    connection = ServerConnection(protocol, object())  # type: ignore[arg-type]  # the server is not used here
    check("websockets", "Connection.send_in_progress (None or a Future; 16.0+)", "firehose.serve_websockets._sender_of",
          lambda: hasattr(connection, "send_in_progress") and connection.send_in_progress is None)
    check("websockets", "Connection.send_context() (async context manager)", "firehose.serve_websockets._sender_of",
          lambda: hasattr(connection.send_context(), "__aenter__"))
