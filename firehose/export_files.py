"""An export written by ``relay spark export``, read for a bootstrap (``firehose.bootstrap``):
the manifest, each file checked against its size and SHA-256, the snapshot's rows as changes.

``ExportSource(location)`` reads a local directory, any URI ``pyarrow.fs`` opens (``s3://…``,
``gs://…``, ``file://…``) or an ``http(s)://`` base URL (a static file server; a broken download
resumes with a ``Range`` request). Nothing of a file is used before ``check_file`` passed.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from mst.errors import ReasonError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "atproto-relay-export/1"


class BootstrapError(ReasonError):
    """The bootstrap cannot go on; ``reason`` is snake_case, the message tells the user what to do."""

    show_reason = False


@dataclass(frozen=True, slots=True)
class Change:
    """One change to the index. ``kind``: ``put`` (create or update; ``record`` is atproto JSON
    text), ``delete``, ``reset`` (drop every record of ``did``), ``status`` (``active``/``status``)."""

    kind: str
    did: str
    collection: str = ""
    rkey: str = ""
    cid: str | None = None
    record: str | None = None
    rev: str | None = None
    active: bool = True
    status: str | None = None


@dataclass(slots=True)
class Batch:
    """Changes to apply together; ``seq``: the stream position they bring the index to (None for
    snapshot rows, the cutover for the ``live`` batch)."""

    seq: int | None
    changes: list[Change] = field(default_factory=list)
    live: bool = False
    #: a stream event's account and that account's rev once the batch is applied (keep it: it is
    #: what ``account_revs`` gives back on resume)
    did: str | None = None
    rev: str | None = None


class ExportSource:
    """An export's files, wherever they are, each checked against the manifest before use."""

    def __init__(self, location: str, *, timeout: float = 30.0, work_dir: str | None = None,
                 filesystem: Any = None) -> None:
        """``filesystem``: a ``pyarrow.fs.FileSystem`` to read ``location`` (a path in it) from,
        instead of the one the location names."""
        self.location = location.rstrip("/")
        self.timeout = timeout
        self.http = filesystem is None and self.location.startswith(("http://", "https://"))
        self._fs: Any = filesystem
        self._root = self.location
        if not self.http and filesystem is None:
            import pyarrow.fs as pafs

            if "://" in self.location:
                self._fs, self._root = pafs.FileSystem.from_uri(self.location)
            else:
                self._fs, self._root = pafs.LocalFileSystem(), os.path.abspath(self.location)
        self._tmp = tempfile.TemporaryDirectory(prefix="bootstrap-", dir=work_dir)

    def close(self) -> None:
        self._tmp.cleanup()

    async def manifest(self) -> dict[str, Any]:
        """The manifest, checked for the fields the bootstrap needs."""
        try:
            if self.http:
                async with httpx.AsyncClient(timeout=self.timeout, follow_redirects=True) as client:
                    resp = await client.get(f"{self.location}/{MANIFEST}")
                    resp.raise_for_status()
                    text = resp.text
            else:
                with self._fs.open_input_stream(f"{self._root}/{MANIFEST}") as f:
                    text = f.read().decode()
            value = json.loads(text)
        except (OSError, ValueError, httpx.HTTPError) as exc:
            raise BootstrapError("bad_manifest", f"cannot read {self.location}/{MANIFEST}: {exc}") from None
        if not isinstance(value, dict) or value.get("format") != FORMAT or not isinstance(value.get("cursor"), int):
            raise BootstrapError("bad_manifest", f"{self.location}/{MANIFEST} is not a {FORMAT} manifest")
        if not isinstance(value.get("files"), list) or not isinstance(value.get("repos"), dict):
            raise BootstrapError("bad_manifest", "the manifest lists no file sizes and checksums: take a newer "
                                                 "export (relay spark export)")
        return value

    async def local_file(self, entry: Mapping[str, Any]) -> str:
        """A local path holding the file of manifest ``entry``, its size and SHA-256 checked."""
        rel = str(entry["path"])
        if rel.startswith("/") or ".." in rel.split("/"):
            raise BootstrapError("bad_manifest", f"bad file path {rel!r}")
        if self.http:
            path = os.path.join(self._tmp.name, rel.replace("/", "_"))
            await self._download(f"{self.location}/{rel}", path, int(entry["bytes"]))
        elif self._fs.type_name == "local":
            path = f"{self._root}/{rel}"
        else:
            path = os.path.join(self._tmp.name, rel.replace("/", "_"))
            await asyncio.to_thread(self._copy, f"{self._root}/{rel}", path)
        await asyncio.to_thread(check_file, path, entry)
        return path

    def _copy(self, source: str, target: str) -> None:
        with self._fs.open_input_stream(source) as f, open(target, "wb") as out:
            while chunk := f.read(1 << 20):
                out.write(chunk)

    async def _download(self, url: str, path: str, size: int, attempts: int = 5) -> None:
        """GET ``url`` into ``path``, resuming with ``Range`` after a broken transfer."""
        open(path, "wb").close()
        async with httpx.AsyncClient(timeout=self.timeout, follow_redirects=True) as client:
            for attempt in range(attempts):
                have = os.path.getsize(path)
                if have >= size:
                    return
                headers = {"range": f"bytes={have}-"} if have else {}
                try:
                    async with client.stream("GET", url, headers=headers) as resp:
                        if resp.status_code not in (200, 206):
                            raise BootstrapError("unreadable", f"{url}: HTTP {resp.status_code}")
                        mode = "ab" if resp.status_code == 206 else "wb"
                        with open(path, mode) as out:
                            async for chunk in resp.aiter_bytes():
                                out.write(chunk)
                except httpx.HTTPError as exc:
                    log.info("download interrupted, resuming: %s", type(exc).__name__)
                    await asyncio.sleep(min(5.0, 0.2 * 2 ** attempt))
        if os.path.getsize(path) < size:
            raise BootstrapError("unreadable", f"{url}: could not download all {size} bytes")


