"""`relay bootstrap`'s SQLite fold (``relay.bootstrap_cli.SqliteIndex``): changes applied in
order, the position kept with them, a half-done snapshot started over. (The end-to-end run
against Spark and a live relay is ``tests/spark/test_bootstrap.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from firehose.bootstrap import Batch, Change, commit_changes, record_json_of
from mst.car import write_car
from mst.cbor import encode
from mst.cid import cid_for_cbor, cid_str
from relay import cli
from relay.bootstrap_cli import SqliteIndex


def put(did: str, rkey: str, cid: str = "bafy", rev: str = "1") -> Change:
    return Change("put", did, "app.bsky.feed.post", rkey, cid, "{}", rev)


def test_fold_applies_changes_and_keeps_the_position(tmp_path: Path) -> None:
    path = str(tmp_path / "index.sqlite")
    index = SqliteIndex(path)
    assert index.resume_point() == (None, {})
    index.apply(Batch(None, [put("did:a", "1"), put("did:a", "2"), put("did:b", "1")]))
    index.apply(Batch(10, live=True))
    index.apply(Batch(11, [Change("delete", "did:a", "app.bsky.feed.post", "1", rev="2")], did="did:a", rev="2"))
    index.apply(Batch(12, [Change("reset", "did:b", rev="5"), put("did:b", "9", rev="5")], did="did:b", rev="5"))
    index.apply(Batch(13, [Change("status", "did:a", active=False, status="deactivated")], did="did:a", rev="2"))
    assert index.index() == {("did:b", "app.bsky.feed.post", "9", "bafy")}  # did:a is inactive
    index.close()

    again = SqliteIndex(path)
    assert again.resume_point() == (13, {"did:a": "2", "did:b": "5"})
    again.close()


def test_a_snapshot_stopped_half_way_starts_over(tmp_path: Path) -> None:
    path = str(tmp_path / "index.sqlite")
    index = SqliteIndex(path)
    for i in range(60):  # more than one snapshot transaction, never the live batch
        index.apply(Batch(None, [put("did:a", str(i))]))
    index.close()
    again = SqliteIndex(path)
    assert again.resume_point() == (None, {})
    assert again.index() == set()
    again.close()


def test_commit_ops_become_changes_and_an_incomplete_slice_asks_for_the_repo() -> None:
    record = {"$type": "app.bsky.feed.post", "text": "hi", "createdAt": "2026-01-01T00:00:00Z"}
    block = encode(record)
    cid = cid_for_cbor(block)
    body = {"repo": "did:a", "rev": "3", "blocks": write_car([cid], [(cid, block)]),
            "ops": [{"action": "create", "path": "app.bsky.feed.post/1", "cid": cid},
                    {"action": "delete", "path": "app.bsky.feed.post/0", "cid": None}]}
    changes = commit_changes(body)
    assert changes == [Change("put", "did:a", "app.bsky.feed.post", "1", cid_str(cid), record_json_of(block), "3"),
                       Change("delete", "did:a", "app.bsky.feed.post", "0", rev="3")]
    assert commit_changes({**body, "blocks": write_car([cid], [])}) is None
    assert commit_changes({**body, "tooBig": True}) is None


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bootstrap", "--help"])
    assert exit_.value.code == 0
    assert "--export" in capsys.readouterr().out


async def test_an_interrupted_download_resumes_with_a_range_request_and_is_checked(tmp_path: Path) -> None:
    """An export served over HTTP: the first answer breaks off half-way, the library asks for the
    rest with ``Range`` and checks the whole file's size and SHA-256 against the manifest."""
    import hashlib

    from starlette.types import Receive, Scope, Send

    from firehose.bootstrap import BootstrapError, ExportSource
    from tests.relay.helpers import serve_asgi

    data = bytes(range(256)) * 400
    ranges: list[str | None] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        headers = dict(scope["headers"])
        asked = headers.get(b"range")
        ranges.append(asked.decode() if asked else None)
        if asked is None:  # the whole file announced, half of it sent, then the connection breaks
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data[: len(data) // 2], "more_body": True})
            raise RuntimeError("connection lost")
        start = int(asked.decode().removeprefix("bytes=").rstrip("-"))
        await send({"type": "http.response.start", "status": 206,
                    "headers": [(b"content-length", str(len(data) - start).encode())]})
        await send({"type": "http.response.body", "body": data[start:]})

    entry = {"path": "records/x.parquet", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    async with serve_asgi(app) as url:
        source = ExportSource(url, work_dir=str(tmp_path))
        try:
            path = await source.local_file(entry)
            assert Path(path).read_bytes() == data
            assert ranges == [None, f"bytes={len(data) // 2}-"]
            with pytest.raises(BootstrapError) as wrong:
                await source.local_file({**entry, "sha256": "0" * 64})
            assert wrong.value.reason == "checksum_mismatch"
        finally:
            source.close()


@pytest.mark.parametrize("how", ["uri", "filesystem"])
async def test_an_export_is_read_from_any_pyarrow_filesystem(tmp_path: Path, how: str) -> None:
    """A ``file://`` URI (pyarrow's local filesystem, read in place) or a filesystem object of
    another type (here a ``SubTreeFileSystem``: copied to a local file first); either way a file is
    checked against the manifest before it is used."""
    import hashlib
    import json

    import pyarrow.fs as pafs

    from firehose.bootstrap import BootstrapError, ExportSource

    export = tmp_path / "export"
    (export / "records").mkdir(parents=True)
    data = b"not really parquet, but bytes to check" * 100
    (export / "records" / "_repos.parquet").write_bytes(data)
    entry = {"path": "records/_repos.parquet", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"format": "atproto-relay-export/1", "cursor": 7, "files": [], "repos": entry}
    (export / "manifest.json").write_text(json.dumps(manifest))
    if how == "uri":
        source = ExportSource(f"file://{export}", work_dir=str(tmp_path))
    else:
        source = ExportSource("export", work_dir=str(tmp_path),
                              filesystem=pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem()))
    try:
        assert (await source.manifest())["cursor"] == 7
        path = await source.local_file(entry)
        assert Path(path).read_bytes() == data
        assert (Path(path).parent == export / "records") == (how == "uri")
        (export / "records" / "_repos.parquet").write_bytes(data[:-1] + b"!")
        with pytest.raises(BootstrapError) as changed:
            await source.local_file(entry)
        assert changed.value.reason == "checksum_mismatch"
    finally:
        source.close()
