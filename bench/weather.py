"""Weather: the relay against a network-like fleet — many hosts, many first-seen accounts, slow
identity lookups with a realistic tail and a share of misbehaving hosts.

Simulator (this process: every host, the PLC directory, the load) → ``relay serve`` (child
process, SQLite by default) → one consumer (this process). Shape (defaults): ``--hosts`` 1,000
hosts, ``--accounts`` 100,000 accounts in all, every one first seen by the relay (each host's
backlog holds each account's ``#identity``, ``#account`` and first ``#commit``); DID documents
and handle checks (``--handle-resolver-url`` = the PLC directory) answer with a log-normal delay,
p50 ``--identity-p50`` / p99 ``--identity-p99`` (50 ms / 3 s); ``--misbehaving`` (5 %) of the
hosts each have one kind of weather, in turn: unreadable frames (one in the middle of the
backlog, then 2 % of the frames), handle domains that never
answer, a getRepo failing (500) while accounts lose commits (broken chains), bad signatures, key
rotations, dropped connections. The hosts are crawled (``--crawl-concurrency`` requests in
flight); commits flow from then on. Two phases: the start-up (commits at ``--startup-rate``,
100/s: lower than the weather run's, as a relay taking in every account at once has less to spare),
until full speed: every first-seen account's first commit of a well-behaved host delivered and,
from then, every healthy commit arriving within 2 s of being sent for ``--full-speed-window`` s
on end (at most ``--startup-limit`` s); then the weather run proper for ``--minutes`` (commits at
``--rate``), every account known and the relay at full speed. Then
the weather clears (faults off, getRepo healed) and every account of a misbehaving host, plus one
of every host, posts a last commit (the markers).

Measured, each printed as a ``RESULT`` line:

* ``weather_healthy_delay_p50_s`` / ``_p99_s`` / ``_max_s``: from the simulator sending a commit
  of an account of a well-behaved host during the weather run to the consumer receiving it (goal:
  p99 ≤ 2 s); ``weather_startup_delay_p50_s`` / ``_p99_s`` the same for commits sent during the
  start-up (they wait for their own account's first sight, bounded by the identity lookups);
* ``weather_commits_lost``: valid commits (ground truth ``accept``) that never arrived, once the
  markers have (or ``--settle`` s passed), not counting commits covered by a later ``#sync`` of
  an account that was desynchronized, nor commits signed with a key the account rotated away from
  after sending them (``weather_commits_key_superseded``: the directory serves only the newest key,
  so a relay judging such a commit after the rotation cannot tell it from a forgery) (goal: 0);
  ``weather_commits_expected`` beside it, and
  ``weather_commits_replaced_by_sync``: valid commits that did not arrive as themselves but are
  covered by a later ``#sync`` (expected for the broken chains, not for skipped frames);
* ``weather_accounts_frozen``: accounts of misbehaving hosts (and a sample of 1,000 others) that
  the relay does not report ``active`` at the host's rev ``--settle`` s after the weather cleared
  (goal: 0);
* ``weather_relay_rss_mb``: the relay's peak RSS (main process and workers);
* ``weather_caught_up_s``: from the crawl until every first commit of the backlog (one per
  first-seen account, well-behaved hosts) was delivered; ``weather_full_speed_s``: from the crawl
  until full speed (the start of the ``--full-speed-window`` of prompt healthy commits that ended
  the start-up; -1 if not reached within ``--startup-limit``); ``weather_startup_rate`` and
  ``weather_rate``: the offered commits per second in each phase.

    .venv/bin/python bench/weather.py --minutes 2 --settle 180 --relay-args '--identity-rate 1000'  # network shape
    .venv/bin/python bench/weather.py --hosts 20 --accounts 400 --minutes 0.3   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench._common import PG_DSN, load_average, metric_sum, note, relay, result, self_cpu  # noqa: E402
from sim import Delay, HandleWeather, SimConfig, SimFleet, TruthEvent  # noqa: E402
from sim.host import SimAccount  # noqa: E402

#: the weather kinds of misbehaving hosts, assigned in turn
KINDS = ("unreadable", "silent_handles", "getrepo_failing", "bad_signature", "key_rotation", "disconnect")
HEALTHY_BOUND = 2.0


@dataclass
class Arrivals:
    """What the consumer received: ``#commit`` (did, rev) → receive time; ``#sync`` revs by DID."""

    commits: dict[tuple[str, str], float] = field(default_factory=dict)
    duplicates: int = 0
    syncs: dict[str, str] = field(default_factory=dict)
    frames: int = 0
    reconnects: int = 0


