"""The weather suite's harness: a simulated fleet with its DNS, a real relay pointed at it, a
consumer that stamps arrival times, and the checks every scenario ends with.

* :func:`weather` – fleet (``SimConfig(dns=True)``) + in-process relay (SQLite, the fleet's PLC
  directory, ``RELAY_DNS_SERVERS`` = the fleet's DNS, the fleet's address resolver for the HTTPS
  handle method) + a :class:`TimedConsumer` from cursor 0.
* :func:`assert_prompt` – the issue's acceptance bound: each of the given commits reached the
  consumer within ``HEALTHY_BOUND`` seconds of the simulator sending it.
* :func:`all_synced` – every active account's relay status is ``active`` at the host's rev.
* :func:`assert_delivered` – a marker commit from every active account ends the stream (the
  relay keeps each account's order, not necessarily its host's, so one marker per host is not
  enough); every valid commit arrived exactly once
  (or, for the accounts named, is covered by a ``#sync`` of a later rev), nothing else arrived,
  per-account order holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from sim import SimConfig, SimFleet, TruthEvent
from sim.host import SimAccount
from tests.relay.e2e import Consumer, check_stream, crawl, parse
from tests.relay.helpers import RunningRelay, running_relay
from tests.waiting import until, until_async

#: the issue's acceptance criterion: a healthy account's commit reaches a consumer within this
HEALTHY_BOUND = 2.0
#: "nothing frozen once the weather clears": every account synced within this
SYNCED_WITHIN = 60.0


class TimedConsumer(Consumer):
    """A :class:`Consumer` that also stamps when each ``(did, rev)`` of a ``#commit`` arrived."""

    def __init__(self, ws_url: str, cursor: int | None = None) -> None:
        super().__init__(ws_url, cursor)
        self.arrived: dict[tuple[str, str], float] = {}

    async def _read(self) -> None:
        assert self._ws is not None
        try:
            async for frame in self._ws:
                assert isinstance(frame, bytes)
                now = time.time()
                ev = parse(frame)
                if ev is None:
                    self.infos.append(frame)
                    continue
                self.events.append(ev)
                if ev.t == "#commit" and ev.rev is not None:
                    self.arrived.setdefault((ev.did, ev.rev), now)
        except Exception:
            return


@contextlib.asynccontextmanager
async def weather(tmp_path: Path, config: SimConfig, **settings: Any,
                  ) -> AsyncIterator[tuple[SimFleet, RunningRelay, TimedConsumer]]:
    """A started fleet (with DNS), a relay following none of its hosts yet, a consumer."""
    fleet = SimFleet(config if config.dns else SimConfig(**{**config.__dict__, "dns": True}))
    await fleet.start()
    assert fleet.dns is not None
    try:
        relay_settings = {"database_url": str(tmp_path / "relay.sqlite"), "allow_insecure_hosts": True,
                          "plc_url": fleet.plc_url, "validation_workers": 0, "default_account_limit": 10_000,
                          "dns_servers": fleet.dns.address, **settings}
        async with running_relay(resolver=fleet.dns.resolve_address, **relay_settings) as relay, \
                TimedConsumer(relay.ws_url, cursor=0) as consumer:
            yield fleet, relay, consumer
    finally:
        await fleet.stop()


async def crawl_all(relay: RunningRelay, fleet: SimFleet) -> None:
    for host in fleet.hosts:
        await crawl(relay.url, host.hostname)


def commit_revs(truths: Sequence[TruthEvent]) -> set[tuple[str, str]]:
    return {(t.did, t.rev) for t in truths if t.kind == "#commit" and t.verdict == "accept" and t.rev}


