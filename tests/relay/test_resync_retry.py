"""No account is frozen: a resync that keeps failing is retried for as long as it fails (capped,
jittered backoff), a new frame from the account's host starts a waiting retry at once, what is
held meanwhile is bounded in bytes, and the desynchronized accounts are visible (a gauge by age,
``GET /admin/desynchronized``). A real relay against the simulator; the host's getRepo is made to
fail by tampering with the repository it serves (its last block no longer matches its hash)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from sim import SimConfig, SimFleet
from tests.relay.e2e import Consumer, commits_of, crawl, metric_value
from tests.waiting import until, until_async

pytestmark = pytest.mark.timeout(120)

TOKEN = "resync-admin"


@contextlib.asynccontextmanager
async def _one_account(relay_factory: Any, seed: int, **settings: Any) -> AsyncIterator[tuple[SimFleet, Any, Consumer]]:
    """A simulated host with one account, a relay (``settings`` added) following it, and a
    consumer that has seen the account's first two commits."""
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=1, seed=seed))
    await fleet.start()
    try:
        async with relay_factory(allow_insecure_hosts=True, plc_url=fleet.plc_url, validation_workers=0,
                                 admin_token=TOKEN, **settings) as relay, \
                Consumer(relay.ws_url, cursor=0) as consumer:
            account = fleet.accounts[0]
            await crawl(relay.url, fleet.hosts[0].hostname)
            await fleet.generate(2)
            await consumer.wait_for(lambda evs: account.repo.rev in commits_of(consumer, account.did))
            yield fleet, relay, consumer
    finally:
        await fleet.stop()


def _attempts(service: Any, did: str) -> int:
    entry = service.resync.queue.entry(did)
    return 0 if entry is None else int(entry.attempts)


def _verdicts(service: Any, kind: str, reason: str) -> float:
    return service.metrics.verdicts.labels(kind=kind, reason=reason)._value.get()  # type: ignore[no-any-return]


async def _metrics(relay: Any) -> str:
    async with httpx.AsyncClient(base_url=relay.url) as http:
        return (await http.get("/metrics")).text


async def _desynchronized(relay: Any) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=relay.url, headers={"authorization": f"Bearer {TOKEN}"}) as http:
        r = await http.get("/admin/desynchronized")
    assert r.status_code == 200, r.text
    listed: dict[str, Any] = r.json()
    return listed


async def test_a_failing_resync_is_retried_until_getrepo_recovers(relay_factory: Any) -> None:
    """getRepo keeps failing: the resync is retried well past five attempts (the account listed by
    the admin endpoint with its attempts, last failure and next retry, and counted in the age
    gauge); once getRepo answers again the next retry installs the repository with one ``#sync``,
    the account is synced and the queue, the list and the gauge are empty."""
    async with _one_account(relay_factory, seed=61, resync_retry_base="0.01", resync_retry_max="0.05") as (
            fleet, relay, consumer):
        service, account, host = relay.service, fleet.accounts[0], fleet.hosts[0]
        did = account.did
        host.tampered_repos.add(did)
        await service.lanes.mark_for_resync(did, host.hostname)
        await until(lambda: _attempts(service, did) >= 8, "eight failed attempts")
        listed = await _desynchronized(relay)
        [entry] = listed["accounts"]
        assert listed["count"] == 1 and entry["did"] == did and entry["attempts"] >= 8
        assert entry["lastFailure"] == "car_hash_mismatch" and entry["lastError"]
        assert entry["state"] in ("queued", "running", "waiting") and entry["since"] > 0
        assert entry["nextRetry"] is None or entry["nextRetry"] >= entry["since"]
        text = await _metrics(relay)
        assert metric_value(text, "relay_desynchronized_accounts", age="under_1m") == 1
        assert metric_value(text, "relay_desynchronized_accounts") == 1
        assert metric_value(text, "relay_resyncs_total", result="car_hash_mismatch") >= 8
        assert metric_value(text, "relay_resyncs_total", result="ok") == 0
        async with httpx.AsyncClient(base_url=relay.url) as http:
            status = (await http.get("/xrpc/com.atproto.sync.getRepoStatus", params={"did": did})).json()
        assert status["status"] == "desynchronized"

        host.tampered_repos.discard(did)  # getRepo recovers: the next retry succeeds
        await consumer.wait_for(lambda evs: any(e.t == "#sync" and e.did == did for e in evs))
        [sync] = [e for e in consumer.events if e.t == "#sync"]
        assert sync.rev == account.repo.rev
        await until(lambda: service.resync.queue.pending == 0, "the queue to empty")
        stored = await service.store.get_account(did)
        assert stored is not None and stored.sync_state == "synced" and stored.rev == account.repo.rev
        assert await _desynchronized(relay) == {"count": 0, "accounts": []}
        text = await _metrics(relay)
        assert metric_value(text, "relay_desynchronized_accounts") == 0
        assert metric_value(text, "relay_resyncs_total", result="ok") == 1
        async with httpx.AsyncClient(base_url=relay.url) as http:
            assert (await http.get("/admin/desynchronized")).status_code == 401  # the admin API's auth