async def consume(url: str, arrivals: Arrivals, connected: asyncio.Event) -> None:
    """Read the relay's stream like a real consumer: on a cut connection (a consumer too slow for
    the relay's queue is cut) reconnect from the last seq received (counted in ``reconnects``)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    from firehose.frames import decode_frame

    cursor: int | None = None
    while True:
        target = url if cursor is None else f"{url}{'&' if '?' in url else '?'}cursor={cursor}"
        try:
            async with connect(target, max_size=None, compression=None, open_timeout=30, ping_interval=None) as ws:
                connected.set()
                async for msg in ws:
                    now = time.time()
                    arrivals.frames += 1
                    head = bytes(msg[:24])  # type: ignore[arg-type]
                    body = decode_frame(msg, strict=False).body  # type: ignore[arg-type]
                    seq = body.get("seq")
                    if type(seq) is int:
                        cursor = seq
                    if b"#commit" in head:
                        key = (body["repo"], body["rev"])
                        if key in arrivals.commits:
                            arrivals.duplicates += 1
                        else:
                            arrivals.commits[key] = now
                    elif b"#sync" in head:
                        arrivals.syncs[body["did"]] = max(arrivals.syncs.get(body["did"], ""), body["rev"])
        except (ConnectionClosed, OSError, TimeoutError):
            pass
        arrivals.reconnects += 1
        await asyncio.sleep(0.5)


def assign_weather(fleet: SimFleet, share: float, rng: random.Random) -> dict[int, str]:
    """Give ``share`` of the hosts one kind of weather each; returns host index → kind."""
    n = max(1, round(share * len(fleet.hosts))) if share > 0 else 0
    chosen = rng.sample(range(len(fleet.hosts)), n)
    kinds: dict[int, str] = {}
    for i, index in enumerate(chosen):
        kind = KINDS[i % len(KINDS)]
        host = fleet.hosts[index]
        kinds[index] = kind
        if kind == "unreadable":
            host.set_fault("unreadable", 0.02)
        elif kind == "silent_handles":
            for acct in host.accounts.values():
                fleet.domains.weather[acct.handle] = HandleWeather(Delay.fixed(10.0), "silent")
        elif kind == "getrepo_failing":
            host.fail_repos("500")
            host.set_fault("broken_chain", 0.05)
        elif kind == "bad_signature":
            host.set_fault("bad_signature", 0.05)
        elif kind == "key_rotation":
            host.set_fault("key_rotation", 0.02)
        elif kind == "disconnect":
            host.set_fault("disconnect", 0.02)
    return kinds


def clear_weather(fleet: SimFleet, kinds: dict[int, str], tail: Delay) -> None:
    for index in kinds:
        host = fleet.hosts[index]
        for kind in list(host.faults):
            host.set_fault(kind, 0.0)
        host.heal_repos()
        for acct in host.accounts.values():
            fleet.domains.weather[acct.handle] = HandleWeather(tail)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class FullSpeed:
    """Watches the healthy commits sent since ``ground_truth[start]`` for the last one that was
    late: not arrived within ``HEALTHY_BOUND`` s of being sent (judged once that long has passed)."""

    def __init__(self, truth: list[TruthEvent], start: int, bad_hosts: set[str], arrivals: Arrivals,
                 t0: float) -> None:
        self.truth, self.next, self.bad_hosts, self.arrivals = truth, start, bad_hosts, arrivals
        self.last_late = t0  # send time of the last late healthy commit (the crawl, before any)

    def advance(self, now: float) -> None:
        """Judge every commit sent more than ``HEALTHY_BOUND`` s before ``now``."""
        truth, commits = self.truth, self.arrivals.commits
        while self.next < len(truth) and truth[self.next].sent_at <= now - HEALTHY_BOUND:
            tr = truth[self.next]
            self.next += 1
            if tr.kind == "#commit" and tr.verdict == "accept" and tr.rev and tr.host not in self.bad_hosts:
                got = commits.get((tr.did, tr.rev))
                if got is None or got - tr.sent_at > HEALTHY_BOUND:
                    self.last_late = max(self.last_late, tr.sent_at)

    def since(self, floor: float) -> float:
        """When the current run of prompt commits began (not before ``floor``)."""
        return max(self.last_late, floor)

    def sustained(self, now: float, floor: float) -> float:
        """Seconds of sending, judged so far, with every healthy commit prompt (from ``floor``)."""
        return now - HEALTHY_BOUND - self.since(floor)


async def frozen_accounts(url: str, accounts: list[SimAccount]) -> list[str]:
    """Accounts the relay does not report ``active`` at the host's current rev."""
    frozen: list[str] = []
    sem = asyncio.Semaphore(32)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        async def one(acct: SimAccount) -> None:
            async with sem:
                r = await http.get("/xrpc/com.atproto.sync.getRepoStatus", params={"did": acct.did})
            body = r.json() if r.status_code == 200 else {}
            if body.get("active") is not True or body.get("rev") != acct.repo.rev:
                frozen.append(acct.did)

        await asyncio.gather(*(one(a) for a in accounts if a.status == "active"))
    return frozen


