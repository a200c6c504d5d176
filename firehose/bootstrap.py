"""Snapshot → live, exactly once: an appview starts from an export and goes on with the stream.

    async for batch in Bootstrap("exports/2026-11-26", "http://relay:2470", ["app.bsky.feed.post"]):
        apply(batch.changes)              # in one transaction with ...
        if batch.seq is not None:
            save_cursor(batch.seq)        # ... the stream position it brings the index to

The export is what ``relay spark export`` writes (read by ``firehose.export_files``): ``manifest.json`` (the cutover ``cursor``, every
file with its size and SHA-256) and the Parquet records partitioned by collection, plus
``records/_repos.parquet`` (every exported repository and the rev it was exported at). It is read
from a local directory, from any URI ``pyarrow.fs`` opens (``s3://…``, ``gs://…``, ``file://…``),
or from an ``http(s)://`` base URL (any static file server: ``python -m http.server`` in the export
directory will do; downloads resume with ``Range`` requests). Every file is checked against the
manifest's size and SHA-256 before a row of it is used (``BootstrapError`` ``size_mismatch`` /
``checksum_mismatch``).

What is yielded — ``Batch(seq, changes)``, each to be applied atomically:

1. the snapshot: ``put`` changes of the wanted collections (``seq`` None), then one empty batch
   with ``seq`` = the cutover cursor (``live`` set): the index now stands at the cutover;
2. the stream from the cutover (``cursor=N`` asks for the events after ``N``; any event at or
   below the position is dropped whatever the relay's cursor rule), one batch per event carrying
   its ``seq``. Per account, a ``#commit`` whose ``rev`` is not newer than the account's rev as the
   index holds it (the snapshot's, or a later change's) is already in the index and yields
   nothing: no duplicate. Its ops become ``put`` / ``delete`` changes; ``#account`` a ``status``
   change; ``#identity`` nothing.
3. an account whose records the index does not hold from the snapshot (created since, inactive
   or unverifiable at export time) is fetched whole with ``getRepo`` (through the relay, which
   redirects to the account's host or serves it) on its first ``#commit`` or on its reactivation:
   a ``reset`` change (drop every record of the account) followed by its records as ``put``s;
   so is an account whose ``#sync`` says its repository was replaced, or whose commit's blocks are
   incomplete (``tooBig``).

Per-account order is the stream's. Resuming after a restart: ``Bootstrap(…, resume=seq,
account_revs=…)`` (the last applied batch's seq and each account's rev as the index holds them)
skips the snapshot and goes on from ``seq``.

A cutover older than the relay's window (the relay answers ``OutdatedCursor``), a gap later on, or
a cursor ahead of the relay (``FutureCursor``: the relay lost its history) raises
``BootstrapError`` (``cutover_too_old`` / ``future_cursor``) telling the user to take a newer
export: records changed in the gap could not be known. The window is checked before the
snapshot is read, and again when the stream starts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import httpx
from websockets.asyncio.client import connect

from firehose.consumer import RelayConsumer
from firehose.export_files import (
    Batch,
    BootstrapError,
    Change,
    ExportSource,
    record_json_of,
    snapshot_rows,
)
from firehose.frames import FrameError, decode_frame

__all__ = ["Batch", "Bootstrap", "BootstrapError", "Change", "ExportSource", "commit_changes"]

log = logging.getLogger(__name__)

SUBSCRIBE = "/xrpc/com.atproto.sync.subscribeRepos"
GET_REPO = "/xrpc/com.atproto.sync.getRepo"


def commit_changes(body: Mapping[str, Any]) -> list[Change] | None:
    """The changes of a ``#commit``, or None when its blocks do not carry every record it
    creates or updates (the account must be fetched whole)."""
    from mst.car import read_car
    from mst.cid import cid_str

    did, rev = str(body["repo"]), str(body["rev"])
    if body.get("tooBig"):
        return None
    try:
        blocks = {cid_str(c): raw for c, raw in read_car(bytes(body.get("blocks") or b"")).blocks.items()}
    except Exception:  # noqa: BLE001 - an unreadable slice: fetch the account instead
        return None
    out: list[Change] = []
    for op in body.get("ops") or []:
        collection, _, rkey = str(op.get("path", "")).partition("/")
        if op.get("action") == "delete":
            out.append(Change("delete", did, collection, rkey, rev=rev))
            continue
        cid = op.get("cid")
        cid_text = cid_str(cid) if cid is not None and not isinstance(cid, str) else cid
        raw = blocks.get(cid_text) if isinstance(cid_text, str) else None
        if raw is None:
            return None
        out.append(Change("put", did, collection, rkey, cid_text, record_json_of(bytes(raw)), rev))
    return out


class Bootstrap:
    """See the module docstring. ``collections``: the NSIDs wanted (None: all); ``filesystem``: a
    ``pyarrow.fs.FileSystem`` holding the export at the path ``export``."""

    def __init__(self, export: str, relay: str, collections: Iterable[str] | None = None, *,
                 resume: int | None = None, account_revs: Mapping[str, str] | None = None,
                 timeout: float = 30.0, window_probe: float = 2.0, filesystem: Any = None) -> None:
        self.source = ExportSource(export, timeout=timeout, filesystem=filesystem)
        self.relay = relay.rstrip("/")
        self.collections = frozenset(collections) if collections else None
        self.resume = resume
        self.timeout = timeout
        self.window_probe = window_probe
        #: did -> the rev of the account's records as the index holds them
        self.revs: dict[str, str] = dict(account_revs or {})
        self.manifest: dict[str, Any] = {}
        #: counts: snapshot rows yielded, live events, commits skipped as already held, fetches
        self.stats = {"snapshot_rows": 0, "events": 0, "duplicates_skipped": 0, "repos_fetched": 0}

    @property
    def ws_url(self) -> str:
        base = self.relay.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
        return base + SUBSCRIBE

    def _wanted(self, collection: str) -> bool:
        return self.collections is None or collection in self.collections

    async def __aiter__(self) -> AsyncIterator[Batch]:
        try:
            self.manifest = await self.source.manifest()
            cutover = int(self.manifest["cursor"])
            start = cutover if self.resume is None else self.resume
            await self.check_window(start)
            await self._load_revs()
            if self.resume is None:
                async for batch in self.snapshot():
                    yield batch
                yield Batch(cutover, live=True)
            async for batch in self.live(start):
                yield batch
        finally:
            self.source.close()

    async def check_window(self, cursor: int) -> None:
        """Refuse (``BootstrapError``) a cursor the relay no longer holds, or one ahead of it."""
        try:
            async with connect(f"{self.ws_url}?cursor={cursor}", open_timeout=self.timeout, max_size=None) as ws:
                try:
                    raw = await asyncio.wait_for(ws.recv(), self.window_probe)
                except TimeoutError:
                    return  # nothing to replay: the relay is at the cutover
        except OSError as exc:
            raise BootstrapError("relay_unreachable", f"cannot reach {self.ws_url}: {exc}") from None
        if isinstance(raw, bytes):
            self._refuse(raw, cursor)

    def _refuse(self, raw: bytes, cursor: int) -> None:
        try:
            frame = decode_frame(raw)
        except FrameError:
            return
        if frame.is_error and frame.body.get("error") == "FutureCursor":
            raise BootstrapError("future_cursor", f"the relay has no event after {cursor} (it lost its history?): "
                                                  "take a newer export")
        if frame.t == "#info" and frame.body.get("name") == "OutdatedCursor":
            raise BootstrapError("cutover_too_old", f"the export's cutover {cursor} is older than the relay's "
                                                    "replay window: take a newer export")

    async def _load_revs(self) -> None:
        """Each exported account's rev (``records/_repos.parquet``), unless the index holds a later one."""
        import pyarrow.parquet as pq

        repos = await self.source.local_file(self.manifest["repos"])
        table = pq.read_table(repos, columns=["did", "rev"]).to_pydict()
        for did, rev in zip(table["did"], table["rev"], strict=True):
            if rev > self.revs.get(did, ""):
                self.revs[did] = rev

    async def snapshot(self) -> AsyncIterator[Batch]:
        """The export's rows of the wanted collections (every file checked first)."""
        fmt = str(self.manifest.get("record_format") or "json")
        for entry in self.manifest["files"]:
            collection = entry.get("collection")
            if not isinstance(collection, str) or not self._wanted(collection):
                continue
            path = await self.source.local_file(entry)
            for changes in snapshot_rows(path, collection, fmt):
                self.stats["snapshot_rows"] += len(changes)
                yield Batch(None, changes)

    async def live(self, cursor: int) -> AsyncIterator[Batch]:
        """The stream after ``cursor``, deduplicated against the index's per-account revs."""
        consumer = RelayConsumer(self.ws_url, cursor=cursor)
        async with httpx.AsyncClient(timeout=self.timeout, follow_redirects=True) as http:
            async for ev in consumer:
                if ev.kind == "gap":
                    raise BootstrapError("cutover_too_old", f"the relay's replay window no longer holds the "
                                                            f"events after {cursor}: take a newer export")
                if ev.kind == "future_cursor":
                    raise BootstrapError("future_cursor", "the relay lost the events this index has applied: "
                                                          "take a newer export")
                consumer.done(ev)
                if ev.seq <= cursor or ev.did is None:
                    continue
                cursor = ev.seq
                self.stats["events"] += 1
                changes = await self._changes(http, ev.kind, ev.did, ev.body)
                yield Batch(ev.seq, changes, did=ev.did, rev=self.revs.get(ev.did))

    async def _changes(self, http: httpx.AsyncClient, kind: str, did: str, body: Mapping[str, Any]) -> list[Change]:
        held = self.revs.get(did)
        if kind == "#account":
            active = body.get("active") is not False
            status = body.get("status") if isinstance(body.get("status"), str) else None
            out = [Change("status", did, active=active, status=None if active else status or "deactivated")]
            if active and held is None:
                out += await self._fetch(http, did)
            return out
        if kind not in ("#commit", "#sync"):
            return []
        rev = str(body.get("rev", ""))
        if held is not None and rev <= held:
            self.stats["duplicates_skipped"] += 1
            return []
        changes = commit_changes(body) if kind == "#commit" and held is not None else None
        if changes is None:
            return await self._fetch(http, did)
        self.revs[did] = rev
        return [c for c in changes if self._wanted(c.collection)]

    async def _fetch(self, http: httpx.AsyncClient, did: str) -> list[Change]:
        """The account's whole repository from ``getRepo``: a ``reset`` and its records. An
        account the host will not serve (inactive, gone) yields a ``reset`` alone."""
        from mst.cid import cid_str
        from mst.verify import verify_repo_car

        self.stats["repos_fetched"] += 1
        try:
            resp = await http.get(self.relay + GET_REPO, params={"did": did})
        except httpx.HTTPError as exc:
            raise BootstrapError("relay_unreachable", f"getRepo {did}: {type(exc).__name__}") from None
        if resp.status_code != 200:
            log.info("getRepo %s: HTTP %s", did, resp.status_code)
            return [Change("reset", did)]
        repo = verify_repo_car(resp.content, did, None)
        rev = repo.commit.rev
        self.revs[did] = rev
        out = [Change("reset", did, rev=rev)]
        for path, cid in sorted(repo.records.items()):
            collection, _, rkey = path.partition("/")
            if self._wanted(collection):
                out.append(Change("put", did, collection, rkey, cid_str(cid), record_json_of(repo.blocks[cid]), rev))
        return out
