"""The fault scenarios, shared by ``tests/faults`` and ``bench/faults.py``.

Every scenario builds a :class:`Rig` (a private PostgreSQL, for scale-out a private Redis, the
simulated PDS fleet, the relay as child processes, one :class:`RecordingConsumer` per process that
serves consumers, pollers of ``/_ready`` and ``/_health``), warms it up until the consumers hold
everything the hosts have sent, then generates commits at a steady rate while it injects one fault,
keeps generating for a few seconds after the failed dependency is back, and waits (bounded) until
every consumer has seen every account reach the rev its host holds. :class:`ScenarioResult` then
holds the comparison with the ground truth and :meth:`ScenarioResult.violations` lists every broken
promise (the tests assert there are none).

The promise checked: every verified event, exactly once, in order, across the failure; the relay
process survives; within ``resume_limit`` seconds of the dependency's return every consumer receives,
for the accounts of every host, an event sequenced after that return ("resume": ingest moves again
for every upstream, and the stream reaches the consumers);
``GET /_ready`` answers 503 while the dependency is down and 200 after it is back.

Timing words: ``down_at`` is when the fault was injected, ``restart_at`` when we began to bring the
dependency back, ``back_at`` when it was back (PostgreSQL / Redis accepting connections again, the
restarted relay answering ``/_health``, the end of an upstream disconnect storm). Every duration is
measured with ``time.monotonic()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType

import httpx

from sim import SimConfig, SimFleet
from tests.faults.harness import (
    PgCluster,
    RedisServer,
    RelayProcess,
    log_summary,
    log_tail,
    make_dir,
    remove_dir,
)
from tests.faults.observe import (
    Background,
    Poller,
    RecordingConsumer,
    Tally,
    caught_up,
    compare,
    final_revs,
    wait_until,
)

ADMIN_TOKEN = "faults-admin-token"


@dataclass(frozen=True)
class Settings:
    """Knobs shared by every scenario (defaults: what ``tests/faults`` runs)."""

    hosts: int = 3
    accounts_per_host: int = 10
    #: commits per second generated across the fleet while a fault runs
    rate: float = 25.0
    seed: int = 7
    #: validation worker processes of the relay (1: the worker path is exercised, the machine spared)
    validation_workers: int = 1
    #: traffic before the fault and after the dependency is back, seconds
    before: float = 1.0
    after: float = 3.0
    #: bound on the wait for consumers to reach every account's final rev after the traffic stops
    catch_up_timeout: float = 60.0
    #: the relay's seq must move within this many seconds of the dependency's return
    resume_limit: float = 5.0
    #: /_ready may take this long to notice a dependency went down ...
    ready_grace: float = 3.0
    #: ... and this long to answer 200 once it is back
    ready_within: float = 10.0
    #: outage lengths, seconds
    pg_kill_outage: float = 10.0
    pg_down_outage: float = 30.0
    redis_outage: float = 8.0
    #: upstream storm: drops per host before it ends, how long each connection lives, bound
    storm_drops: int = 4
    storm_hold: float = 0.25
    storm_max: float = 30.0


@dataclass
class FaultTimes:
    """When a fault began (``down_at``), when we began to bring the dependency back
    (``restart_at``) and when it was back (``back_at``, e.g. accepting connections again).
    ``unready`` lists the relay processes whose ``/_ready`` must answer 503 to every request sent
    after ``down_at + ready_grace`` and answered before ``restart_at`` (empty when the outage is too
    short to observe)."""

    down_at: float
    back_at: float
    restart_at: float = 0.0
    unready: list[RelayProcess] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: checks run once the consumers have caught up (before the final tally); each returns the
    #: violations it found (e.g. repairs the relay did not apply, or applied when it must not)
    final_checks: list[Callable[[], Awaitable[list[str]]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.restart_at:
            self.restart_at = self.back_at


@dataclass
class ScenarioResult:
    """What one scenario measured. ``tallies`` is per consumer (named after its relay process)."""

    name: str
    settings: Settings
    tallies: dict[str, Tally] = field(default_factory=dict)
    accounts: int = 0
    #: accounts whose rev is the host's in the relay's own state (listRepos) and in every consumer
    accounts_in_sync: int = 0
    relay_state_in_sync: int = 0
    resume_s: float = math.inf
    relays_alive: bool = True
    caught_up: bool = False
    outage_s: float = 0.0
    duration_s: float = 0.0
    commits_generated: int = 0
    readiness: list[str] = field(default_factory=list)
    #: violations found by the fault's own final checks (``FaultTimes.final_checks``)
    checks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    logs: dict[str, str] = field(default_factory=dict)

    def total(self, attr: str) -> int:
        """Sum of one :class:`Tally` field over the consumers."""
        return sum(int(getattr(t, attr)) for t in self.tallies.values())

    @property
    def lost(self) -> int:
        return self.total("lost")

    @property
    def duplicates(self) -> int:
        """Frames received twice (same seq) plus commits received twice (different seqs)."""
        return self.total("duplicate_seqs") + self.total("duplicate_commits")

    @property
    def converted_to_sync(self) -> int:
        return self.total("converted_to_sync")

    def violations(self) -> list[str]:
        """Every broken promise, as one line each (empty: the scenario passed)."""
        s = self.settings
        out: list[str] = []
        checks = [
            ("commits lost", self.lost),
            ("duplicate seqs", self.total("duplicate_seqs")),
            ("duplicate commits", self.total("duplicate_commits")),
            ("seqs out of order", self.total("out_of_order")),
            ("per-account rev order broken", self.total("rev_order")),
            ("accounts turned into #sync", self.converted_to_sync),
            ("commits not in the ground truth", self.total("unexpected_commits")),
        ]
        out += [f"{what}: {n}" for what, n in checks if n]
        if self.accounts_in_sync != self.accounts:
            out.append(f"accounts in sync with their host: {self.accounts_in_sync}/{self.accounts} "
                       f"(relay state {self.relay_state_in_sync}/{self.accounts})")
        if not self.relays_alive:
            out.append("a relay process died")
        if not self.resume_s <= s.resume_limit:
            out.append(f"ingest resumed {self.resume_s:.2f} s after the dependency returned (limit {s.resume_limit} s; "
                       "the slowest consumer/host pair)")
        out += self.readiness
        out += self.checks
        return out

    def results(self) -> dict[str, float | int]:
        """The figures ``bench/faults.py`` prints (``faults_<name>_<key>``)."""
        return {
            "lost": self.lost,
            "duplicates": self.duplicates,
            "converted_to_sync": self.converted_to_sync,
            "resume_s": round(self.resume_s, 3) if math.isfinite(self.resume_s) else self.resume_s,
            "accounts_in_sync": self.accounts_in_sync,
            "accounts": self.accounts,
            "rev_order_violations": self.total("rev_order"),
            "relays_alive": int(self.relays_alive),
            "readiness_violations": len(self.readiness),
            "expected_commits": max((t.expected_commits for t in self.tallies.values()), default=0),
            "outage_s": round(self.outage_s, 2),
            "scenario_s": round(self.duration_s, 1),
        }

    def render(self) -> str:
        """A readable report: figures, violations, consumer details, relay log tails."""
        lines = [f"scenario {self.name}: " + ", ".join(f"{k}={v}" for k, v in self.results().items())]
        for name, t in self.tallies.items():
            lines.append(f"  consumer {name}: frames={t.frames} expected_commits={t.expected_commits} lost={t.lost} "
                         f"dup_seq={t.duplicate_seqs} dup_commits={t.duplicate_commits} "
                         f"out_of_order={t.out_of_order} rev_order={t.rev_order} "
                         f"to_sync={t.converted_to_sync} stale={t.stale_accounts} lost_sample={t.lost_sample}")
        lines += [f"  note: {n}" for n in self.notes]
        problems = self.violations()
        lines += [f"  VIOLATION {v}" for v in problems]
        if problems:
            for name, tail in self.logs.items():
                if tail:
                    lines.append(f"  --- {name} log (distinct messages, count first) ---")
                    lines += ["    " + ln[:400] for ln in tail.splitlines()]
        return "\n".join(lines)


class Traffic(Background):
    """Commits at a steady rate from the fleet, in the background, until :meth:`stop`."""

    def __init__(self, fleet: SimFleet, rate: float) -> None:
        self.fleet = fleet
        self.rate = rate

    def start(self) -> None:
        self._launch(self.fleet.run(self.rate), "traffic")


class Rig:
    """Everything one scenario runs against; ``async with Rig(...) as rig`` starts it all (relay
    processes, hosts added through the admin API, consumers from cursor 0, pollers) and always
    ends it all, in reverse order."""

    def __init__(self, settings: Settings, *, scale_out: bool = False, fanouts: int = 2) -> None:
        self.settings = settings
        self.scale_out = scale_out
        self.fanout_count = fanouts
        self.workdir = make_dir("relay-faults-")
        self.pg = PgCluster()
        self.redis: RedisServer | None = RedisServer() if scale_out else None
        self.fleet = SimFleet(SimConfig(hosts=settings.hosts, accounts_per_host=settings.accounts_per_host,
                                        seed=settings.seed))
        self.writer: RelayProcess | None = None
        self.readers: list[RelayProcess] = []
        self.consumers: list[RecordingConsumer] = []
        self.ready: dict[str, Poller] = {}
        self.health: Poller | None = None
        self._stack = contextlib.AsyncExitStack()

    @property
    def relays(self) -> list[RelayProcess]:
        """Every relay process: the writer (serve / ingest) first."""
        assert self.writer is not None
        return [self.writer, *[r for r in self.readers if r is not self.writer]]

    def name_of(self, relay: RelayProcess) -> str:
        return relay.log_path.stem

    async def __aenter__(self) -> Rig:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._stack.aclose()

    async def _start(self) -> None:
        stack, s = self._stack, self.settings
        stack.callback(remove_dir, self.workdir)
        await stack.enter_async_context(self.pg)
        await self.pg.start()
        if self.redis is not None:
            await stack.enter_async_context(self.redis)
            await self.redis.start()
        await self.fleet.start()
        stack.push_async_callback(self.fleet.stop)
        settings = {
            "RELAY_DATABASE_URL": self.pg.dsn,
            "RELAY_ALLOW_INSECURE_HOSTS": "true",
            "RELAY_PLC_URL": self.fleet.plc_url,
            "RELAY_HANDLE_RESOLVER_URL": self.fleet.plc_url,
            "RELAY_ADMIN_TOKEN": ADMIN_TOKEN,
            "RELAY_VALIDATION_WORKERS": str(s.validation_workers),
            "RELAY_REPAIR_INTERVAL": "0.5s",
            "RELAY_REPAIR_SETTLE": "1s",
        }
        if self.redis is not None:
            settings["RELAY_REDIS_URL"] = self.redis.url
            self.writer = RelayProcess("ingest", settings, self.workdir / "ingest.log")
            self.readers = [RelayProcess("fanout", settings, self.workdir / f"fanout{i + 1}.log")
                            for i in range(self.fanout_count)]
        else:
            self.writer = RelayProcess("serve", settings, self.workdir / "serve.log")
            self.readers = [self.writer]
        for relay in self.relays:
            await stack.enter_async_context(relay)
        await self.writer.start()
        await asyncio.gather(*(r.start() for r in self.readers if r is not self.writer))
        async with httpx.AsyncClient(base_url=self.writer.url, timeout=30,
                                     headers={"authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
            for host in self.fleet.hosts:
                r = await http.post("/admin/hosts", json={"hostname": host.hostname, "trusted": True})
                if r.status_code != 200:
                    raise RuntimeError(f"adding host {host.hostname} failed: {r.status_code} {r.text}")
        for relay in self.readers:
            consumer = RecordingConsumer(relay.ws_url, cursor=0, name=self.name_of(relay))
            self.consumers.append(consumer)
            await consumer.start()
            stack.push_async_callback(consumer.stop)
        for relay in self.relays:
            poller = Poller(relay.url + "/_ready")
            self.ready[self.name_of(relay)] = poller
            await poller.start()
            stack.push_async_callback(poller.stop)
        self.health = Poller(self.writer.url + "/_health")
        await self.health.start()
        stack.push_async_callback(self.health.stop)

    def all_caught_up(self) -> bool:
        finals = final_revs(self.fleet.ground_truth)
        return all(caught_up(c, finals) for c in self.consumers)

    def any_relay_dead(self) -> bool:
        return not all(r.alive for r in self.relays)

    async def warm_up(self, seconds: float = 1.0, timeout: float = 60.0) -> None:
        """Traffic for ``seconds``, then wait until every consumer holds it all (a rig that cannot
        do this without a fault is broken: ``RuntimeError``)."""
        traffic = Traffic(self.fleet, self.settings.rate)
        traffic.start()
        await asyncio.sleep(seconds)
        await traffic.stop()
        if not await wait_until(self.all_caught_up, timeout, give_up=self.any_relay_dead):
            raise RuntimeError("warm-up: consumers did not catch up before any fault:\n"
                               + "\n".join(f"{self.name_of(r)}: {log_summary(r.log_path)}" for r in self.relays))


Fault = Callable[[Rig], Awaitable[FaultTimes]]


async def _relay_revs(relay: RelayProcess) -> dict[str, str]:
    """``did -> rev`` as the relay holds it (``listRepos``; empty if it does not answer)."""
    out: dict[str, str] = {}
    cursor: str | None = None
    try:
        async with httpx.AsyncClient(base_url=relay.url, timeout=10) as http:
            while True:
                params = {"limit": "1000", **({"cursor": cursor} if cursor else {})}
                r = await http.get("/xrpc/com.atproto.sync.listRepos", params=params)
                if r.status_code != 200:
                    return out
                body = r.json()
                for repo in body.get("repos", []):
                    out[repo["did"]] = repo.get("rev")
                cursor = body.get("cursor")
                if not cursor or not body.get("repos"):
                    return out
    except httpx.HTTPError:
        return out


def _readiness(rig: Rig, times: FaultTimes, final: dict[str, int | None]) -> list[str]:
    """Readiness violations: 503 throughout ``[down_at + ready_grace, restart_at]`` for the processes
    in ``times.unready``, a 200 within ``ready_within`` of ``back_at`` and at the end for every process."""
    s = rig.settings
    out: list[str] = []
    unready = {rig.name_of(r) for r in times.unready}
    for name, poller in rig.ready.items():
        if name in unready:
            window = poller.between(times.down_at + s.ready_grace, times.restart_at)
            codes = sorted({a.status for a in window}, key=str)
            if not window:
                out.append(f"/_ready of {name}: no answer recorded while the dependency was down")
            elif codes != [503]:
                out.append(f"/_ready of {name} while the dependency was down: {codes} (want only 503)")
        after = [a for a in poller.answers if a.at >= times.back_at and a.status == 200]
        if not after or after[0].at - times.back_at > s.ready_within:
            seen = sorted({a.status for a in poller.answers if a.at >= times.back_at}, key=str)
            out.append(f"/_ready of {name}: no 200 within {s.ready_within} s of the dependency's return "
                       f"(answers since: {seen})")
        if final.get(name) != 200:
            out.append(f"/_ready of {name} at the end: {final.get(name)} (want 200)")
    return out


async def run_scenario(name: str, fault: Fault, settings: Settings | None = None, *,
                       scale_out: bool = False) -> ScenarioResult:
    """Run one scenario end to end (see the module docstring) and return what it measured.
    Raises only when the rig cannot even be set up or warmed up; every broken promise after
    that is reported in the result."""
    s = settings or Settings()
    t_start = time.monotonic()
    result = ScenarioResult(name, s)
    async with Rig(s, scale_out=scale_out) as rig:
        await rig.warm_up()
        traffic = Traffic(rig.fleet, s.rate)
        traffic.start()
        try:
            await asyncio.sleep(s.before)
            times = await fault(rig)
            await asyncio.sleep(s.after)
        finally:
            await traffic.stop()
        result.outage_s = times.back_at - times.down_at
        result.notes += times.notes
        result.caught_up = await wait_until(rig.all_caught_up, s.catch_up_timeout, give_up=rig.any_relay_dead)
        for check in times.final_checks:
            result.checks += await check()
        result.notes += [note for note in times.notes if note not in result.notes]
        assert rig.health is not None
        if result.caught_up:  # then let anything still in flight (a late duplicate) arrive
            async with httpx.AsyncClient(timeout=2) as http:
                answer = await rig.health.ask(http)
            top = answer.seq or 0
            await wait_until(lambda: all(c.max_seq >= top for c in rig.consumers), 10)
        else:
            result.notes.append(f"consumers did not reach every account's final rev within "
                                f"{s.catch_up_timeout} s after the traffic stopped")
        final: dict[str, int | None] = {}
        async with httpx.AsyncClient(timeout=5) as http:
            for relay in rig.relays:
                final[rig.name_of(relay)] = (await rig.ready[rig.name_of(relay)].ask(http)).status
        relay_revs = await _relay_revs(rig.writer) if rig.writer is not None else {}
        result.relays_alive = not rig.any_relay_dead()
        for consumer in rig.consumers:  # stop recording before judging
            await consumer.stop()
        for poller in rig.ready.values():
            await poller.stop()
        await rig.health.stop()

        truth = list(rig.fleet.ground_truth)
        host_revs = {a.did: a.repo.rev for a in rig.fleet.accounts}
        result.accounts = len(host_revs)
        result.commits_generated = rig.fleet.commits_generated
        for consumer in rig.consumers:
            result.tallies[consumer.name] = compare(truth, consumer.frames, host_revs)
            result.notes.append(f"{consumer.name}: connections={consumer.connections} "
                                f"reconnect causes={dict(consumer.errors)}")
        result.relay_state_in_sync = sum(1 for did, rev in host_revs.items() if relay_revs.get(did) == rev)
        result.accounts_in_sync = sum(
            1 for did, rev in host_revs.items()
            if relay_revs.get(did) == rev and all(c.last_rev.get(did) == rev for c in rig.consumers))
        baseline = max([c.max_seq_before(times.back_at) for c in rig.consumers]
                       + [rig.health.max_seq_before(times.back_at)])
        by_host: dict[str, set[str]] = {}
        for acct in rig.fleet.accounts:
            by_host.setdefault(acct.host.hostname, set()).add(acct.did)
        resumed = {(c.name, host): c.first_after(baseline, times.back_at, dids)
                   for c in rig.consumers for host, dids in by_host.items()}
        result.resume_s = max((f - times.back_at if f is not None else math.inf) for f in resumed.values())
        result.notes.append(f"resume (seconds after the return until an event sequenced after it arrived, per "
                            f"consumer and host; baseline seq {baseline}): "
                            + ", ".join(f"{c}/{h.rsplit(':', 1)[-1]}="
                                        + (f"{f - times.back_at:.2f}" if f is not None else "never")
                                        for (c, h), f in resumed.items()))
        result.readiness = _readiness(rig, times, final)
        result.logs = {rig.name_of(r): log_summary(r.log_path) for r in rig.relays}
    result.duration_s = time.monotonic() - t_start
    return result


# -- the faults ------------------------------------------------------------------------------

async def _outage(rig: Rig, take_down: Callable[[], Awaitable[None]], seconds: float,
                  bring_back: Callable[[], Awaitable[None]]) -> FaultTimes:
    """A dependency taken down, kept down ``seconds`` (from when it went), then brought back;
    readiness is expected to be 503 meanwhile on every relay."""
    down = time.monotonic()
    await take_down()
    await asyncio.sleep(max(0.0, seconds - (time.monotonic() - down)))
    restart = time.monotonic()
    await bring_back()
    return FaultTimes(down, time.monotonic(), restart, unready=rig.relays)


async def pg_kill(rig: Rig) -> FaultTimes:
    """(a) kill -9 of the postmaster and its children; started again after ``pg_kill_outage`` s."""
    return await _outage(rig, rig.pg.kill9, rig.settings.pg_kill_outage, rig.pg.start)


async def pg_fast_restart(rig: Rig) -> FaultTimes:
    """(b) ``pg_ctl restart -m fast``: the outage lasts as long as the restart (too short to ask
    ``/_ready`` reliably in between, so only "200 after" is checked)."""
    down = time.monotonic()
    await rig.pg.restart_fast()
    return FaultTimes(down, time.monotonic())


async def pg_down(rig: Rig) -> FaultTimes:
    """(c) fast shutdown, ``pg_down_outage`` s without a database, start again."""
    return await _outage(rig, lambda: rig.pg.stop("fast"), rig.settings.pg_down_outage, rig.pg.start)


async def redis_kill(rig: Rig) -> FaultTimes:
    """(d) scale-out: kill -9 of Redis (its streams are lost), restarted empty on the same port
    after ``redis_outage`` s."""
    assert rig.redis is not None
    return await _outage(rig, rig.redis.kill9, rig.settings.redis_outage, rig.redis.start)


async def relay_kill(rig: Rig) -> FaultTimes:
    """(e) SIGKILL of ``relay serve`` and a restart; the relay is "back" when ``/_health``
    answers 200 again."""
    assert rig.writer is not None
    down = time.monotonic()
    await rig.writer.kill9()
    restart = time.monotonic()
    back = await rig.writer.start()
    return FaultTimes(down, back, restart)


async def upstream_storm(rig: Rig) -> FaultTimes:
    """(f) an upstream disconnect storm: every host aborts each ``subscribeRepos`` connection of the
    relay ``storm_hold`` s after it was opened (``SimHost.drop_connections``: a TCP abort, possibly
    mid-frame; by then the relay has read frames on it: the backlog it missed and live ones). The
    storm lasts until every host has dropped ``storm_drops`` connections (at most ``storm_max`` s);
    its end counts as the dependency's return.

    Ending on a count rather than a clock makes the outcome deterministic: a relay that waits
    longer after every broken connection, although each one delivered frames, is in its longest
    wait yet when the storm ends (with a 1 s base doubling per failure: 8-16 s after four), while
    one that starts over after a connection that delivered frames is back within ~1 s."""
    s = rig.settings
    hosts = rig.fleet.hosts
    down = time.monotonic()
    drops = {h.hostname: 0 for h in hosts}
    known = {h.hostname: h.connections_total for h in hosts}
    # the connections open when the storm starts have delivered frames for a while: drop them first
    opened: dict[str, float | None] = {h.hostname: down - s.storm_hold for h in hosts}
    while time.monotonic() - down < s.storm_max and min(drops.values()) < s.storm_drops:
        now = time.monotonic()
        for host in hosts:
            name = host.hostname
            if host.connections_total != known[name]:  # a new connection since we last looked
                known[name] = host.connections_total
                opened[name] = now
            since = opened[name]
            if since is not None and now - since >= s.storm_hold and host.subscriber_count:
                host.drop_connections()
                drops[name] += 1
                opened[name] = None  # count the next connection, not this one again
        await asyncio.sleep(0.05)
    back = time.monotonic()
    return FaultTimes(down, back, notes=[
        f"storm: {back - down:.1f} s, connections dropped per host {sorted(drops.values())}, "
        f"{sum(h.connections_total for h in hosts)} connections accepted in all"])


async def ingest_kill_unpublished(rig: Rig) -> FaultTimes:
    """(h) scale-out: the ingest dies between commit and publish. It is SIGKILLed and started again
    as ``tests.faults.faulty_relay`` (its publish step wrapped): it commits its
    third batch to PostgreSQL and ends the process (exit 137, no cleanup) instead of publishing
    it. It is then started a third time, normally ("back" when ``/_health`` answers). The fan-outs
    must read the never-published batch from the store before delivering anything after it. The
    final check proves the hole existed: the store holds seqs the stream never got."""
    from tests.faults.faulty_relay import EXIT_MESSAGE

    assert rig.redis is not None and rig.writer is not None
    writer = rig.writer
    down = time.monotonic()
    await writer.kill9()
    writer.command = [sys.executable, "-m", "tests.faults.faulty_relay", "3", writer.role]
    try:
        # it may reach its third batch (and exit) before /_health is first polled
        await writer.start(may_exit=True)
        deadline = time.monotonic() + 30.0
        while writer.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # exited through the hook (its log line), not through a crash of its own
        exited = not writer.alive and EXIT_MESSAGE in log_tail(writer.log_path, 200)
    finally:
        writer.command = None
    published = await rig.redis.last_entry_seq()
    committed = await _store_seq(rig)
    restart = time.monotonic()
    await writer.kill9()  # reaps it (or ends it, if it never exited)
    back = await writer.start()

    async def hole_existed() -> list[str]:
        problems = []
        if not exited:
            problems.append("the ingest did not exit through the fault hook at its third publish within 30 s")
        if committed <= published:
            problems.append(f"no committed-but-unpublished event (store seq {committed} when it exited, stream "
                            f"{published}): the scenario tested nothing")
        return problems

    return FaultTimes(down, back, restart, final_checks=[hole_existed],
                      notes=[f"exited before publishing: store seq {committed}, the stream's newest entry "
                             f"{published}"])


async def _store_seq(rig: Rig) -> int:
    """The relay's high-water seq, read from its PostgreSQL."""
    import asyncpg

    conn = await asyncpg.connect(rig.pg.dsn)
    try:
        return int(await conn.fetchval("SELECT value FROM relay_meta WHERE key = 'seq_high_water'") or 0)
    finally:
        await conn.close()