async def test_a_new_commit_from_the_host_starts_a_waiting_retry_at_once(relay_factory: Any) -> None:
    """The first attempt fails and the next one is an hour away (the backoff). getRepo recovers;
    the host sends a new commit for the account: the commit is held and kicks the retry, which
    runs now: one ``#sync`` of the repository with that commit in it (the held commit is then
    covered by it), with no further commit needed."""
    async with _one_account(relay_factory, seed=62, resync_retry_base="1h", resync_retry_max="1h") as (
            fleet, relay, consumer):
        service, account, host = relay.service, fleet.accounts[0], fleet.hosts[0]
        did = account.did
        host.tampered_repos.add(did)
        await service.lanes.mark_for_resync(did, host.hostname)
        await until(lambda: _attempts(service, did) == 1, "the first attempt to fail")
        entry = service.resync.queue.entry(did)
        assert entry.state == "waiting" and entry.next_retry - entry.last_ended >= 1800  # half an hour at least
        host.tampered_repos.discard(did)
        [marker] = await fleet.markers(among=[account])
        await consumer.wait_for(lambda evs: any(e.t == "#sync" and e.did == did for e in evs))
        [sync] = [e for e in consumer.events if e.t == "#sync"]
        assert sync.rev == marker.rev  # the repository as it is now, with the new commit in it
        await until(lambda: _verdicts(service, "ignore", "covered_by_resync") == 1, "the held commit judged")
        assert marker.rev not in commits_of(consumer, did)
        assert _verdicts(service, "buffer", "resync_pending") == 1
        assert service.resync.queue.pending == 0 and service.resync.queue.kicks == 1
        text = await _metrics(relay)
        assert metric_value(text, "relay_resync_kicks_total") == 1
        assert metric_value(text, "relay_resyncs_total", result="ok") == 1


