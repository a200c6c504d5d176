"""Hosts and scrapes: does a Prometheus scrape of a relay following thousands of hosts stall delivery?

Simulator (this process: ``--hosts`` hosts, one account each) → ``relay serve`` (child process,
SQLite) → one consumer (this process). Once every host is followed and its first events are
delivered, commits flow at ``--rate`` per second in phases of ``--phase-seconds``, alternating
*quiet* (nobody asks ``/metrics``) and *scraped* (``/metrics`` fetched every ``--scrape-every`` s,
15 as Prometheus does), ``--rounds`` pairs (quiet, scraped, quiet, scraped…), so each scraped
phase has a quiet neighbour under nearly the same machine load.

Printed as ``RESULT hosts_scrape_<name>=<value>``. The answer, robust on a loaded machine, is
per pair: ``pair<i>_p99_ratio`` (delivery p99 of the scraped phase / of its quiet neighbour; 1.0 =
unchanged) and their median ``p99_ratio_median``; ``cpu_ms_per_scrape_median`` (relay CPU of the
scraped phase minus its quiet neighbour's, per scrape: what a scrape costs the relay);
``loop_stall_ms_scraped_max`` against ``loop_stall_ms_quiet_max`` (the slowest ``/_health`` answer
while a scrape was in flight, against the slowest in the quiet phases: ``/_health`` touches
nothing but the relay's event loop, so its latency is how long the loop was busy; probed every
0.1 s from this process, which also runs the simulator, so both include this process' own lag).
Also, over all phases of a kind: ``delay_p50_s`` / ``delay_p99_s`` / ``delay_max_s``
(``quiet_…``, ``scraped_…``; from the simulator sending a commit to the consumer receiving it),
``scrape_ms_p50`` / ``scrape_ms_max`` (the request as the scraper sees it), ``scrape_bytes``,
``host_series`` (lines of the exposition naming a host), ``lost`` (commits of the phases never
received) and the relay's RSS.

    .venv/bin/python bench/hosts_scrape.py                         # 5,000 hosts, 4 pairs
    .venv/bin/python bench/hosts_scrape.py --hosts 200 --phase-seconds 20 --rounds 1   # a smoke run
    .venv/bin/python bench/hosts_scrape.py --refresh-only          # the host gauges' refresh alone

``--refresh-only`` measures, with no relay running, the CPU a scrape spends refreshing the host
gauges over ``--hosts`` stored hosts (SQLite): ``refresh_ms`` (from the in-memory host board,
``relay.hosts.HostBoard.publish``, plus rendering the exposition) against ``store_pass_ms`` (one
paged read of every host row, what each scrape did before the board), medians of 20 (process CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench._common import load_average, note, relay, result  # noqa: E402
from bench.weather import Arrivals, consume, percentile  # noqa: E402
from sim import SimConfig, SimFleet, TruthEvent  # noqa: E402


@dataclass
class Phase:
    """One quiet or scraped phase: its commits, the relay's CPU seconds over it, the ``/_health``
    probes ``(start, seconds)`` and the scrapes ``(start, end)`` (``time.perf_counter``)."""

    truth: list[TruthEvent] = field(default_factory=list)
    cpu: float = 0.0
    probes: list[tuple[float, float]] = field(default_factory=list)
    scrapes: list[tuple[float, float]] = field(default_factory=list)


async def scraper(url: str, every: float, took: list[float], sizes: list[int],
                  windows: list[tuple[float, float]]) -> None:
    """GET ``url`` every ``every`` s (the first at once) with ``curl``, a process of its own as
    Prometheus is (reading a 1.5 MB answer here would delay this process' simulator and consumer,
    and so the delays measured), recording each request's time, size and ``(start, end)``."""
    while True:
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec("curl", "-s", "-o", "/dev/null", "-w", "%{size_download}",
                                                    "--max-time", "60", url, stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        t1 = time.perf_counter()
        took.append(t1 - t0)
        sizes.append(int(float(out or b"0")))
        windows.append((t0, t1))
        await asyncio.sleep(max(0.0, every - (time.perf_counter() - t0)))


async def prober(url: str, every: float, probes: list[tuple[float, float]]) -> None:
    """GET ``url`` (``/_health``: the relay's event loop and nothing else) every ``every`` s on a
    kept-alive connection, recording ``(start, seconds)`` of each answer."""
    async with httpx.AsyncClient(timeout=60) as http:
        while True:
            t0 = time.perf_counter()
            await http.get(url)
            probes.append((t0, time.perf_counter() - t0))
            await asyncio.sleep(max(0.0, every - (time.perf_counter() - t0)))


def stall_during(phase: Phase) -> float:
    """The slowest probe that overlapped a scrape of ``phase`` (all its probes when it had no scrape)."""
    if not phase.scrapes:
        return max((d for _, d in phase.probes), default=0.0)
    return max((d for t, d in phase.probes if any(t < end and t + d > start for start, end in phase.scrapes)),
               default=0.0)


async def crawl_all(url: str, hostnames: list[str], parallel: int = 16) -> list[str]:
    """requestCrawl every host, ``parallel`` at a time, each on a connection of its own (a kept-alive
    one may be closed by the relay's header timeout just as it is reused), each tried up to three
    times (the relay probes the host first; on a loaded machine a probe can time out). Returns the
    hosts the relay accepted."""
    sem = asyncio.Semaphore(parallel)
    accepted: list[str] = []
    refused: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        async def one(hostname: str) -> None:
            why = ""
            for _ in range(3):
                async with sem:
                    try:
                        r = await http.post("/xrpc/com.atproto.sync.requestCrawl", json={"hostname": hostname})
                    except httpx.TransportError as exc:
                        why = type(exc).__name__
                        continue
                if r.status_code == 200:
                    accepted.append(hostname)
                    return
                why = f"{r.status_code} {r.text[:80]}"
            refused[why] = refused.get(why, 0) + 1

        await asyncio.gather(*(one(h) for h in hostnames))
    if refused:
        note(f"hosts_scrape: requestCrawl refused for {sum(refused.values())} hosts: {refused}")
    return accepted


def delays(phase: list[TruthEvent], arrivals: Arrivals) -> list[float]:
    return [arrivals.commits[(t.did, t.rev)] - t.sent_at for t in phase
            if t.kind == "#commit" and t.verdict == "accept" and t.rev and (t.did, t.rev) in arrivals.commits]


async def run(a: argparse.Namespace) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a listening socket per host here, and the relay's
    fleet = SimFleet(SimConfig(hosts=a.hosts, accounts_per_host=1, seed=a.seed, log_limit=100_000))
    t = time.perf_counter()
    await fleet.start()
    note(f"hosts_scrape: {a.hosts} hosts up in {time.perf_counter() - t:.0f}s")
    arrivals = Arrivals()
    pairs: list[dict[str, Phase]] = []
    took: list[float] = []
    sizes: list[int] = []
    try:
        async with relay(fleet.plc_url) as r:
            connected = asyncio.Event()
            consumer = asyncio.create_task(consume(r.ws_url, arrivals, connected))
            await asyncio.wait_for(connected.wait(), 30)
            t = time.perf_counter()
            followed = set(await crawl_all(r.url, [h.hostname for h in fleet.hosts]))
            firsts = {(t.did, t.rev) for t in fleet.ground_truth if t.kind == "#commit" and t.rev and t.host in followed}
            while not firsts <= arrivals.commits.keys():
                await asyncio.sleep(1.0)
            note(f"hosts_scrape: {len(followed)} hosts followed, first commits delivered in {time.perf_counter() - t:.0f}s")
            among = [acct for acct in fleet.accounts if acct.host.hostname in followed]
            metrics_url = r.url + "/metrics"
            for _ in range(a.rounds):
                pair: dict[str, Phase] = {}
                for kind in ("quiet", "scraped"):
                    phase = pair[kind] = Phase()
                    tasks = [asyncio.create_task(prober(r.url + "/_health", 0.1, phase.probes))]
                    if kind == "scraped":
                        tasks.append(asyncio.create_task(scraper(metrics_url, a.scrape_every, took, sizes,
                                                                 phase.scrapes)))
                    start = len(fleet.ground_truth)
                    cpu = r.cpu()
                    await fleet.run(a.rate, a.phase_seconds)
                    phase.cpu = r.cpu() - cpu
                    phase.truth = [t for t in fleet.ground_truth[start:] if t.host in followed]
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    note(f"hosts_scrape: {kind} phase done, load {load_average():.1f}")
                pairs.append(pair)
            markers = await fleet.markers(among[:50])
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not {(m.did, m.rev) for m in markers} <= arrivals.commits.keys():
                await asyncio.sleep(0.5)
            text = (await httpx.AsyncClient(timeout=60).get(metrics_url)).text
            rss = r.rss()
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
    finally:
        await fleet.stop()
    result("hosts_scrape_hosts", a.hosts)
    result("hosts_scrape_hosts_followed", len(followed))
    result("hosts_scrape_rate", a.rate)
    phases = {kind: [t for pair in pairs for t in pair[kind].truth] for kind in ("quiet", "scraped")}
    ratios: list[float] = []
    per_scrape: list[float] = []
    for i, pair in enumerate(pairs):
        quiet = percentile(delays(pair["quiet"].truth, arrivals), 0.99)
        scraped = percentile(delays(pair["scraped"].truth, arrivals), 0.99)
        ratios.append(scraped / quiet if quiet > 0 else float("nan"))
        result(f"hosts_scrape_pair{i}_p99_ratio", round(ratios[-1], 3))
        n = len(pair["scraped"].scrapes)
        if n:
            per_scrape.append((pair["scraped"].cpu - pair["quiet"].cpu) / n)
            result(f"hosts_scrape_pair{i}_cpu_ms_per_scrape", round(1000 * per_scrape[-1], 1))
    result("hosts_scrape_p99_ratio_median", round(statistics.median(ratios), 3) if ratios else float("nan"))
    result("hosts_scrape_cpu_ms_per_scrape_median",
           round(1000 * statistics.median(per_scrape), 1) if per_scrape else float("nan"))
    result("hosts_scrape_loop_stall_ms_scraped_max", round(1000 * max(stall_during(p["scraped"]) for p in pairs), 1))
    result("hosts_scrape_loop_stall_ms_quiet_max", round(1000 * max(stall_during(p["quiet"]) for p in pairs), 1))
    for kind, truth in phases.items():
        d = delays(truth, arrivals)
        result(f"hosts_scrape_{kind}_commits", len(d))
        result(f"hosts_scrape_{kind}_delay_p50_s", round(percentile(d, 0.50), 4))
        result(f"hosts_scrape_{kind}_delay_p99_s", round(percentile(d, 0.99), 4))
        result(f"hosts_scrape_{kind}_delay_max_s", round(max(d, default=float("nan")), 4))
    result("hosts_scrape_scrapes", len(took))
    result("hosts_scrape_scrape_ms_p50", round(1000 * percentile(took, 0.5), 1))
    result("hosts_scrape_scrape_ms_max", round(1000 * max(took, default=float("nan")), 1))
    result("hosts_scrape_scrape_bytes", max(sizes, default=0))
    result("hosts_scrape_host_series", sum(1 for line in text.splitlines() if 'host="' in line))
    expected = sum(1 for tr in phases["quiet"] + phases["scraped"] if tr.kind == "#commit" and tr.verdict == "accept")
    result("hosts_scrape_lost", expected - sum(len(delays(p, arrivals)) for p in phases.values()))
    result("hosts_scrape_relay_rss_mb", round(rss / 1e6, 1))
    result("hosts_scrape_load_average", load_average())


async def refresh_only(hosts: int) -> None:
    """See the module docstring (``--refresh-only``)."""
    import tempfile

    from backfill.sqlite_store import SqliteStore
    from backfill.types import HostState
    from relay.config import RelayConfig
    from relay.hosts import HostBoard, HostPolicy
    from relay.metrics import RelayMetrics

    with tempfile.TemporaryDirectory(prefix="hosts-refresh-") as tmp:
        store = await SqliteStore.open(str(Path(tmp) / "relay.sqlite"))
        await store.migrate()
        try:
            for i in range(hosts):
                await store.upsert_host(HostState(hostname=f"pds{i:05d}.example", status="active", account_count=i % 7))
            policy = HostPolicy(RelayConfig())
            board = HostBoard(store, policy)
            await board.ensure_loaded()
            metrics = RelayMetrics()
            refresh: list[float] = []
            passes: list[float] = []
            for i in range(20):
                board.add_accounts({f"pds{i:05d}.example": 1})  # a value changed since the last scrape
                t = time.process_time()
                board.publish(metrics)
                metrics.render()
                refresh.append(time.process_time() - t)
                t = time.process_time()
                after: str | None = None
                while True:
                    page = await store.list_hosts(after=after, limit=500)
                    if len(page) < 500:
                        break
                    after = page[-1].hostname
                passes.append(time.process_time() - t)
        finally:
            await store.close()
    result("hosts_scrape_refresh_hosts", hosts)
    result("hosts_scrape_refresh_ms", round(1000 * statistics.median(refresh), 2))
    result("hosts_scrape_store_pass_ms", round(1000 * statistics.median(passes), 2))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=5000)
    p.add_argument("--rate", type=float, default=100.0, help="commits per second over the fleet")
    p.add_argument("--phase-seconds", type=float, default=45.0)
    p.add_argument("--rounds", type=int, default=4, help="pairs of quiet and scraped phases")
    p.add_argument("--scrape-every", type=float, default=15.0)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--refresh-only", action="store_true", help="measure the host gauges' refresh alone")
    a = p.parse_args()
    asyncio.run(refresh_only(a.hosts) if a.refresh_only else run(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
