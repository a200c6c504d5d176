"""The relay's outside limits, measured from outside: the relay runs as its own process
(``relay serve``, SQLite unless said otherwise) and what is measured is what an operator would see
— its process tree's RSS, what consumers receive, what HTTP answers — never the relay's own
accounting (``tests/resources``, ``tests/relay`` and ``tests/faults`` check that).

Scenarios (all by default, or those named), each printing ``RESULT limits_<scenario>_<figure>=…``:

* ``giant``: one simulated host sends ``--giant`` frames of 5.3 MB (the simulator's ``oversized``
  fault: over the 5 MB frame limit, rejected), each followed by ordinary commits, while a
  consumer follows the stream. ``rss_before_mb``, ``rss_peak_over_mb`` (peak less before; target
  ≤ +300), ``rss_after_mb`` (once every marker commit has arrived), ``lost``.
* ``disk_full``: the relay's database on a ``tmpfs`` (``--disk-mb``) filled to the last byte for
  ``--disk-seconds`` (180) while ten hosts offer commits at ``--disk-rate``; then the filler is
  removed. ``rss_peak_over_mb`` (target ≤ +300), ``offered``, ``lost`` (target 0),
  ``drained_s`` (from freeing the disk to the last marker delivered). Needs root (``mount``).
* ``redis_hang``: the relay with its own ``redis-server`` (``--redis-port``) stopped with SIGSTOP
  for ``--hang-seconds`` (20) while ``--hang-rate`` commits/s are offered. ``durable_ratio``:
  events sequenced (``relay_events_sequenced_total``) during the hang over commits offered in it
  (target ≥ 0.8); ``lost`` after SIGCONT (target 0).
* ``slowloris``: ``--slowloris`` connections send request headers a byte every 0.2 s and never
  finish them, under the default header timeout; ``closed`` (how many the relay closed),
  ``closed_max_s`` (target ≤ 30), ``answered_408``, and ``/_health`` on fresh connections
  meanwhile: ``health_p50_ms``, ``health_max_ms``, ``health_failed``.
* ``crawl_limit``: 40 ``requestCrawl`` for 40 distinct live hosts at once, with
  ``--new-hosts-per-day 10``: ``admitted`` (answered 200; target ≤ 10), ``hosts_listed``
  (``listHosts``), ``refused_new_host_limit``.

    .venv/bin/python bench/limits.py                    # every scenario, about 5-6 minutes (loaded)
    .venv/bin/python bench/limits.py giant slowloris    # some of them
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RelayProc, load_average, metric_sum, note, relay, result  # noqa: E402
from bench.soak import Follower  # noqa: E402
from bench.weather import lost_commits, percentile  # noqa: E402
from sim import SimConfig, SimFleet, TruthEvent  # noqa: E402

SCENARIOS = ("giant", "disk_full", "redis_hang", "slowloris", "crawl_limit")


class Peak:
    """Samples the relay's RSS (its whole process tree) every ``every`` s while running."""

    def __init__(self, r: RelayProc, every: float = 0.1) -> None:
        self.r, self.every, self.peak = r, every, 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self.r.rss())
            await asyncio.sleep(self.every)

    def __enter__(self) -> Peak:
        self.peak = self.r.rss()
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        self.peak = max(self.peak, self.r.rss())


async def following(r: RelayProc) -> tuple[Follower, asyncio.Task[None]]:
    follower = Follower(r.ws_url)
    task = asyncio.create_task(follower.run())
    await asyncio.wait_for(follower.connected.wait(), 30)
    return follower, task


