"""``ResyncManager.resync_one`` on a running relay, against the simulator: where the repository is
fetched from, each refusal with its reason (the ``relay_resyncs_total`` label) and message (the
log line), and what a completed resync installs and announces."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from backfill.collections import counts_from_paths
from mst.car import read_car
from mst.cid import cid_for_cbor
from mst.commit import decode_commit
from relay.ingest.resync import ResyncFailed
from sim.ident import SigningKey
from sim.repo import Write
from tests.relay.e2e import commits_of, one_account
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)


async def _refusal(resync: Any, did: str) -> tuple[str, str]:
    with pytest.raises(ResyncFailed) as failed:
        await resync.resync_one(did)
    return failed.value.reason, failed.value.message


async def test_each_refused_resync_says_why_and_changes_nothing(relay_factory: Any) -> None:
    """The directory does not know the DID; its document names no PDS; the PDS it names does not
    serve the repository; the repository is older than the one the relay holds (fetched before
    the newer commits arrived); the repository is signed with a key the document does not name.
    Each is refused with its reason and message, and the stored account is left as it was."""
    async with one_account(relay_factory, seed=41) as (fleet, relay, consumer):
        service, account, host = relay.service, fleet.accounts[0], fleet.hosts[0]
        resync, did = service.resync, account.did
        before = await service.store.get_account(did)
        assert before is not None and before.rev == account.repo.rev
        doc = fleet.plc.docs.pop(did)
        assert await _refusal(resync, did) == ("identity_did_not_found", f"{fleet.plc_url}/{did}: HTTP 404")
        fleet.plc.docs[did] = {**doc, "service": []}
        assert await _refusal(resync, did) == ("no_pds", "the DID document names no PDS")
        pds = {**doc["service"][0], "serviceEndpoint": fleet.plc_url}  # answers 404 to getRepo
        fleet.plc.docs[did] = {**doc, "service": [pds]}
        assert await _refusal(resync, did) == ("fetch_failed", "getRepo answered HTTP 404")
        fleet.plc.docs[did] = doc
        host.hold_repos()  # the next getRepo is answered with the repository as it is when asked
        try:
            refused = asyncio.ensure_future(_refusal(resync, did))
            await until(lambda: len(host.repo_requests) == 1, "the getRepo")
            fetched = account.repo.rev
            await fleet.generate(2)  # newer commits reach the relay meanwhile
            newest = account.repo.rev
            await consumer.wait_for(lambda evs: newest in commits_of(consumer, did))
        finally:
            host.release_repos()
        assert await refused == ("repo_older_than_stored", f"PDS rev {fetched} < stored {newest}")
        assert fleet._mix is not None
        account.repo.key = SigningKey.generate("k256", fleet.rng)  # a commit nobody published a key for
        account.repo.apply_writes(fleet._mix.next_writes(account.repo.record_paths()))
        assert await _refusal(resync, did) == ("commit_bad_signature", "commit_bad_signature: signature does not verify")
        after = await service.store.get_account(did)
        assert after is not None and after.rev == newest and after.sync_state == "synced"
        assert not [e for e in consumer.events if e.t == "#sync"]


async def test_a_resync_verifies_against_the_key_the_directory_names_now(relay_factory: Any,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """The account rotated its key and its PDS signed a newer commit with it, announced to nobody
    (no ``#identity``, no ``#commit``): the relay's cached identity still holds the old key. The
    resync resolves the DID afresh, verifies with the new key and installs the repository: the
    stored account is at the new commit, on the PDS the document names, with the repository's
    record counts per collection; the ``#sync`` carries exactly the signed commit block; one log
    line says so."""
    async with one_account(relay_factory, seed=42) as (fleet, relay, consumer):
        service, account, host = relay.service, fleet.accounts[0], fleet.hosts[0]
        did = account.did
        assert fleet._mix is not None
        account.key = account.repo.key = SigningKey.generate("k256", fleet.rng)
        fleet._publish_doc(account)  # the directory knows the new key; the relay's cache does not
        new = Write("create", "app.example.resync", "3kresyncaaaaa", {"$type": "app.example.resync", "n": 1})
        account.repo.apply_writes([*fleet._mix.next_writes(account.repo.record_paths()), new])
        rev, paths = account.repo.rev, account.repo.record_paths()
        assert "app.example.resync" not in await service.store.collection_counts(did)
        with caplog.at_level(logging.INFO, logger="relay.ingest.resync"):
            await service.resync.resync_one(did)
        [line] = [r for r in caplog.records if r.name == "relay.ingest.resync"]
        assert (line.getMessage(), line.fields) == ("resynced", {"did": did, "rev": rev, "records": len(paths)})
        assert await service.store.collection_counts(did) == counts_from_paths(paths)  # stored with the #sync
        await consumer.wait_for(lambda evs: any(e.t == "#sync" for e in evs))
        [sync] = [e for e in consumer.events if e.t == "#sync"]
        assert sync.did == did and sync.rev == rev and isinstance(sync.body["time"], str)
        car = read_car(sync.body["blocks"])
        [(cid, block)] = list(car.blocks.items())
        assert car.roots == [cid] and cid == cid_for_cbor(block)
        commit = decode_commit(block)
        assert (commit.did, commit.rev) == (did, rev)
        stored = await service.store.get_account(did)
        assert stored is not None
        assert (stored.host, stored.rev, stored.commit_cid, stored.data_cid, stored.sync_state) == (
            host.hostname, rev, cid.encode(), commit.data.encode(), "synced")
        assert stored.active
