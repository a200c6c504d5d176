"""An appview bootstraps from an export and goes live, exactly once (``firehose.bootstrap`` and the
``relay bootstrap`` SQLite fold): the export is taken by Spark (local mode) from a running relay
while the simulator keeps committing (creates, updates, deletes, deactivations and
reactivations), the index is folded from it and from the stream, and once the relay has passed
the simulator's last commits the index holds exactly the simulator's records of the wanted
collections — also when the relay restarts during the live part."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import json
import socket
import sqlite3
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import uvicorn

from firehose.bootstrap import Batch, Bootstrap, BootstrapError
from firehose.uvicorn_batch import BatchingWebSocketsProtocol
from mst.cid import cid_str
from relay.bootstrap_cli import INDEX_VIEW, run_bootstrap
from relay.config import RelayConfig
from relay.service import RelayService
from sim import SimConfig, SimFleet
from spark.config import FetchConfig, JobConfig
from spark.export import run_export
from spark.relaydb import AccountFilter
from tests.relay.e2e import Consumer, crawl, settle
from tests.waiting import until

WANTED = ["app.bsky.actor.profile", "app.bsky.feed.like", "app.bsky.feed.post"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def relay_on(database_url: str, port: int, plc_url: str) -> AsyncIterator[RelayService]:
    """A relay in this process on 127.0.0.1:``port`` (the same port across restarts)."""
    config = RelayConfig.from_values({"database_url": database_url, "bind": f"127.0.0.1:{port}",
                                      "allow_insecure_hosts": "true", "plc_url": plc_url,
                                      "validation_workers": "0", "replay_window": "1h"})
    service = RelayService(config)
    await service.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(service.build_app(), log_level="warning", lifespan="off",
                                           ws=BatchingWebSocketsProtocol, ws_per_message_deflate=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await until(lambda: server.started, "the relay's HTTP server")
        yield service
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()
        await service.stop()


def truth(fleet: SimFleet) -> set[tuple[str, str, str, str]]:
    """The records of the wanted collections of every account its host has active."""
    out = set()
    for acct in fleet.accounts:
        if acct.status != "active":
            continue
        for path, cid in acct.repo.records().items():
            collection, rkey = path.split("/")
            if collection in WANTED:
                out.add((acct.did, collection, rkey, cid_str(cid)))
    return out


def index_seq(path: Path) -> int:
    if not path.exists():
        return -1
    db = sqlite3.connect(path)
    try:
        row = db.execute("SELECT value FROM meta WHERE key = 'seq'").fetchone()
        return int(row[0]) if row else -1
    except sqlite3.OperationalError:
        return -1
    finally:
        db.close()


async def keep_committing(fleet: SimFleet) -> None:
    while True:
        await fleet.generate(3)
        await asyncio.sleep(0.02)


@pytest.fixture
async def relay_schema(pg_dsn: str) -> AsyncIterator[str]:
    schema = f"t_boot_{uuid.uuid4().hex[:10]}"
    yield f"{pg_dsn}?schema={schema}"
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


@pytest.mark.parametrize("restart", [False, True], ids=["steady", "relay_restart"])
async def test_export_then_live_ends_equal_to_the_network(spark_session: Any, relay_schema: str, tmp_path: Path,
                                                          restart: bool) -> None:
    fleet = SimFleet(SimConfig(hosts=2, accounts_per_host=6, seed=31, initial_records=4))
    await fleet.start()
    for host in fleet.hosts:
        host.set_fault("deactivate", 0.05)
    port = free_port()
    url, ws_url = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/xrpc/com.atproto.sync.subscribeRepos"
    out, index_path = tmp_path / "export", tmp_path / "index.sqlite"
    committing: asyncio.Task[None] | None = None
    folding: asyncio.Task[Any] | None = None
    stack = contextlib.AsyncExitStack()
    try:
        await stack.enter_async_context(relay_on(relay_schema, port, fleet.plc_url))
        async with Consumer(ws_url, cursor=0) as consumer:
            for host in fleet.hosts:
                await crawl(url, host.hostname)
            await fleet.generate(30)
            await settle(fleet, consumer)
        committing = asyncio.create_task(keep_committing(fleet))
        cfg = JobConfig(db_url=relay_schema, run_id=f"t-{uuid.uuid4().hex[:8]}", write_batch=7, partitions=2,
                        fetch=FetchConfig(allow_private=True, scheme="http", plc_url=fleet.plc_url, timeout_s=10.0,
                                          retries=1, backoff_s=0.05, host_rate=500.0))
        manifest = await asyncio.to_thread(run_export, spark_session, cfg, AccountFilter(), str(out), WANTED)
        assert manifest["records"] > 0 and manifest["files"]
        # (did, rev, collection, rkey) of every change a stream commit brought (not whole-repo fetches)
        applied: list[tuple[str, str, str, str]] = []

        def seen(_index: Any, batch: Batch) -> bool:
            if batch.seq is not None and not any(c.kind == "reset" for c in batch.changes):
                applied.extend((c.did, c.rev, c.collection, c.rkey) for c in batch.changes
                               if c.kind in ("put", "delete") and c.rev is not None)
            return False

        stats: dict[str, int] = {}
        folding = asyncio.create_task(run_bootstrap(str(out), url, str(index_path), WANTED, stop=seen, stats=stats))
        cutover = int(manifest["cursor"])
        await until(lambda: index_seq(index_path) > cutover + 20, "the index to go live", timeout=60)
        if restart:
            await stack.aclose()  # the relay goes away while the index follows it ...
            await fleet.generate(10)
            await stack.enter_async_context(relay_on(relay_schema, port, fleet.plc_url))  # ... and comes back
            # then the fold itself stops, and starts again from the position the index holds
            reached = index_seq(index_path)
            await until(lambda: index_seq(index_path) > reached + 20, "the index to follow the restarted relay",
                        timeout=60)
            folding.cancel()
            await asyncio.gather(folding, return_exceptions=True)
            await fleet.generate(10)
            resumed: dict[str, int] = {}
            folding = asyncio.create_task(run_bootstrap(str(out), url, str(index_path), WANTED, stop=seen,
                                                        stats=resumed))
        await fleet.generate(20)
        committing.cancel()
        await asyncio.gather(committing, return_exceptions=True)
        async with Consumer(ws_url, cursor=cutover) as consumer:
            await settle(fleet, consumer, timeout=60)
            last = consumer.events[-1].seq
        await until(lambda: index_seq(index_path) >= last, "the index to reach the relay's last event", timeout=60)
        folding.cancel()
        await asyncio.gather(folding, return_exceptions=True)

        db = sqlite3.connect(index_path)
        index = {(str(a), str(b), str(c), str(d)) for a, b, c, d in db.execute(INDEX_VIEW)}
        db.close()
        expected = truth(fleet)
        assert len(expected) > 50
        assert index - expected == set(), "records in the index that the network does not have"
        assert expected - index == set(), "records of the network missing from the index"
        # exactly once: no stream change of an account at or below the rev the snapshot holds it at
        import pyarrow.parquet as pq

        exported = dict(zip(*pq.read_table(out / "records" / "_repos.parquet").to_pydict().values(), strict=True))
        assert all(rev > exported.get(did, "") for did, rev, _, _ in applied), "a change the snapshot holds came again"
        assert stats["snapshot_rows"] == manifest["records"] and stats["duplicates_skipped"] > 0, stats
        assert stats["events"] > 40
        if restart:
            assert resumed["snapshot_rows"] == 0 and resumed["events"] > 0, resumed
        assert len(applied) == len(set(applied)), "a stream change applied twice"
    finally:
        for task in (committing, folding):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await stack.aclose()
        await fleet.stop()


async def refusal(bootstrap: Bootstrap) -> BootstrapError:
    """The error ``bootstrap`` stops with, before it has yielded anything (bounded in time)."""
    batches = 0

    async def drain() -> None:
        nonlocal batches
        async for _batch in bootstrap:
            batches += 1

    try:
        await asyncio.wait_for(drain(), 20)
    except BootstrapError as exc:
        assert batches == 0, f"refused only after {batches} batches"
        return exc
    raise AssertionError(f"not refused ({batches} batches)")


async def snapshot_over_http(directory: Path, relay_url: str) -> int:
    """Rows of the snapshot read from ``directory`` served by ``http.server``, up to the live batch."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    rows = 0
    try:
        async def read() -> None:
            nonlocal rows
            async for batch in Bootstrap(f"http://127.0.0.1:{server.server_address[1]}", relay_url):
                if batch.live:
                    return
                rows += len(batch.changes)

        await asyncio.wait_for(read(), 20)
    finally:
        server.shutdown()
        server.server_close()
    return rows