async def until(pred: Callable[[], bool], timeout: float) -> bool:
    """Wait (polling every 0.2 s) until ``pred()`` holds; False if ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.2)
    return True


async def settled(fleet: SimFleet, follower: Follower, timeout: float) -> list[TruthEvent]:
    """Marker commits from every active account, waited for: returns the valid commits of the
    whole ground truth the follower has not received (nor a later ``#sync`` of)."""
    markers = await fleet.markers()
    await until(lambda: not lost_commits(markers, follower.arrivals), timeout)
    return lost_commits(fleet.ground_truth, follower.arrivals)


async def quiet_rss(r: RelayProc, seconds: float = 3.0) -> int:
    """The relay's RSS after ``seconds`` without new work (the lowest sample)."""
    low = r.rss()
    for _ in range(int(seconds / 0.25)):
        await asyncio.sleep(0.25)
        low = min(low, r.rss())
    return low


async def giant(a: argparse.Namespace) -> None:
    async with SimFleet(SimConfig(hosts=1, accounts_per_host=4, seed=31)) as fleet, relay(fleet.plc_url) as r:
        follower, task = await following(r)
        await r.crawl([fleet.hosts[0].hostname])
        await fleet.generate(20)
        assert not await settled(fleet, follower, 60), "warm-up commits not delivered"
        before = await quiet_rss(r)
        with Peak(r) as peak:
            for i in range(a.giant):
                await fleet.emit("oversized", fleet.accounts[i % len(fleet.accounts)])
                await fleet.generate(5)
            lost = await settled(fleet, follower, 240)
        after = await quiet_rss(r, 10.0)
        metrics = await r.metrics()
        task.cancel()
    result("limits_giant_frames", a.giant)
    result("limits_giant_frames_rejected", metric_sum(metrics, "relay_verdicts_total", reason="frame_too_large"))
    result("limits_giant_rss_before_mb", round(before / 1e6, 1))
    result("limits_giant_rss_peak_over_mb", round((peak.peak - before) / 1e6, 1))
    result("limits_giant_rss_after_mb", round(after / 1e6, 1))
    result("limits_giant_lost", len(lost))


@contextlib.contextmanager
def small_filesystem(size_mb: int) -> Iterator[Path]:
    """A ``tmpfs`` of ``size_mb`` mounted on a fresh directory (root only)."""
    path = Path(tempfile.mkdtemp(prefix="relay-limits-disk-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        path.rmdir()


def fill(directory: Path) -> Path:
    """Write a filler file until the filesystem has no byte left."""
    filler, chunk = directory / "filler", 1 << 20
    with open(filler, "wb", buffering=0) as fh:
        while chunk:
            try:
                fh.write(b"\0" * chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                chunk //= 2
    return filler


async def disk_full(a: argparse.Namespace) -> None:
    with small_filesystem(a.disk_mb) as disk:
        async with SimFleet(SimConfig(hosts=10, accounts_per_host=5, seed=271)) as fleet, \
                relay(fleet.plc_url, database_url=str(disk / "relay.sqlite")) as r, \
                httpx.AsyncClient(base_url=r.url, timeout=30) as http:
            follower, task = await following(r)
            await r.crawl([h.hostname for h in fleet.hosts])
            assert not await settled(fleet, follower, 60), "warm-up commits not delivered"
            before = await quiet_rss(r)
            with Peak(r) as peak:
                filler = fill(disk)
                offered = await fleet.run(a.disk_rate, a.disk_seconds)
                ready = (await http.get("/_ready")).status_code
                filler.unlink()
                freed = time.monotonic()
                lost = await settled(fleet, follower, 300)
                drained = time.monotonic() - freed
            task.cancel()
    result("limits_disk_full_seconds", a.disk_seconds)
    result("limits_disk_full_offered", offered)
    result("limits_disk_full_ready_status_while_full", ready)
    result("limits_disk_full_rss_before_mb", round(before / 1e6, 1))
    result("limits_disk_full_rss_peak_over_mb", round((peak.peak - before) / 1e6, 1))
    result("limits_disk_full_drained_s", round(drained, 1))
    result("limits_disk_full_lost", len(lost))


async def sequenced(r: RelayProc) -> float:
    return metric_sum(await r.metrics(), "relay_events_sequenced_total")


async def redis_hang(a: argparse.Namespace) -> None:
    from tests.faults.harness import RedisServer

    server = RedisServer(port=a.redis_port)
    await server.start()
    try:
        async with SimFleet(SimConfig(hosts=1, accounts_per_host=6, seed=27)) as fleet, \
                relay(fleet.plc_url, extra=["--redis-url", server.url]) as r:
            follower, task = await following(r)
            await r.crawl([fleet.hosts[0].hostname])
            await fleet.generate(12)
            assert not await settled(fleet, follower, 60), "warm-up commits not delivered"
            n = int(a.hang_rate * a.hang_seconds)
            fleet.prepare(n)
            before = await sequenced(r)
            server.pause()
            try:
                took = await fleet.release(a.hang_rate)
                durable = await sequenced(r) - before  # /metrics answers without Redis
            finally:
                server.resume()
            lost = await settled(fleet, follower, 120)
            task.cancel()
    finally:
        server.resume()
        await server.close()
    result("limits_redis_hang_offered", n)
    result("limits_redis_hang_offered_s", round(took, 1))
    result("limits_redis_hang_durable_ratio", round(durable / n, 3))
    result("limits_redis_hang_lost", len(lost))


async def slowloris(a: argparse.Namespace) -> None:
    async with SimFleet(SimConfig(hosts=1, accounts_per_host=1, seed=5)) as fleet, relay(fleet.plc_url) as r:
        host, port = r.url.removeprefix("http://").split(":")
        closed: list[float] = []
        answers: list[bytes] = []

        async def one() -> None:
            reader, writer = await asyncio.open_connection(host, int(port))
            opened = time.monotonic()

            async def dribble() -> None:
                with contextlib.suppress(ConnectionError):
                    for byte in b"GET /_health HTTP/1.1\r\nhost: relay\r\nx-slow: " + b"a" * 10_000:
                        writer.write(bytes([byte]))
                        await writer.drain()
                        await asyncio.sleep(0.2)

            sender = asyncio.create_task(dribble())
            try:
                answers.append(await reader.read())  # until the relay closes
                closed.append(time.monotonic() - opened)
            except ConnectionError:
                closed.append(time.monotonic() - opened)
            finally:
                sender.cancel()
                writer.close()

        latencies: list[float] = []
        failed = 0
        clients = [asyncio.create_task(one()) for _ in range(a.slowloris)]
        async with httpx.AsyncClient(base_url=r.url, timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) as http:
            while not all(c.done() for c in clients):
                t = time.perf_counter()
                try:
                    ok = (await http.get("/_health")).status_code == 200
                except httpx.HTTPError:
                    ok = False
                latencies.append(time.perf_counter() - t)
                failed += not ok
                await asyncio.sleep(0.25)
                if len(latencies) > 4 * 60:  # a minute: the rest never closed
                    break
        for c in clients:
            c.cancel()
    result("limits_slowloris_connections", a.slowloris)
    result("limits_slowloris_closed", len(closed))
    result("limits_slowloris_answered_408", sum(x.startswith(b"HTTP/1.1 408") for x in answers))
    result("limits_slowloris_closed_max_s", round(max(closed, default=float("inf")), 1))
    result("limits_slowloris_health_p50_ms", round(1000 * percentile(latencies, 0.5), 1))
    result("limits_slowloris_health_max_ms", round(1000 * max(latencies, default=float("nan")), 1))
    result("limits_slowloris_health_failed", failed)


async def crawl_limit(a: argparse.Namespace) -> None:
    async with SimFleet(SimConfig(hosts=40, accounts_per_host=1, seed=40)) as fleet, \
            relay(fleet.plc_url, extra=["--new-hosts-per-day", "10", "--crawl-requests-per-minute", "0"]) as r, \
            httpx.AsyncClient(base_url=r.url, timeout=60) as http:
        answers = await asyncio.gather(*(http.post("/xrpc/com.atproto.sync.requestCrawl", json={"hostname": h.hostname})
                                         for h in fleet.hosts))
        listed = (await http.get("/xrpc/com.atproto.sync.listHosts", params={"limit": 1000})).json()["hosts"]
    result("limits_crawl_limit_requests", len(answers))
    result("limits_crawl_limit_admitted", sum(x.status_code == 200 for x in answers))
    result("limits_crawl_limit_refused_new_host_limit", sum("new_host_limit" in x.text for x in answers))
    result("limits_crawl_limit_hosts_listed", len(listed))


RUNNERS: dict[str, Callable[[argparse.Namespace], Awaitable[None]]] = {
    "giant": giant, "disk_full": disk_full, "redis_hang": redis_hang, "slowloris": slowloris,
    "crawl_limit": crawl_limit,
}


async def run(a: argparse.Namespace) -> None:
    for name in a.scenarios or SCENARIOS:
        t0 = time.monotonic()
        note(f"limits: {name} (load {load_average():.1f})")
        await RUNNERS[name](a)
        note(f"limits: {name} took {time.monotonic() - t0:.0f} s")
    result("limits_load_average", load_average())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenarios", nargs="*", metavar="SCENARIO", help=f"default: all ({', '.join(SCENARIOS)})")
    p.add_argument("--giant", type=int, default=40, help="giant frames sent by the one host")
    p.add_argument("--disk-mb", type=int, default=256, help="size of the tmpfs holding the database")
    p.add_argument("--disk-seconds", type=float, default=180.0, help="how long the disk stays full")
    p.add_argument("--disk-rate", type=float, default=50.0, help="commits/s offered while the disk is full")
    p.add_argument("--redis-port", type=int, default=21379, help="port of the bench's own redis-server")
    p.add_argument("--hang-seconds", type=float, default=20.0)
    p.add_argument("--hang-rate", type=float, default=30.0, help="commits/s offered while Redis is stopped")
    p.add_argument("--slowloris", type=int, default=200, help="slow connections")
    args = p.parse_args()
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
