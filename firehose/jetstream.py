"""The Jetstream-compatible JSON stream: options, conversion, per-consumer selection (pure, no I/O).

The relay's verified events (``SequencedEvent``: the stored wire frame) become Jetstream messages,
one JSON object per WebSocket message, as Bluesky's Jetstream service sends them:

* ``#commit`` → one ``{"did", "time_us", "kind": "commit", "commit": {"rev", "operation",
  "collection", "rkey", "record", "cid"}}`` per op (``record``/``cid`` absent on deletes), the
  record converted to the atproto JSON data model (``$link``, ``$bytes``);
* ``#identity`` → ``{"did", "time_us", "kind": "identity", "identity": {"did", "handle", "seq", "time"}}``,
  ``handle`` always a string (``handle.invalid`` when the event has none: absent or unverified);
* ``#account`` → ``{"did", "time_us", "kind": "account", "account": {"active", "did", "seq", "time", "status"?}}``;
* ``#sync`` has no Jetstream form and is not sent (nor the session's own ``#info``).

``time_us`` is the event's sequencing time in unix microseconds (``SequencedEvent.time``): unique
per event and never decreasing along seq (``backfill.numbering``), so it is the stream's cursor;
the ops of one commit share it.

:class:`JetstreamConverter` converts each event once (an LRU by seq shared by every consumer) and
compresses each message at most once per dictionary (:class:`ZstdCodec`): Jetstream's own
dictionary (``LEGACY_DICTIONARY_PATH``, what ``compress=true`` means to every Jetstream client) and
the relay's ``current`` one (``DICTIONARY_PATH``, trained on simulated records; a client opts in
by its id, as with Jetstream's newer protocol);
:func:`select` picks, per consumer, the messages its :class:`JetstreamOptions` want.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cbrrr
import zstandard

from firehose.broadcast import ReplayStore
from firehose.frames import FrameError, decode_frame
from firehose.lru import BoundedLRU
from firehose.reasons import Reason
from firehose.state import SequencedEvent
from mst.car import read_car
from mst.errors import ReasonError
from mst.syntax import is_valid_did, is_valid_nsid

log = logging.getLogger(__name__)

MAX_WANTED_COLLECTIONS = 100
MAX_WANTED_DIDS = 10_000
#: Largest client (subscriber-sourced) message read, as Jetstream: 10 MB.
MAX_CLIENT_MESSAGE_BYTES = 10_000_000
#: Largest ``payload`` of a client heartbeat echoed back.
MAX_HEARTBEAT_PAYLOAD = 81
#: The relay's own dictionary, trained on simulated records (``bench/train_jetstream_dict.py``
#: regenerates it): offered by its id (``zstdDictionary=<id>``), never by ``compress=true``.
DICTIONARY_PATH = Path(__file__).with_name("jetstream_zstd.dict")
#: Jetstream's dictionary (id 1612007021), carried byte for byte: ``compress=true`` compresses with
#: it, since Jetstream clients bundle it (source and licence beside it, ``jetstream_dicts/README.md``).
LEGACY_DICTIONARY_PATH = Path(__file__).with_name("jetstream_dicts") / "legacy_subscribe.zdict"
LEGACY_DICTIONARY_ID = 1612007021
ZSTD_LEVEL = 3
#: What an identity message carries for a handle that is absent or did not verify (atproto handle spec).
INVALID_HANDLE = "handle.invalid"


class JetstreamOptionsError(ReasonError):
    """Bad subscriber options or a bad subscriber-sourced message (``reason`` is a ``Reason``)."""


@dataclass(frozen=True, slots=True)
class JetstreamOptions:
    """What one consumer wants. Empty ``collections`` and ``prefixes``: every collection; empty
    ``dids``: every account; ``max_message_bytes`` 0: no limit (compared with the bytes sent)."""

    collections: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()
    dids: frozenset[str] = frozenset()
    max_message_bytes: int = 0

    def wants_collection(self, collection: str | None) -> bool:
        """``None`` (identity and account messages) passes every collection filter."""
        if collection is None or (not self.collections and not self.prefixes):
            return True
        if collection in self.collections:
            return True
        return any(collection.startswith(p) for p in self.prefixes)


def parse_max_size(value: object) -> int:
    """``maxMessageSizeBytes``: an integer; negative means 0 (no limit), as in Jetstream."""
    if value is None or value == "":
        return 0
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise JetstreamOptionsError(Reason.JETSTREAM_BAD_MAX_SIZE, "maxMessageSizeBytes must be an integer")
    try:
        size = int(value)
    except ValueError:
        raise JetstreamOptionsError(Reason.JETSTREAM_BAD_MAX_SIZE, "maxMessageSizeBytes must be an integer") from None
    return max(0, min(size, 2**31 - 1))


def parse_options(collections: Sequence[object], dids: Sequence[object], max_size: object = None) -> JetstreamOptions:
    """Validate ``wantedCollections`` (NSIDs, or NSID prefixes ending ``.*``), ``wantedDids`` and
    ``maxMessageSizeBytes``; raises :class:`JetstreamOptionsError`."""
    exact: set[str] = set()
    prefixes: list[str] = []
    for c in collections:
        if not isinstance(c, str):
            raise JetstreamOptionsError(Reason.JETSTREAM_BAD_COLLECTION, "wantedCollections must be strings")
        if c.endswith(".*"):
            stem = c[:-2]
            # a whole-segment prefix: stem.a.a must be an NSID (so "app.*" and "app.bsky.*" pass)
            if not is_valid_nsid(stem + ".a.a"):
                raise JetstreamOptionsError(Reason.JETSTREAM_BAD_COLLECTION, f"invalid collection prefix {c[:120]!r}")
            if stem + "." not in prefixes:
                prefixes.append(stem + ".")
        elif is_valid_nsid(c):
            exact.add(c)
        else:
            raise JetstreamOptionsError(Reason.JETSTREAM_BAD_COLLECTION, f"invalid collection {c[:120]!r}")
    if len(exact) + len(prefixes) > MAX_WANTED_COLLECTIONS:
        raise JetstreamOptionsError(Reason.JETSTREAM_TOO_MANY_COLLECTIONS,
                                    f"at most {MAX_WANTED_COLLECTIONS} wantedCollections")
    wanted: set[str] = set()
    for d in dids:
        if not isinstance(d, str) or not is_valid_did(d):
            raise JetstreamOptionsError(Reason.JETSTREAM_BAD_DID, f"invalid DID {str(d)[:120]!r}")
        wanted.add(d)
    if len(wanted) > MAX_WANTED_DIDS:
        raise JetstreamOptionsError(Reason.JETSTREAM_TOO_MANY_DIDS, f"at most {MAX_WANTED_DIDS} wantedDids")
    return JetstreamOptions(frozenset(exact), tuple(sorted(prefixes, key=len)), frozenset(wanted),
                            parse_max_size(max_size))


@dataclass(frozen=True, slots=True)
class ClientMessage:
    """A subscriber-sourced message: ``options_update`` (with ``options``), ``heartbeat`` (with
    ``payload``) or any other ``type`` (ignored, as Jetstream does)."""

    type: str
    options: JetstreamOptions | None = None
    payload: str = ""


def _list_field(payload: dict[str, Any], name: str) -> list[object]:
    value = payload.get(name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise JetstreamOptionsError(Reason.JETSTREAM_BAD_MESSAGE, f"{name} must be an array")
    return value


def parse_client_message(data: str | bytes) -> ClientMessage:
    """Parse ``{"type": ..., "payload": ...}``; raises :class:`JetstreamOptionsError` (also for
    JSON nested deeper than the parser's recursion limit)."""
    if len(data) > MAX_CLIENT_MESSAGE_BYTES:
        raise JetstreamOptionsError(Reason.JETSTREAM_BAD_MESSAGE, "message too large")
    try:
        msg = json.loads(data)
    except ValueError:
        raise JetstreamOptionsError(Reason.JETSTREAM_BAD_MESSAGE, "message is not JSON") from None
    except RecursionError:  # deeper than the parser goes: refused like any other bad message
        raise JetstreamOptionsError(Reason.JETSTREAM_BAD_MESSAGE, "message is nested too deeply") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise JetstreamOptionsError(Reason.JETSTREAM_BAD_MESSAGE, "message must be an object with a type")
    kind = msg["type"]
    payload = msg.get("payload")
    if kind == "options_update":
        if not isinstance(payload, dict):
            raise JetstreamOptionsError(Reason.JETSTREAM_BAD_MESSAGE, "options_update needs an object payload")
        options = parse_options(_list_field(payload, "wantedCollections"), _list_field(payload, "wantedDids"),
                                payload.get("maxMessageSizeBytes"))
        return ClientMessage(kind, options=options)
    if kind == "heartbeat":
        text = payload if isinstance(payload, str) else ""
        if len(text.encode()) > MAX_HEARTBEAT_PAYLOAD:
            raise JetstreamOptionsError(Reason.JETSTREAM_BAD_MESSAGE, "heartbeat payload too long")
        return ClientMessage(kind, payload=text)
    return ClientMessage(kind)


def heartbeat_message(payload: str) -> bytes:
    return _dumps({"kind": "heartbeat", "payload": payload})


# -- conversion ---------------------------------------------------------------------------------


@dataclass(slots=True)
class JetMessage:
    """One JSON message. ``collection`` is None for identity/account messages."""

    collection: str | None
    data: bytes
    zstd: dict[int, bytes] | None = None  # dictionary id → the compressed message


@dataclass(slots=True)
class JetEvent:
    """The messages of one sequenced event (none for kinds Jetstream does not carry)."""

    seq: int
    did: str
    time_us: int
    messages: tuple[JetMessage, ...] = ()
    #: bytes of its messages and of their compressed forms (what it costs in the converter's cache)
    size: int = 0


def time_us(ev: SequencedEvent) -> int:
    return round(ev.time * 1_000_000)


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def commit_message(did: str, at_us: int, rev: str, operation: str, collection: str, rkey: str,
                   record: object = None, cid: str | None = None) -> bytes:
    """One commit message (``record`` already in the JSON data model; omitted with its ``cid`` on deletes)."""
    commit: dict[str, Any] = {"rev": rev, "operation": operation, "collection": collection, "rkey": rkey}
    if operation != "delete":
        commit["record"] = record
        commit["cid"] = cid
    return _dumps({"did": did, "time_us": at_us, "kind": "commit", "commit": commit})


def _commit_messages(did: str, at_us: int, body: dict[str, Any]) -> tuple[JetMessage, ...]:
    rev = body["rev"]
    blocks = read_car(body["blocks"]).blocks if body.get("blocks") else {}
    out: list[JetMessage] = []
    for op in body.get("ops") or ():
        collection, _, rkey = str(op["path"]).partition("/")
        action = op["action"]
        if action == "delete":
            out.append(JetMessage(collection, commit_message(did, at_us, rev, action, collection, rkey)))
            continue
        cid = op.get("cid")
        block = blocks.get(cid) if cid is not None else None
        if block is None:
            continue  # a verified commit carries every new record; nothing to say without it
        record = cbrrr.decode_dag_cbor(bytes(block), atjson_mode=True)
        out.append(JetMessage(collection, commit_message(did, at_us, rev, action, collection, rkey,
                                                         record, cid.encode())))
    return tuple(out)


def _status_message(kind: str, did: str, at_us: int, body: dict[str, Any]) -> tuple[JetMessage, ...]:
    inner = {k: v for k, v in body.items() if isinstance(v, str | int | bool) and not isinstance(v, float)}
    inner.setdefault("did", did)
    if kind == "identity" and not isinstance(inner.get("handle"), str):
        # Jetstream clients require a string handle; an unverified or absent one is the handle
        # spec's "handle.invalid" (the CBOR #identity leaves it out, as the sync spec says)
        inner["handle"] = INVALID_HANDLE
    return (JetMessage(None, _dumps({"did": did, "time_us": at_us, "kind": kind, kind: inner})),)


def convert(ev: SequencedEvent) -> JetEvent:
    """The Jetstream messages of one stored event; raises ``ReasonError`` for an undecodable frame."""
    at_us = time_us(ev)
    out = JetEvent(ev.seq, ev.did, at_us)
    if ev.kind not in ("#commit", "#identity", "#account"):
        return out
    frame = decode_frame(ev.frame, strict=False)
    body = frame.body
    if ev.kind == "#commit":
        out.messages = _commit_messages(ev.did, at_us, body)
    else:
        out.messages = _status_message(ev.kind[1:], ev.did, at_us, body)
    return out


class ZstdCodec:
    """zstd with one dictionary: every message is its own zstd frame (dictionary id included)."""

    def __init__(self, dictionary: bytes, level: int = ZSTD_LEVEL) -> None:
        self.dictionary = dictionary
        self.dict_data = zstandard.ZstdCompressionDict(dictionary)
        self.dict_id = self.dict_data.dict_id()
        self.dict_data.precompute_compress(level=level)
        self._compressor = zstandard.ZstdCompressor(dict_data=self.dict_data, write_checksum=False)

    @classmethod
    def default(cls) -> ZstdCodec:
        """The relay's own dictionary (the opt-in ``current`` one)."""
        return cls(DICTIONARY_PATH.read_bytes())

    @classmethod
    def legacy(cls) -> ZstdCodec:
        """Jetstream's dictionary (``compress=true``)."""
        return cls(LEGACY_DICTIONARY_PATH.read_bytes())

    def compress(self, data: bytes) -> bytes:
        return self._compressor.compress(data)

    def decompressor(self) -> zstandard.ZstdDecompressor:
        return zstandard.ZstdDecompressor(dict_data=zstandard.ZstdCompressionDict(self.dictionary))


@dataclass(slots=True)
class ConverterStats:
    converted: int = 0
    cache_hits: int = 0
    failed: int = 0
    compressed: int = 0


#: Default bound of the converter's cache (``JetstreamConverter(cache_bytes=)``).
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024


class JetstreamConverter:
    """Converts events once for all consumers (LRU by seq) and compresses messages lazily, once
    per dictionary. ``codec``: what ``compress=true`` uses; ``current``: the dictionary served when
    none is asked for by id (default: ``codec``); both can be asked for by id. The cache holds at
    most ``cache_size`` events and ``cache_bytes`` bytes of messages (plain and compressed, counted
    as each is made); the least recently used go first. One event larger than the whole bound is
    converted for the batch at hand and not kept."""

    def __init__(self, codec: ZstdCodec, current: ZstdCodec | None = None, cache_size: int = 20_000,
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.codec = codec
        self.current = current or codec
        self.codecs = {c.dict_id: c for c in (codec, self.current)}
        self.cache_bytes = cache_bytes
        self._cache: BoundedLRU[int, JetEvent] = BoundedLRU(cache_size)
        self._cached_bytes = 0
        self.stats = ConverterStats()

    @property
    def cached_bytes(self) -> int:
        """Bytes of the messages (and compressed forms) the cache holds now."""
        return self._cached_bytes

    def _make_room(self, more: int) -> None:
        cache = self._cache
        while cache and (len(cache) >= cache.maxsize or self._cached_bytes + more > self.cache_bytes):
            oldest = cache.pop(next(iter(cache)))
            assert oldest is not None
            self._cached_bytes -= oldest.size

    def _grew(self, event: JetEvent, n: int) -> None:
        """``event`` (cached or not) got ``n`` more bytes of compressed messages."""
        event.size += n
        if self._cache.peek(event.seq) is event:
            self._cache.pop(event.seq)  # kept out while room is made, so it is not evicted itself
            self._cached_bytes -= event.size - n
            self._cache_put(event)

    def _cache_put(self, event: JetEvent) -> None:
        if event.size > self.cache_bytes or not self._cache.maxsize:
            return
        self._make_room(event.size)
        self._cache.put(event.seq, event)
        self._cached_bytes += event.size

    def event(self, ev: SequencedEvent) -> JetEvent:
        got = self._cache.get(ev.seq)
        if got is not None:
            self.stats.cache_hits += 1
            return got
        try:
            got = convert(ev)
        except (ReasonError, FrameError, KeyError, TypeError, ValueError, cbrrr.CbrrrDecodeError) as exc:
            # a stored frame is the relay's own verified output; count it and send nothing for it
            self.stats.failed += 1
            log.warning("jetstream: event not converted", extra={"fields": {"seq": ev.seq, "error": repr(exc)[:200]}})
            got = JetEvent(ev.seq, ev.did, time_us(ev))
        self.stats.converted += 1
        got.size = sum(len(m.data) for m in got.messages)
        self._cache_put(got)
        return got

    def zstd(self, msg: JetMessage, dict_id: int | None = None, event: JetEvent | None = None) -> bytes:
        """``msg`` (one of ``event``'s messages, whose cache cost grows by a new compressed form)
        compressed with the dictionary ``dict_id`` (one of :attr:`codecs`; None: :attr:`codec`),
        made once."""
        codec = self.codec if dict_id is None else self.codecs[dict_id]
        done = msg.zstd
        if done is None:
            done = msg.zstd = {}
        data = done.get(codec.dict_id)
        if data is None:
            data = done[codec.dict_id] = codec.compress(msg.data)
            self.stats.compressed += 1
            if event is not None:
                self._grew(event, len(data))
        return data


@dataclass(slots=True)
class Selection:
    """What one consumer is sent from a batch: ``messages`` in order, and the last ``time_us``."""

    messages: list[bytes] = field(default_factory=list)
    bytes: int = 0


def select(converter: JetstreamConverter, events: Iterable[SequencedEvent], options: JetstreamOptions,
           dict_id: int | None) -> Selection:
    """The messages ``options`` want from ``events`` (ascending seq), compressed with the
    dictionary ``dict_id`` (one of ``converter.codecs``) or, for None, not compressed."""
    out = Selection()
    dids = options.dids
    limit = options.max_message_bytes
    for ev in events:
        if dids and ev.did not in dids:
            continue
        jet = converter.event(ev)
        for msg in jet.messages:
            if not options.wants_collection(msg.collection):
                continue
            data = msg.data if dict_id is None else converter.zstd(msg, dict_id, jet)
            if limit and len(data) > limit:
                continue
            out.messages.append(data)
            out.bytes += len(data)
    return out


async def seq_for_time(store: ReplayStore, at_us: int) -> int:
    """The replay cursor (a seq, for ``Broadcaster.session``, whose cursors are exclusive) of a
    time cursor: the seq just before the first stored event with ``time_us >= at_us`` (times never
    decrease along seq, so a binary search over seq, one single-event read per step); ``latest``
    when there is none yet (live from now, no gap); ``oldest - 1`` (the whole window, no
    ``OutdatedCursor``) when ``at_us`` is older than the window."""
    latest = await store.latest_seq() or 0
    oldest = await store.oldest_seq()
    if oldest is None:
        return latest
    lo, hi = oldest, latest + 1
    while lo < hi:
        mid = (lo + hi) // 2
        found = await store.read_after(mid - 1, 1)
        if not found:  # trimmed from under us or nothing at/after mid: the answer is at most mid
            hi = mid
        elif time_us(found[0]) >= at_us:
            hi = mid
        else:
            lo = found[0].seq + 1
    return lo - 1