@pytest.mark.parametrize("bound", ["resync_held_bytes_per_account", "resync_held_bytes_total"])
async def test_held_frames_are_bounded_in_bytes_and_the_sync_covers_the_dropped(relay_factory: Any,
                                                                               bound: str) -> None:
    """While the resync's getRepo is held, ten commits arrive for the account, more than the bound
    (per account, or over all accounts) lets the lane hold: the oldest are dropped and counted
    ``resync_buffer_full``, what stays held is within the bound and is the newest. Once getRepo
    answers, the account ends synced at the newest commit (a dropped commit breaks the chain after
    the first ``#sync``; the next resync covers it) and nothing stays held."""
    limit = 8000
    async with _one_account(relay_factory, seed=63, resync_retry_base="0.01", resync_retry_max="0.05",
                            **{bound: str(limit)}) as (fleet, relay, consumer):
        service, account, host = relay.service, fleet.accounts[0], fleet.hosts[0]
        did, queue = account.did, service.resync.queue
        host.hold_repos()
        try:
            await service.lanes.mark_for_resync(did, host.hostname)
            await until(lambda: len(host.repo_requests) == 1, "the resync to ask for the repository")
            fetched = account.repo.rev  # the held getRepo answers with the repository as it was asked for
            revs = []
            for _ in range(10):
                revs += [t.rev for t in await fleet.markers(among=[account])]
            await until(lambda: _verdicts(service, "buffer", "resync_pending") == 10, "the ten commits to arrive")
            dropped = _verdicts(service, "ignore", "resync_buffer_full")
            lane = service.lanes._lanes[did]
            held = [w.uf.frame.body["rev"] for w in lane.buffer]
            assert dropped >= 1 and len(held) + dropped == 10
            assert held == revs[-len(held):]  # the newest are kept
            assert 0 < queue.held_for(did) == queue.held_bytes <= limit
            assert metric_value(await _metrics(relay), "relay_resync_held_bytes") == queue.held_bytes
        finally:
            host.release_repos()
        newest = account.repo.rev
        assert newest == revs[-1]

        async def synced_at_newest() -> bool:
            stored = await service.store.get_account(did)
            return stored is not None and stored.sync_state == "synced" and stored.rev == newest

        await until_async(synced_at_newest, "the account synced at its newest commit")
        await until(lambda: queue.pending == 0, "the queue to empty")
        assert queue.held_bytes == 0 and queue.held_for(did) == 0
        await consumer.wait_for(lambda evs: any(e.did == did and e.rev == newest for e in evs))
        mine = [(e.t, e.rev or "") for e in consumer.events if e.did == did and e.t in ("#commit", "#sync")]
        assert [rev for _, rev in mine] == sorted(rev for _, rev in mine)  # nothing older after anything newer
        # the first #sync (as fetched); the held commits after it no longer chain (the oldest were
        # dropped), so the account is resynchronised again, up to its newest commit
        assert mine[-2:] == [("#sync", fetched), ("#sync", newest)]
        assert not set(revs) & {rev for t, rev in mine if t == "#commit"}


async def test_lenient_mode_passes_a_desynchronized_accounts_commits_while_its_resync_fails(
        relay_factory: Any) -> None:
    """Lenient mode, as Bluesky's Go relay: the host withholds a commit, so the next one does not
    chain; the account is desynchronized and its resync fails (getRepo tampered). That commit and
    every later one still verify (signature, inversion against their own ``prevData``): each is
    delivered once, in order, counted ``pass``, and the account stays desynchronized. When getRepo
    recovers, the host's next commit kicks the retry: one ``#sync`` at that commit, and the account
    is synced."""
    async with _one_account(relay_factory, seed=64, lenient_sync_validation=True, resync_retry_base="1h",
                            resync_retry_max="1h") as (fleet, relay, consumer):
        service, account, host = relay.service, fleet.accounts[0], fleet.hosts[0]
        did = account.did
        host.tampered_repos.add(did)
        host.set_fault("broken_chain", 1.0)
        truth = await fleet.generate(1)
        host.set_fault("broken_chain", 0.0)
        [broken] = [t for t in truth if t.verdict == "desync"]
        revs = [t.rev for t in truth]
        await until(lambda: _attempts(service, did) >= 1, "the resync to fail")
        for _ in range(3):
            revs += [t.rev for t in await fleet.markers(among=[account])]
        await consumer.wait_for(lambda evs: revs[-1] in commits_of(consumer, did))
        delivered = commits_of(consumer, did)
        assert broken.rev in revs and delivered[-len(revs):] == revs and len(set(delivered)) == len(delivered)
        assert _verdicts(service, "pass", "resync_in_progress") == len(revs)
        stored = await service.store.get_account(did)
        assert stored is not None and stored.sync_state == "desynchronized" and stored.rev == revs[-1]
        assert not [e for e in consumer.events if e.t == "#sync"]

        host.tampered_repos.discard(did)
        [last] = await fleet.markers(among=[account])
        await consumer.wait_for(lambda evs: any(e.t == "#sync" and e.did == did for e in evs))
        [sync] = [e for e in consumer.events if e.t == "#sync"]
        assert sync.rev == last.rev
        assert [e.rev for e in consumer.events if e.did == did][-2:] == [last.rev, last.rev]  # the commit, its #sync
        await until(lambda: service.resync.queue.pending == 0, "the queue to empty")
        stored = await service.store.get_account(did)
        assert stored is not None and stored.sync_state == "synced" and stored.rev == last.rev