async def _spark_job(rig: Rig, job: str) -> object:
    """Run ``relay spark <job>`` (resync or reconcile of every account) against the rig's database as
    an operator would: its own process, Spark ``local[1]``; returns its ``--json`` summary."""
    import json
    from pathlib import Path

    relay_cli = Path(sys.executable).with_name("relay")
    proc = await asyncio.create_subprocess_exec(
        str(relay_cli), "spark", job, "--db", rig.pg.dsn, "--master", "local[1]", "--plc-url", rig.fleet.plc_url,
        "--scheme", "http", "--allow-private", "--host-rate", "500", "--timeout", "10", "--no-progress", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"relay spark {job} exited {proc.returncode}: {err.decode()[-2000:]}")
    text = out.decode()
    summary: object = json.loads(text[text.index("{"):])  # --json prints the summary last
    return summary


async def _spark_jobs(rig: Rig, *, reconcile: bool) -> dict[str, object]:
    """A reconcile (optionally) and a resync of every account, one after the other."""
    out: dict[str, object] = {}
    if reconcile:
        out["reconcile"] = await _spark_job(rig, "reconcile")
    resync = await _spark_job(rig, "resync")
    out["resync"] = resync.get("totals") if isinstance(resync, dict) else resync
    return out


async def _outbox(rig: Rig) -> list[tuple[str, str, str | None]]:
    import asyncpg

    conn = await asyncpg.connect(rig.pg.dsn)
    try:
        rows = await conn.fetch("SELECT kind, did, outcome FROM spark_repair_outbox ORDER BY id")
    finally:
        await conn.close()
    return [(r["kind"], r["did"], r["outcome"]) for r in rows]