async def test_a_tampered_file_or_an_old_cutover_is_refused(spark_session: Any, relay_schema: str,
                                                            tmp_path: Path) -> None:
    """A record file that does not match the manifest's checksum is refused before any of its rows
    is used; a cutover the relay's window no longer holds is refused with "take a newer export"."""
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=4, seed=32, initial_records=3))
    await fleet.start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = tmp_path / "export"
    try:
        async with relay_on(relay_schema, port, fleet.plc_url) as service:
            ws_url = f"ws://127.0.0.1:{port}/xrpc/com.atproto.sync.subscribeRepos"
            async with Consumer(ws_url, cursor=0) as consumer:
                await crawl(url, fleet.hosts[0].hostname)
                await fleet.generate(10)
                await settle(fleet, consumer)
            cfg = JobConfig(db_url=relay_schema, run_id=f"t-{uuid.uuid4().hex[:8]}", partitions=1,
                            fetch=FetchConfig(allow_private=True, scheme="http", plc_url=fleet.plc_url,
                                              timeout_s=10.0, retries=1, backoff_s=0.05, host_rate=500.0))
            manifest = await asyncio.to_thread(run_export, spark_session, cfg, AccountFilter(), str(out))
            # a byte of one record file changed: its size is right, its SHA-256 is not
            victim = out / manifest["files"][0]["path"]
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
            refused = await refusal(Bootstrap(str(out), url))
            assert refused.reason == "checksum_mismatch"
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
            # the same export served by a plain static file server
            rows = await snapshot_over_http(out, url)
            assert rows == manifest["records"]
            # the relay's window moves past the cutover
            await fleet.generate(10)
            async with Consumer(ws_url, cursor=0) as consumer:
                await settle(fleet, consumer)
            await service.store.trim(older_than_seconds=-1)
            too_old = await refusal(Bootstrap(str(out), url))
            assert too_old.reason == "cutover_too_old"
            assert "take a newer export" in str(too_old)
            assert json.loads((out / "manifest.json").read_text())["cursor"] == manifest["cursor"]
    finally:
        await fleet.stop()