async def test_lenient_mode_never_rolls_an_account_back_to_a_repository_fetched_before_its_commits(
        relay_factory: Any) -> None:
    """Lenient mode: the resync's getRepo answers with the repository as it was when asked, and two
    newer commits pass meanwhile. That repository is refused (``repo_older_than_stored``), not
    announced; the retry fetches the current one: the account's events never go back in rev."""
    async with _one_account(relay_factory, seed=65, lenient_sync_validation=True, resync_retry_base="0.01",
                            resync_retry_max="0.05") as (fleet, relay, consumer):
        service, account, host = relay.service, fleet.accounts[0], fleet.hosts[0]
        did = account.did
        host.hold_repos()
        try:
            await service.lanes.mark_for_resync(did, host.hostname)
            await until(lambda: len(host.repo_requests) == 1, "the resync to ask for the repository")
            revs = [t.rev for _ in range(2) for t in await fleet.markers(among=[account])]
            await consumer.wait_for(lambda evs: revs[-1] in commits_of(consumer, did))
        finally:
            host.release_repos()
        await consumer.wait_for(lambda evs: any(e.t == "#sync" and e.did == did for e in evs))
        [sync] = [e for e in consumer.events if e.t == "#sync"]
        assert sync.rev == revs[-1]
        mine = [e.rev or "" for e in consumer.events if e.did == did and e.t in ("#commit", "#sync")]
        assert mine == sorted(mine)
        text = await _metrics(relay)
        assert metric_value(text, "relay_resyncs_total", result="repo_older_than_stored") >= 1
        assert metric_value(text, "relay_resyncs_total", result="ok") == 1


async def test_lenient_mode_an_upstream_sync_repairs_a_desynchronized_account(relay_factory: Any) -> None:
    """Lenient mode: the account is desynchronized and its resync waits an hour after failing;
    the host sends a ``#sync`` of the account's current commit: it is accepted, the account is
    synced, and it leaves the resync queue (no longer listed, no attempt made)."""
    async with _one_account(relay_factory, seed=66, lenient_sync_validation=True, resync_retry_base="1h",
                            resync_retry_max="1h") as (fleet, relay, consumer):
        service, account, host = relay.service, fleet.accounts[0], fleet.hosts[0]
        did = account.did
        host.tampered_repos.add(did)
        await service.lanes.mark_for_resync(did, host.hostname)
        await until(lambda: _attempts(service, did) == 1, "the first attempt to fail")
        res = account.repo.resign()
        fleet._queue(host, "#sync", {"did": did, "blocks": account.repo.commit_car(), "rev": res.rev,
                                     "time": "2026-11-26T00:00:00.000Z"}, did, rev=res.rev,
                     commit=res.commit_cid.encode())
        fleet._flush_now()
        await consumer.wait_for(lambda evs: any(e.t == "#sync" and e.did == did for e in evs))
        [sync] = [e for e in consumer.events if e.t == "#sync"]
        assert sync.rev == res.rev
        await until(lambda: service.resync.queue.pending == 0, "the account to leave the queue")
        assert (await _desynchronized(relay))["count"] == 0
        stored = await service.store.get_account(did)
        assert stored is not None and stored.sync_state == "synced" and stored.rev == res.rev
        assert metric_value(await _metrics(relay), "relay_resyncs_total", result="ok") == 0