async def run(a: argparse.Namespace) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # hosts + connections, here and in the relay
    per_host = max(1, a.accounts // a.hosts)
    tail = Delay.tail(a.identity_p50, a.identity_p99)
    rng = random.Random(a.seed)
    fleet = SimFleet(SimConfig(hosts=a.hosts, accounts_per_host=per_host, seed=a.seed, log_limit=2_000_000))
    t = time.perf_counter()
    await fleet.start()
    note(f"weather: {a.hosts} hosts x {per_host} accounts up in {time.perf_counter() - t:.1f}s")
    fleet.plc.delay = tail
    for acct in fleet.accounts:
        fleet.domains.weather[acct.handle] = HandleWeather(tail)
    kinds = assign_weather(fleet, a.misbehaving, rng)
    for index, kind in kinds.items():  # an unreadable frame in the middle of the backlog, too
        if kind == "unreadable":
            accounts = list(fleet.hosts[index].accounts.values())
            await fleet.emit("unreadable", accounts[0])
            await fleet.commit(accounts)
    bad_hosts = {fleet.hosts[i].hostname for i in kinds}
    note(f"weather: misbehaving hosts {len(kinds)}: {sorted(set(kinds.values()))}")
    backlog_firsts = {(tr.did, tr.rev) for tr in fleet.ground_truth
                      if tr.kind == "#commit" and tr.verdict == "accept" and tr.host not in bad_hosts and tr.rev}
    database_url = f"{PG_DSN}?schema=bench_weather_{int(time.time())}" if a.db == "postgres" else None
    arrivals = Arrivals()
    peak_rss = 0
    try:
        async with relay(fleet.plc_url, database_url=database_url, extra=shlex.split(a.relay_args)) as r:
            connected = asyncio.Event()
            consumer = asyncio.create_task(consume(r.ws_url, arrivals, connected))
            await asyncio.wait_for(connected.wait(), 30)

            async def sample_rss() -> None:
                nonlocal peak_rss
                while True:
                    peak_rss = max(peak_rss, r.rss())
                    await asyncio.sleep(1.0)

            sampler = asyncio.create_task(sample_rss())
            t_crawl = time.time()
            caught_up_at: float | None = None
            full_speed_at: float | None = None
            await r.crawl([h.hostname for h in fleet.hosts], concurrency=a.crawl_concurrency)
            note(f"weather: crawled {a.hosts} hosts in {time.time() - t_crawl:.1f}s")
            # Start-up: the first-seen backlog, with commits flowing meanwhile (at --startup-rate),
            # until full speed: the backlog delivered and every healthy commit sent in the last
            # --full-speed-window s arrived within HEALTHY_BOUND.
            start_truth = len(fleet.ground_truth)
            cpu0, own0 = r.cpu(), self_cpu()
            startup_task = asyncio.create_task(fleet.run(a.startup_rate, None))
            watch = FullSpeed(fleet.ground_truth, start_truth, bad_hosts, arrivals, t_crawl)
            deadline = time.monotonic() + a.startup_limit
            while time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                if caught_up_at is None and all(k in arrivals.commits for k in backlog_firsts):
                    caught_up_at = time.time()
                    note(f"weather: backlog delivered {caught_up_at - t_crawl:.1f}s after the crawl")
                watch.advance(time.time())
                if caught_up_at is not None and watch.sustained(time.time(), caught_up_at) >= a.full_speed_window:
                    full_speed_at = watch.since(caught_up_at)
                    break
            startup_task.cancel()
            await asyncio.gather(startup_task, return_exceptions=True)
            startup = fleet.ground_truth[start_truth:]
            startup_cpu, startup_own = r.cpu() - cpu0, self_cpu() - own0
            note(f"weather: start-up over after {time.time() - t_crawl:.1f}s; backlog delivered "
                 f"{sum(1 for k in backlog_firsts if k in arrivals.commits)}/{len(backlog_firsts)}; "
                 f"full speed {'not reached' if full_speed_at is None else f'from {full_speed_at - t_crawl:.1f}s'}")
            # The weather run proper: every account known, the misbehaving hosts misbehaving.
            start_truth = len(fleet.ground_truth)
            cpu0, own0 = r.cpu(), self_cpu()
            produced = await fleet.run(a.rate, a.minutes * 60)
            weather_cpu, weather_own = r.cpu() - cpu0, self_cpu() - own0
            live = fleet.ground_truth[start_truth:]
            note(f"weather: {produced} commits produced at ~{a.rate}/s in the weather run")
            clear_weather(fleet, kinds, tail)
            closing = [acct for i in kinds for acct in fleet.hosts[i].accounts.values()]
            markers = await fleet.commit([x for x in closing if x.status == "active"])
            # and one account of every host (a relay keeps each account's order: this marker ends
            # the wait for that account; the settle window covers the rest)
            markers += await fleet.markers([next(x for x in h.accounts.values() if x.status == "active")
                                            for h in fleet.hosts if any(x.status == "active" for x in h.accounts.values())])
            deadline = time.monotonic() + a.settle
            while time.monotonic() < deadline and lost_commits(markers, arrivals):
                await asyncio.sleep(0.5)
            note(f"weather: markers {len(markers) - len(lost_commits(markers, arrivals))}/{len(markers)} arrived "
                 f"(or were covered by a #sync)")
            others = [x for x in fleet.accounts if x.host.hostname not in bad_hosts]
            sample = rng.sample(others, min(1000, len(others)))
            frozen = await frozen_accounts(r.url, closing + sample)
            metrics = await r.metrics()
            peak_rss = max(peak_rss, r.rss())
            sampler.cancel()
            consumer.cancel()
            await asyncio.gather(sampler, consumer, return_exceptions=True)
    finally:
        await fleet.stop()
    healthy_live = healthy(live, bad_hosts)
    delays = [d for _, d in delay_pairs(healthy_live, arrivals)]
    startup_delays = [d for _, d in delay_pairs(healthy(startup, bad_hosts), arrivals)]
    lost_all = lost_commits(fleet.ground_truth, arrivals)
    # A commit signed with a key its account rotated away from before the relay judged it cannot be
    # told from a forgery (the DID directory serves only the current key): rejected, as by any relay.
    rotated_at: dict[str, float] = {}
    for tr in fleet.ground_truth:
        if tr.kind == "#identity" and tr.fault == "key_rotation":
            rotated_at[tr.did] = max(rotated_at.get(tr.did, 0.0), tr.sent_at)
    superseded = [tr for tr in lost_all if rotated_at.get(tr.did, 0.0) > tr.sent_at]
    lost = [tr for tr in lost_all if rotated_at.get(tr.did, 0.0) <= tr.sent_at]
    result("weather_hosts", a.hosts)
    result("weather_accounts", len(fleet.accounts))
    result("weather_misbehaving_hosts", len(kinds))
    result("weather_healthy_commits_measured", len(delays))
    result("weather_healthy_commits_missing", len(healthy_live) - len(delays))
    result("weather_healthy_delay_p50_s", round(percentile(delays, 0.50), 3))
    result("weather_healthy_delay_p99_s", round(percentile(delays, 0.99), 3))
    result("weather_healthy_delay_max_s", round(max(delays, default=float("nan")), 3))
    result("weather_startup_commits_measured", len(startup_delays))
    result("weather_startup_delay_p50_s", round(percentile(startup_delays, 0.50), 3))
    result("weather_startup_delay_p99_s", round(percentile(startup_delays, 0.99), 3))
    result("weather_commits_expected", sum(1 for tr in fleet.ground_truth if tr.kind == "#commit" and tr.verdict == "accept"))
    result("weather_commits_lost", len(lost))
    result("weather_commits_key_superseded", len(superseded))
    result("weather_commits_replaced_by_sync", len(undelivered_commits(fleet.ground_truth, arrivals)) - len(lost_all))
    result("weather_commits_duplicated", arrivals.duplicates)
    result("weather_consumer_reconnects", arrivals.reconnects)
    result("weather_accounts_frozen", len(frozen))
    result("weather_relay_rss_mb", round(peak_rss / 1e6, 1))
    result("weather_startup_rate", a.startup_rate)
    result("weather_rate", a.rate)
    result("weather_caught_up_s", round(caught_up_at - t_crawl, 1) if caught_up_at is not None else -1)
    result("weather_full_speed_s", round(full_speed_at - t_crawl, 1) if full_speed_at is not None else -1)
    result("weather_startup_relay_cpu_s", round(startup_cpu, 1))
    result("weather_startup_sim_cpu_s", round(startup_own, 1))
    result("weather_run_relay_cpu_s", round(weather_cpu, 1))
    result("weather_run_sim_cpu_s", round(weather_own, 1))
    result("weather_rejects", metric_sum(metrics, "relay_verdicts_total", kind="reject"))
    result("weather_load_average", load_average())
    if lost:
        kind_of = {fleet.hosts[i].hostname: kind for i, kind in kinds.items()}
        by_kind: dict[str, int] = {}
        for tr in lost:
            by_kind[kind_of.get(tr.host, "healthy")] = by_kind.get(kind_of.get(tr.host, "healthy"), 0) + 1
        note(f"weather: lost by host weather {by_kind}; e.g. "
             f"{[(tr.host, kind_of.get(tr.host), tr.did, tr.rev, tr.fault) for tr in lost[:5]]}")
    if delays:
        note(f"weather: healthy delay mean {statistics.fmean(delays):.3f}s over {len(delays)} commits")


def healthy(truth: list[TruthEvent], bad_hosts: set[str]) -> list[TruthEvent]:
    """Valid commits of accounts of well-behaved hosts."""
    return [tr for tr in truth if tr.kind == "#commit" and tr.verdict == "accept" and tr.rev
            and tr.host not in bad_hosts]


def delay_pairs(truth: list[TruthEvent], arrivals: Arrivals) -> list[tuple[float, float]]:
    """(sent, delay) of each commit of ``truth`` that arrived, by send time."""
    return sorted((tr.sent_at, arrivals.commits[(tr.did, tr.rev)] - tr.sent_at) for tr in truth
                  if tr.rev is not None and (tr.did, tr.rev) in arrivals.commits)


def undelivered_commits(truth: list[TruthEvent], arrivals: Arrivals) -> list[TruthEvent]:
    """Valid commits that did not arrive as ``#commit``."""
    return [tr for tr in truth if tr.kind == "#commit" and tr.verdict == "accept" and tr.rev
            and (tr.did, tr.rev) not in arrivals.commits]


def lost_commits(truth: list[TruthEvent], arrivals: Arrivals) -> list[TruthEvent]:
    """Valid commits not delivered and not covered by a ``#sync`` of the account at a later rev."""
    return [tr for tr in truth if tr.kind == "#commit" and tr.verdict == "accept" and tr.rev
            and (tr.did, tr.rev) not in arrivals.commits and tr.rev > arrivals.syncs.get(tr.did, "")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=1000)
    p.add_argument("--accounts", type=int, default=100_000, help="accounts in all (spread over the hosts)")
    p.add_argument("--minutes", type=float, default=5.0, help="length of the run with the weather")
    p.add_argument("--rate", type=float, default=500.0, help="commits per second over the fleet in the weather run")
    p.add_argument("--startup-rate", type=float, default=100.0,
                   help="commits per second while the first-seen backlog is taken in (lower than --rate: "
                        "on 2 shared cores a relay taking in 100,000 new accounts has little to spare)")
    p.add_argument("--full-speed-window", type=float, default=30.0,
                   help="seconds of prompt healthy commits (each within 2 s) that end the start-up")
    p.add_argument("--misbehaving", type=float, default=0.05, help="share of misbehaving hosts")
    p.add_argument("--identity-p50", type=float, default=0.05, help="DID and handle lookups: median, s")
    p.add_argument("--identity-p99", type=float, default=3.0, help="DID and handle lookups: 99th percentile, s")
    p.add_argument("--startup-limit", type=float, default=1800.0,
                   help="seconds the first-seen backlog may take before the weather run starts anyway")
    p.add_argument("--crawl-concurrency", type=int, default=32, help="requestCrawl calls in flight")
    p.add_argument("--settle", type=float, default=120.0, help="seconds the markers may take after the weather")
    p.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--relay-args", default="", help="extra `relay serve` options, e.g. '--identity-rate 1000'")
    a = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    asyncio.run(run(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
