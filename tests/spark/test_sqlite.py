"""The jobs against the relay's embedded default: a SQLite database file."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from backfill.backends import open_store
from mst.cid import cid_str
from spark.db import connect_db
from spark.relaydb import AccountFilter
from spark.resync import run_resync
from tests.spark.helpers import FleetThread, apply_outbox, job_config, seed_relay


def test_resync_on_sqlite_queues_a_sync_the_relay_applies(spark_session: Any, fleet: FleetThread, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'relay.sqlite'}"

    async def migrate() -> None:
        store = await open_store(url)
        try:
            await store.migrate()
        finally:
            await store.close()

    asyncio.run(migrate())
    seed_relay(url, fleet)
    stale = fleet.fleet.accounts[4]
    fleet.call(lambda: stale.repo.apply_writes([]))

    summary = run_resync(spark_session, job_config(url, fleet), AccountFilter())

    assert summary["totals"] == {"ok": 19, "queued": 1}
    rev, head = fleet.call(lambda: (stale.repo.rev, cid_str(stale.repo.head)))
    with connect_db(url) as db:
        outbox = db.fetch("SELECT kind, did, rev FROM spark_repair_outbox")
    assert outbox == [{"kind": "#sync", "did": stale.did, "rev": rev}]

    # the relay (single writer) applies it: the account is at the host's verified state
    drained, events = asyncio.run(apply_outbox(url, fleet.fleet.plc_url))
    assert drained.consumed == 1 and [(e.kind, e.did) for e in events] == [("#sync", stale.did)]
    with connect_db(url) as db:
        row = db.fetch("SELECT rev, commit_cid, sync_state FROM accounts WHERE did = ?", stale.did)[0]
        outcome = db.fetch("SELECT outcome FROM spark_repair_outbox")[0]["outcome"]
    assert row == {"rev": rev, "commit_cid": head, "sync_state": "synced"} and outcome == "applied"