def check_file(path: str, entry: Mapping[str, Any]) -> None:
    """Raise ``BootstrapError`` unless the file has the manifest entry's size and SHA-256."""
    size = os.path.getsize(path)
    if size != int(entry["bytes"]):
        raise BootstrapError("size_mismatch", f"{entry['path']}: {size} bytes, the manifest says {entry['bytes']}")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != entry["sha256"]:
        raise BootstrapError("checksum_mismatch", f"{entry['path']}: SHA-256 differs from the manifest's")


def snapshot_rows(path: str, collection: str, record_format: str, batch_rows: int = 4096) -> Iterator[list[Change]]:
    """The ``put`` changes of one record file, in batches."""
    import pyarrow.parquet as pq

    for rb in pq.ParquetFile(path).iter_batches(batch_size=batch_rows, columns=["did", "rkey", "cid", "rev", "record"]):
        cols = rb.to_pydict()
        records = cols["record"]
        if record_format != "json":
            records = [record_json_of(raw) for raw in records]
        yield [Change("put", did, collection, rkey, cid, record, rev)
               for did, rkey, cid, rev, record in zip(cols["did"], cols["rkey"], cols["cid"], cols["rev"], records,
                                                      strict=True)]


def _special(obj: Any) -> dict[str, str]:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"$bytes": base64.b64encode(bytes(obj)).decode("ascii").rstrip("=")}
    encode = getattr(obj, "encode", None)
    if callable(encode) and not isinstance(obj, str):
        return {"$link": str(encode())}
    raise TypeError(f"not a data-model value: {type(obj).__name__}")


def record_json_of(raw: bytes) -> str:
    """A record block as atproto JSON text (sorted keys, compact; ``$link``/``$bytes``)."""
    from mst.cbor import decode

    return json.dumps(decode(raw), sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_special)