async def assert_prompt(consumer: TimedConsumer, truths: Sequence[TruthEvent], *, wait: float = 40.0,
                        bound: float = HEALTHY_BOUND) -> list[float]:
    """Wait (up to ``wait`` s) for the valid commits among ``truths``, then assert each arrived
    within ``bound`` s of being sent (simulator send time → consumer receive time). Returns the
    delays."""
    want = [t for t in truths if t.kind == "#commit" and t.verdict == "accept" and t.rev]
    assert want, "no commits to measure"
    keys = {(t.did, t.rev) for t in want}
    with contextlib.suppress(AssertionError):  # judged below, with the delays
        await until(lambda: keys <= consumer.arrived.keys(), "the healthy commits", timeout=wait)
    missing = [k for k in keys if k not in consumer.arrived]
    delays = sorted(consumer.arrived[(t.did, t.rev)] - t.sent_at for t in want if (t.did, t.rev) in consumer.arrived)
    late = [d for d in delays if d > bound]
    assert not missing and not late, (
        f"healthy commits: {len(missing)} of {len(want)} never arrived within {wait:.0f} s, "
        f"{len(late)} arrived later than {bound} s after being sent "
        f"(max delay {max(delays, default=0):.1f} s, median {delays[len(delays) // 2] if delays else 0:.2f} s)")
    return delays


async def relay_status(http: httpx.AsyncClient, did: str) -> dict[str, Any]:
    r = await http.get("/xrpc/com.atproto.sync.getRepoStatus", params={"did": did})
    body: dict[str, Any] = r.json()
    return body


async def all_synced(relay: RunningRelay, fleet: SimFleet, *, timeout: float = SYNCED_WITHIN,
                     accounts: Sequence[SimAccount] | None = None) -> None:
    """Every (given) active account is ``active`` at the host's rev on the relay within ``timeout``."""
    pool = [a for a in (accounts or fleet.accounts) if a.status == "active"]
    behind: list[tuple[str, dict[str, Any]]] = []

    async with httpx.AsyncClient(base_url=relay.url, timeout=10) as http:
        async def check() -> bool:
            behind.clear()
            for acct in pool:
                status = await relay_status(http, acct.did)
                if status != {"did": acct.did, "active": True, "rev": acct.repo.rev}:
                    behind.append((acct.did, status))
            return not behind

        try:
            await until_async(check, "every account synced", timeout=timeout, interval=0.25)
        except AssertionError:
            raise AssertionError(f"{len(behind)} of {len(pool)} accounts not synced within {timeout:.0f} s "
                                 f"after the weather cleared; e.g. {behind[:3]}") from None


async def assert_delivered(fleet: SimFleet, consumer: TimedConsumer, *, covered: Sequence[SimAccount] = (),
                           timeout: float = 30.0) -> None:
    """End the stream with markers, then: every valid commit exactly once (for ``covered``
    accounts, a commit may instead be covered by a ``#sync`` of that account at a later or equal
    rev), no invalid or unknown commit, revs strictly increasing per account."""
    markers = await fleet.commit([a for a in fleet.accounts if a.status == "active"])
    keys = commit_revs(markers)
    await until(lambda: keys <= consumer.arrived.keys(), "a marker commit from every account", timeout=timeout)
    valid = [t for t in fleet.ground_truth if t.kind == "#commit" and t.verdict == "accept"]
    invalid = {(t.did, t.rev) for t in fleet.ground_truth if t.verdict != "accept" and t.rev}
    got = Counter((e.did, e.rev) for e in consumer.events if e.t == "#commit")
    synced: dict[str, str] = {}
    for e in consumer.events:
        if e.t == "#sync" and e.rev is not None:
            synced[e.did] = max(synced.get(e.did, ""), e.rev)
    loose = {a.did for a in covered}
    missing = [t for t in valid if got[(t.did, t.rev)] == 0
               and not (t.did in loose and t.rev is not None and t.rev <= synced.get(t.did, ""))]
    twice = [k for k, n in got.items() if n > 1]
    unknown = [k for k in got if k not in {(t.did, t.rev) for t in valid}]
    assert not missing, (f"{len(missing)} of {len(valid)} valid commits never arrived; first: "
                         f"{[(t.did[-6:], t.rev, t.fault) for t in missing[:5]]}")
    assert not twice, f"{len(twice)} commits arrived more than once: {twice[:3]}"
    assert not unknown, f"commits that are not valid arrived: {unknown[:3]} (invalid: {set(unknown) & invalid})"
    check_stream(consumer.events)


async def paced(fleet: SimFleet, accounts: Sequence[SimAccount], rounds: int, every: float) -> list[TruthEvent]:
    """``rounds`` commits from each of ``accounts``, one round every ``every`` s (load, not waiting)."""
    out: list[TruthEvent] = []
    for i in range(rounds):
        out += await fleet.commit(accounts)
        if i + 1 < rounds:
            await asyncio.sleep(every)
    return out