async def spark_behind(rig: Rig) -> FaultTimes:
    """(g) Spark beside the live relay while it is behind: the relay is killed (SIGKILL), the hosts
    keep committing, and a reconcile and a resync of every account run against its database (they
    see every host ahead of the relay and queue findings: ``#sync`` repairs, ``desync`` marks).
    The jobs run as ``relay spark …`` processes, as an operator runs them.
    Then the first host becomes unreachable, the relay restarts and, 1.5 s later (three repair
    passes), the host returns ("back" when the relay is connected to it again); meanwhile a second resync
    runs while the relay catches up under live traffic. Final check: every queued row was handled
    and none was applied — the relay missed nothing, so every finding must turn out ``stale``.
    Applying one, e.g. for the unreachable host's accounts before their commits could be read,
    would turn those accounts into ``#sync`` and drop their commits."""
    assert rig.writer is not None
    down = time.monotonic()
    await rig.writer.kill9()
    await asyncio.sleep(1.0)  # the hosts move ahead of the stopped relay
    behind = await _spark_jobs(rig, reconcile=True)
    queued = await _outbox(rig)
    far = rig.fleet.hosts[0]
    port = int(far.hostname.rsplit(":", 1)[1])
    await far.stop()
    restart = time.monotonic()
    await rig.writer.start()
    live = asyncio.create_task(_spark_jobs(rig, reconcile=False))
    await asyncio.sleep(1.5)
    connections = far.connections_total
    await far.start(port=port)
    returned = time.monotonic()
    # "back" once the relay is connected to the host again (how soon depends on its reconnect
    # backoff to a host that refused it, which is not what this scenario is about)
    await wait_until(lambda: far.connections_total > connections, 35.0)
    back = time.monotonic()

    async def repairs_handled() -> list[str]:
        during = await live
        deadline = time.monotonic() + 60.0
        rows = await _outbox(rig)
        while any(outcome is None for _, _, outcome in rows) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            rows = await _outbox(rig)
        outcomes: dict[str, int] = {}
        for kind, _, outcome in rows:
            outcomes[f"{kind}:{outcome}"] = outcomes.get(f"{kind}:{outcome}", 0) + 1
        times.notes.append(f"relay reconnected to the unreachable host {back - returned:.2f} s after its return; "
                           f"spark while the relay was down: {behind}; while it caught up: {during}; "
                           f"{len(queued)} findings queued while it was down, outbox outcomes {outcomes}")
        problems = []
        if not queued:
            problems.append("the jobs run while the relay was down queued nothing (the scenario tested nothing)")
        if any(outcome is None for _, _, outcome in rows):
            problems.append(f"repairs still pending 60 s after the catch-up: {outcomes}")
        wrong = {k: n for k, n in outcomes.items() if not k.endswith((":stale", ":None"))}
        if wrong:
            problems.append(f"repairs applied although the relay missed nothing: {wrong}")
        return problems

    times = FaultTimes(down, back, restart, final_checks=[repairs_handled])
    return times


SCENARIOS: dict[str, tuple[Fault, bool]] = {
    "pg_kill": (pg_kill, False),
    "pg_fast_restart": (pg_fast_restart, False),
    "pg_down": (pg_down, False),
    "redis_kill": (redis_kill, True),
    "relay_kill": (relay_kill, False),
    "upstream_storm": (upstream_storm, False),
    "spark_behind": (spark_behind, False),
    "ingest_kill_unpublished": (ingest_kill_unpublished, True),
}


async def run_named(name: str, settings: Settings | None = None) -> ScenarioResult:
    """Run the scenario called ``name`` (a key of :data:`SCENARIOS`)."""
    fault, scale_out = SCENARIOS[name]
    return await run_scenario(name, fault, settings, scale_out=scale_out)
