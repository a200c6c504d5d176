"""The account lane: the single owner of an account's in-flight head (``relay.ingest.lanes``).

The decisive case is a failed write: the store refuses the batch holding account A's commit N
while commit N+1, chained on N, has already been judged against the in-flight N. The lane must
roll back to N-1, N+1 must never be stored on top of the unsaved N, and both must arrive later,
in order, exactly once (the host run re-reads them from its durable cursor) — no ``#sync``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from backfill.backends import open_store
from backfill.store import Store
from backfill.types import HostState
from sim import SimConfig, SimFleet
from tests.backfill.helpers import Faults, with_faults
from tests.relay.e2e import Consumer, check_stream, commits_of, crawl, one_account
from tests.relay.helpers import judge, lane_work, logged_frames, sequence
from tests.waiting import until, until_async


async def faulty_store(path: Path, faults: Faults) -> Store:
    return with_faults(await open_store(str(path)), faults)


@pytest.mark.parametrize("error,refused,lease_failures", [
    (RuntimeError("write refused"), True, 0),
    (OSError("connection lost"), False, 0),
    (RuntimeError("write refused"), True, 2),
], ids=["refused", "unavailable", "refused-then-unreachable"])
async def test_failed_write_rolls_the_lane_back_and_nothing_chains_on_the_unsaved_commit(
    relay_factory: Any, tmp_path: Path, error: BaseException, refused: bool, lease_failures: int
) -> None:
    """``refused``: a write error retrying cannot fix — N's batch fails, the lane rolls back, the
    run re-reads. ``unavailable``: the store is unreachable — the batch is held and retried.
    ``refused-then-unreachable``: the store also becomes unreachable while the sequencer recovers
    from the refused write; it waits for it instead of stopping for good."""
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=1, seed=11))
    await fleet.start()
    faults = Faults(error)
    store = await faulty_store(tmp_path / "relay.sqlite", faults)
    try:
        settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0}
        async with relay_factory(store=store, **settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
            service = relay.service
            account = fleet.accounts[0]
            did = account.did
            await crawl(relay.url, fleet.hosts[0].hostname)
            await fleet.generate(3)
            stored_rev = account.repo.rev  # commit N-1
            await consumer.wait_for(lambda evs: stored_rev in commits_of(consumer, did))

            # commit N: its batch reaches the store and is held there
            faults.trigger = lambda batch: any(a.did == did and a.rev != stored_rev for a in batch.accounts)
            await fleet.generate(1)
            rev_n = account.repo.rev
            await asyncio.wait_for(faults.reached.wait(), 30)
            # N+1..N+3 are judged against the in-flight N (the lane chains before N is durable);
            # one at a time, so they reach the sequencer in separate batches: two are numbered
            # behind N's batch, the last still waits in the sequencer's queue when N fails
            chained: list[str] = []
            for _ in range(3):
                await fleet.generate(1)
                chained.append(account.repo.rev)
                await until(lambda: service.lanes.state(did) is not None
                            and service.lanes.state(did).rev == chained[-1], "accepted in flight")
                await asyncio.sleep(0.05)  # (spacing only; nothing is asserted on it)
            rev_n1 = chained[-1]
            faults.lease_failures = lease_failures
            faults.go.set()  # now the store fails N's batch
            if refused:
                # the lane falls back to what is stored: N-1 (N and N+1 are re-read afterwards)
                await until(lambda: service.lanes.state(did) is not None
                            and service.lanes.state(did).rev == stored_rev, "the lane rolled back to N-1")
            await consumer.wait_for(lambda evs: rev_n1 in commits_of(consumer, did))
            await fleet.generate(1)  # a marker: nothing of the above may arrive after it
            marker = account.repo.rev
            await consumer.wait_for(lambda evs: marker in commits_of(consumer, did))

            revs = commits_of(consumer, did)
            assert revs[-5:] == [rev_n, *chained, marker]
            assert len(revs) == len(set(revs))  # exactly once
            assert not [e for e in consumer.events if e.t == "#sync"]  # no repair was needed
            check_stream(consumer.events)
            stats = service.sequencer.stats
            assert service.sequencer.state == "running"
            if refused:
                # N's batch failed, the two numbered behind it were voided, the queued one fenced off
                assert stats.failed_batches >= 3 and stats.fenced >= 1
                assert faults.lease_failures == 0 and stats.retries >= (1 if lease_failures else 0)
            else:  # held and retried: nothing failed, nothing was re-read
                assert stats.failed_batches == 0 and stats.retries >= 1 and stats.fenced == 0
            stored = await service.store.get_account(did)
            assert stored is not None and stored.rev == marker and stored.sync_state == "synced"
    finally:
        await fleet.stop()


async def test_readiness_tells_the_truth_while_the_store_is_unavailable(relay_factory: Any, tmp_path: Path) -> None:
    """Liveness stays 200 throughout; readiness is 503 (sequencer retrying) while every write
    fails as unreachable, 200 again once writes succeed; the commits of the outage all arrive."""
    import httpx

    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=2, seed=12))
    await fleet.start()
    faults = Faults(OSError("unused"))
    store = await faulty_store(tmp_path / "relay.sqlite", faults)
    try:
        settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0}
        async with relay_factory(store=store, **settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer, \
                httpx.AsyncClient(base_url=relay.url) as http:
            await crawl(relay.url, fleet.hosts[0].hostname)
            await fleet.generate(4)
            await consumer.wait_for(lambda evs: sum(e.t == "#commit" for e in evs) >= 4)
            assert (await http.get("/_ready")).status_code == 200
            faults.down = True
            truth = await fleet.generate(6)
            await until(lambda: faults.refused >= 3, "writes refused")
            during = await http.get("/_ready")
            assert during.status_code == 503, during.text
            assert during.json()["sequencer"] == "retrying"
            assert any(r.startswith("sequencer_retrying") for r in during.json()["reasons"])
            assert (await http.get("/_health")).status_code == 200
            metrics = (await http.get("/metrics")).text
            assert 'relay_sequencer_state{state="retrying"} 1.0' in metrics
            faults.down = False
            revs = {t.rev for t in truth if t.kind == "#commit"}
            assert len(revs) == 6
            await consumer.wait_for(lambda evs: revs <= {e.rev for e in evs if e.t == "#commit"})
            after = await http.get("/_ready")
            assert after.status_code == 200 and after.json()["sequencer"] == "running"
            check_stream(consumer.events)
            assert not [e for e in consumer.events if e.t == "#sync"]
    finally:
        await fleet.stop()


def _verdicts(service: Any, kind: str, reason: str) -> float:
    return service.metrics.verdicts.labels(kind=kind, reason=reason)._value.get()  # type: ignore[no-any-return]


async def test_bad_signature_refreshes_the_identity_once(relay_factory: Any) -> None:
    """A commit signed with a key the relay has not seen yet (rotated without an #identity): the
    lane re-resolves the DID once and accepts it; with the directory still stale, it is rejected
    ``bad_signature`` after exactly one more refresh."""
    from sim.ident import SigningKey

    async with one_account(relay_factory, seed=13) as (fleet, relay, consumer):
        service, account = relay.service, fleet.accounts[0]
        assert service.lanes.identity_refreshes == 0
        account.key = account.repo.key = SigningKey.generate("k256", fleet.rng)
        fleet._publish_doc(account)  # the directory knows the new key; the relay's cache does not
        await fleet.generate(1)
        await consumer.wait_for(lambda evs: account.repo.rev in commits_of(consumer, account.did))
        assert service.lanes.identity_refreshes == 1
        account.repo.key = SigningKey.generate("k256", fleet.rng)  # signs with a key nobody published
        await fleet.generate(1)
        await until(lambda: _verdicts(service, "reject", "bad_signature") == 1, "the rejection")
        assert service.lanes.identity_refreshes == 2


async def test_a_takedown_in_the_lane_wins_over_what_was_in_flight(relay_factory: Any) -> None:
    """An operator takedown is ordered with the account's frames: later commits are judged against
    the taken-down state (not redistributed), and a reversal lets the next one through."""
    async with one_account(relay_factory, seed=14) as (fleet, relay, consumer):
        service, account = relay.service, fleet.accounts[0]
        state = await service.lanes.set_local_status(account.did, "takendown")
        assert state.local_status == "takendown" and state.rev == account.repo.rev
        await fleet.generate(1)
        hidden = account.repo.rev
        await until(lambda: _verdicts(service, "ignore", "account_inactive") == 1, "the ignore")
        await service.lanes.set_local_status(account.did, "active")
        await fleet.generate(1)
        # the relay skipped the hidden commit, so the next one does not chain on what it holds:
        # the account is repaired from its PDS and announced with #sync at the newest rev
        latest = account.repo.rev
        await consumer.wait_for(lambda evs: any(e.t == "#sync" and e.did == account.did and e.rev == latest
                                                for e in evs))
        assert hidden not in commits_of(consumer, account.did)
        statuses = [e.body.get("status") for e in consumer.events if e.t == "#account" and e.did == account.did]
        assert "takendown" in statuses


async def test_only_the_accounts_own_pds_speaks_for_it(relay_factory: Any) -> None:
    """Another host relaying an account's genuine commit, an ``#identity`` and an ``#account``
    deactivation for it: all three are rejected ``wrong_host`` (the DID document names a different
    PDS); the account keeps its host and stays active, and its own PDS's copy of the commit is
    the one redistributed."""
    fleet = SimFleet(SimConfig(hosts=2, accounts_per_host=1, seed=15))
    await fleet.start()
    try:
        settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0}
        async with relay_factory(**settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
            service = relay.service
            for host in fleet.hosts:
                await crawl(relay.url, host.hostname)
            await fleet.generate(4)
            account = next(a for a in fleet.accounts if a.host is fleet.hosts[0])
            own, other = fleet.hosts[0], fleet.hosts[1]
            await consumer.wait_for(lambda evs: account.repo.rev in commits_of(consumer, account.did))
            assert fleet._mix is not None
            res = account.repo.apply_writes(fleet._mix.next_writes(account.repo.record_paths()))
            body = fleet._commit_body(account, res)
            now = "2026-11-24T00:00:00.000Z"
            fleet._queue(other, "#commit", body, account.did, rev=res.rev, verdict="reject", reason="wrong_host")
            fleet._queue(other, "#identity", {"did": account.did, "time": now, "handle": "evil.test"}, account.did,
                         verdict="reject", reason="wrong_host")
            fleet._queue(other, "#account", {"did": account.did, "time": now, "active": False,
                                             "status": "deactivated"}, account.did,
                         verdict="reject", reason="wrong_host")
            fleet._queue(own, "#commit", body, account.did, rev=res.rev)
            fleet._flush_now()
            await until(lambda: _verdicts(service, "reject", "wrong_host") == 3, "three wrong_host rejections")
            await consumer.wait_for(lambda evs: res.rev in commits_of(consumer, account.did))
            await fleet.generate(4)  # a marker from every host: nothing of the above may come after it
            await consumer.wait_for(lambda evs: account.repo.rev in commits_of(consumer, account.did))
            assert commits_of(consumer, account.did).count(res.rev) == 1
            mine = [e for e in consumer.events if e.did == account.did]
            assert not [e for e in mine if e.t in ("#identity", "#account")
                        and (e.body.get("handle") == "evil.test" or e.body.get("active") is False)]
            stored = await service.store.get_account(account.did)
            assert stored is not None and stored.host == own.hostname and stored.active
    finally:
        await fleet.stop()


async def test_commits_held_during_a_resync_are_delivered_after_its_sync(relay_factory: Any) -> None:
    """Frames of an account being resynchronised are held in its lane, not judged against a state
    about to be replaced; once the repository fetched at rev r0 is installed (``#sync`` at r0), the
    held commits newer than r0 are judged against it and delivered, in order, after the ``#sync``."""
    async with one_account(relay_factory, seed=15) as (fleet, relay, consumer):
        service, account, host = relay.service, fleet.accounts[0], fleet.hosts[0]
        host.hold_repos()  # the resync's getRepo is answered with the repository as it is now
        try:
            await service.lanes.mark_for_resync(account.did, host.hostname)
            await until(lambda: len(host.repo_requests) == 1, "the resync to ask for the repository")
            fetched = account.repo.rev
            await fleet.generate(3)  # three commits while the resync waits for its answer
            await until(lambda: _verdicts(service, "buffer", "resync_pending") == 3, "the three commits held")
        finally:
            host.release_repos()
        newest = account.repo.rev
        await consumer.wait_for(lambda evs: newest in commits_of(consumer, account.did))
        after = consumer.events[next(i for i, e in enumerate(consumer.events)
                                     if e.t == "#sync" and e.did == account.did):]
        assert after[0].rev == fetched  # the #sync carries the repository as fetched
        later = [e.rev for e in after[1:] if e.t == "#commit" and e.did == account.did]
        assert len(later) == 3 and later == sorted(later) and later[-1] == newest
        assert _verdicts(service, "ignore", "covered_by_resync") == 0


async def test_a_held_accounts_status_is_stored_and_kept_but_not_emitted(relay_factory: Any) -> None:
    """An account held by its host's account limit reports a deactivation: the status is stored
    on the held account (it stays held) and nothing is emitted; a commit of the held account
    afterwards is ignored ``account_throttled`` and leaves the stored status as it was."""
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=2, seed=16, announce_accounts=False))
    await fleet.start()
    try:
        settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0,
                    "default_account_limit": 1}
        async with relay_factory(**settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
            service, host = relay.service, fleet.hosts[0]
            await crawl(relay.url, host.hostname)
            await fleet.markers(among=[fleet.accounts[0]])
            await fleet.markers(among=[fleet.accounts[1]])
            await until(lambda: _verdicts(service, "ignore", "account_throttled") == 1, "one account held")
            [held] = await service.store.accounts_by_sync_state("throttled")
            acct = fleet.by_did[held.did]
            admitted = next(a for a in fleet.accounts if a is not acct)
            fleet._queue(host, "#account", {"did": acct.did, "time": "2026-11-24T00:00:00.000Z", "active": False,
                                            "status": "deactivated"}, acct.did)
            fleet._flush_now()

            async def deactivated() -> bool:
                state = await service.store.get_account(acct.did)
                return state is not None and state.upstream_status == "deactivated"

            await until_async(deactivated, "the held account's status to be stored")
            assert _verdicts(service, "ignore", "account_throttled") == 2  # the #account, held
            await fleet.markers(among=[acct])  # a commit of the held account: ignored, held
            await until(lambda: _verdicts(service, "ignore", "account_throttled") == 3, "the commit ignored")
            stored = await service.store.get_account(acct.did)
            assert stored is not None and stored.sync_state == "throttled" and stored.upstream_status == "deactivated"
            marker = (await fleet.markers(among=[admitted]))[0]
            await consumer.wait_for(lambda evs: marker.rev in commits_of(consumer, admitted.did))
            assert not [e for e in consumer.events if e.did == acct.did]
    finally:
        await fleet.stop()


async def test_identity_and_account_events_judged_against_the_head_in_flight(relay_factory: Any) -> None:
    """An account's ``#identity``/``#account`` frames fed to its lane as its PDS's run would, each
    judged before the one before it is stored, on a host with an account limit of 1:

    - the first ``#identity`` admits the account (and carries it to the store); the ``#account``
      judged while that is in flight is judged against it — not admitted a second time, which
      the limit would refuse;
    - both are counted accept ``ok``; the ``#account`` keeps its upstream ``time``; an
      ``#identity`` whose handle does not resolve back is passed on without it (counted);
    - a deactivation is stored with the account's host and rev kept; a commit judged while it is
      in flight, and a later ``#identity``, are ignored ``account_inactive``;
    - a relay upstream's copy of the ``#identity``, for an account whose PDS is followed directly,
      is refused ``relay_not_authoritative``."""
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=1, seed=17))
    await fleet.start()
    try:
        settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "handle_resolver_url": fleet.plc_url,
                    "validation_workers": 0, "default_account_limit": 1}
        async with relay_factory(**settings) as relay:
            service, host, acct = relay.service, fleet.hosts[0], fleet.accounts[0]
            h, did = host.hostname, acct.did
            await fleet.generate(2)  # after the #identity and #account that announce the account
            fleet._queue(host, "#identity", {"did": did, "time": "2026-11-24T00:00:01.000Z", "handle": "evil.test"}, did)
            fleet.set_status(acct, "deactivated")
            fleet._flush_now()
            frames = logged_frames(host)
            identity, announced, forged, deactivated = (f for f in frames if f.frame.t in ("#identity", "#account"))
            c1, c2, *_ = (f for f in frames if f.frame.t == "#commit")
            accepted = _verdicts(service, "accept", "ok")

            first = await judge(relay, lane_work(h, identity, did))
            assert first is not None and first.body.get("handle") == acct.handle  # verified, so kept
            assert _verdicts(service, "strip", "handle_not_verified") == 0
            status = await judge(relay, lane_work(h, announced, did))  # while the #identity is in flight
            assert status is not None and status.body["time"] == announced.frame.body["time"]
            assert _verdicts(service, "ignore", "account_throttled") == 0
            assert await sequence(relay, first) is not None
            stored = await service.store.get_account(did)
            assert stored is not None and stored.host == h  # first sight: stored with its host
            assert await sequence(relay, status) is not None
            assert _verdicts(service, "accept", "ok") == accepted + 2

            commit = await judge(relay, lane_work(h, c1, did))
            assert commit is not None and await sequence(relay, commit) is not None
            stripped = await judge(relay, lane_work(h, forged, did))
            assert stripped is not None and "handle" not in stripped.body
            assert _verdicts(service, "strip", "handle_not_verified") == 1
            assert await sequence(relay, stripped) is not None

            off = await judge(relay, lane_work(h, deactivated, did))
            assert off is not None and off.body["active"] is False
            assert await judge(relay, lane_work(h, c2, did)) is None  # judged against the deactivation
            assert _verdicts(service, "ignore", "account_inactive") == 1
            assert await sequence(relay, off) is not None
            stored = await service.store.get_account(did)
            assert stored is not None and stored.upstream_status == "deactivated"
            assert stored.host == h and stored.rev == c1.frame.body["rev"]
            assert await judge(relay, lane_work(h, identity, did)) is None
            assert _verdicts(service, "ignore", "account_inactive") == 2

            other = "127.0.0.1:1"
            await service.store.upsert_host(HostState(hostname=h))  # followed directly
            await service.store.upsert_host(HostState(hostname=other, relay=True))
            assert service.lanes is not None
            service.lanes.admission.host_changed()
            assert await judge(relay, lane_work(other, identity, did, relay=True)) is None
            assert _verdicts(service, "reject", "relay_not_authoritative") == 1
    finally:
        await fleet.stop()
