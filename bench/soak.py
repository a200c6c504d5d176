"""Soak: the relay for a long run at a few hundred commits/s with the simulator's fault modes on and
consumers joining and leaving; does its memory stay flat, and is anything lost or sent twice?

Simulator (this process: ``--hosts`` hosts, ``--accounts`` accounts in all, twelve fault modes on
every host at the rates of ``FAULTS`` or ``--faults``) → ``relay serve`` (child process, SQLite
unless ``--db postgres``) → consumers (this process):

* one *follower* that reads everything from cursor 0 and reconnects from its last seq whenever it
  is cut off: the judge of loss, duplicates and delay;
* a *crowd* that changes all the time: every ``--churn-every`` s one consumer joins (up to
  ``--crowd`` at once) and stays 5–60 s; in turn it is live, replaying from a cursor 1,000–20,000
  events back, slow (sleeps 20 ms per frame) or stalled (never reads: the relay must cut it).

Commits flow at ``--rate`` per second for ``--minutes`` (default 60); then the faults stop and
every active account posts a marker commit (each account's order is kept, so once its marker has
arrived nothing it sent before is still coming).

Printed as ``RESULT soak_<name>=<value>``:

* ``rss_slope_mb_per_min``: least-squares slope of the relay's RSS (main process and workers,
  sampled every 5 s) after the warm-up (``--warmup`` minutes, default a quarter of the run, at
  most 10) until the commits stop (goal ≤ 0.1); ``rss_slope_main_mb_per_min`` and
  ``rss_slope_workers_mb_per_min`` split it between the main process and the validation workers;
  ``rss_floor_slope_mb_per_min`` (and ``_main_``/``_workers_``) beside them: the slope of the
  RSS's floor, the lowest sample of each 5 minutes (see :func:`floor_slope_per_minute`: the
  trimmer's saw-tooth, 32 MiB high, moves a raw slope by its phase at either end);
  ``rss_peak_mb``, ``rss_after_warmup_mb``, ``rss_end_mb`` beside it;
* ``lost``: valid commits (ground truth ``accept``) the follower never received, not counting
  those covered by a later ``#sync`` of their account (a repair of a broken chain) (goal: 0);
  ``replaced_by_sync`` beside it;
* ``duplicates``: frames received twice (same seq) plus commits received under two seqs;
* ``delay_p50_s`` / ``delay_p99_s``: from the simulator sending a valid commit to the follower
  receiving it (every commit of the run, the fault-delayed ones included);
* the crowd's ``joins``, ``cut_too_slow`` (closed by the relay) and the relay's own counters;
* ``harness_rss_peak_mb``: the largest RSS of this process (simulator, follower, crowd), sampled
  with the relay's; each host keeps ``LOG_BYTES_PER_HOST`` of its stream for backfill.

With ``--diagnose DIR`` every relay process (main and validation workers) loads
``bench/_diagnose/sitecustomize.py`` and, when the warm-up ends, every ``--dump-every`` minutes
after and when the commits stop, writes what its memory is made of (anonymous/file RSS, C heap in use, SQLite's allocations, Python blocks, object counts by
type, the sizes of the bounded caches; allocation sites too with ``--tracemalloc``); the last dump
also gives free heap memory back (``malloc_trim``) and says what that returned. Each dump and the
differences between the first and the last are printed to stderr.

    .venv/bin/python bench/soak.py                    # one hour, 200 commits/s
    .venv/bin/python bench/soak.py --minutes 10       # what BENCHMARKS.md reports on a loaded machine

On a shared machine ``nice`` on everything else does not give the soak the CPU: with the kernel's
autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled`` = 1) niceness counts only
within a session, and each session gets an equal share; raise the soak's own session instead
(``echo -10 > /proc/$PID/autogroup``, which covers the relay it starts) or the commit rate offered
is not reached (``soak_commit_rate`` says what was).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (  # noqa: E402
    PG_DSN,
    ROOT,
    CountingConsumer,
    load_average,
    metric_sum,
    note,
    relay,
    result,
    rss_bytes,
)
from bench.weather import Arrivals, lost_commits, percentile, undelivered_commits  # noqa: E402
from sim import SimConfig, SimFleet  # noqa: E402

#: fault kind → probability per generated commit (per emitted frame for slow/stall/disconnect)
FAULTS: dict[str, float] = {
    "bad_signature": 0.005, "broken_chain": 0.002, "missing_block": 0.002, "duplicate": 0.005,
    "replay": 0.005, "unreadable": 0.001, "slow": 0.01, "stall": 0.0002, "disconnect": 0.0005,
    "key_rotation": 0.001, "deactivate": 0.001, "migration": 0.0005,
}
SAMPLE_EVERY = 5.0
#: each simulated host's backfill window, in frame bytes: minutes of its stream, far more than the
#: relay's reconnections need, and the harness's own memory stays bounded however long the run
LOG_BYTES_PER_HOST = 16 << 20
CROWD_KINDS = ("live", "replay", "slow", "stalled")


@dataclass
class Follower:
    """Reads the whole stream from cursor 0, reconnecting after any close from its last seq."""

    url: str
    arrivals: Arrivals = field(default_factory=Arrivals)
    seqs: set[int] = field(default_factory=set)
    last_seq: int = 0
    duplicate_seqs: int = 0
    connections: int = 0
    connected: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        from websockets.asyncio.client import connect

        from firehose.frames import decode_frame

        while True:
            try:
                async with connect(f"{self.url}?cursor={self.last_seq}", max_size=None, compression=None,
                                   open_timeout=30, ping_interval=None) as ws:
                    self.connections += 1
                    self.connected.set()
                    async for msg in ws:
                        now = time.time()
                        assert isinstance(msg, bytes)
                        frame = decode_frame(msg, strict=False)
                        body = frame.body
                        seq = body.get("seq") if isinstance(body, dict) else None
                        if frame.is_error or not isinstance(seq, int) or frame.t == "#info":
                            continue
                        if seq in self.seqs:
                            self.duplicate_seqs += 1
                            continue
                        self.seqs.add(seq)
                        self.last_seq = max(self.last_seq, seq)
                        self.arrivals.frames += 1
                        if frame.t == "#commit":
                            key = (body["repo"], body["rev"])
                            if key in self.arrivals.commits:
                                self.arrivals.duplicates += 1
                            else:
                                self.arrivals.commits[key] = now
                        elif frame.t == "#sync":
                            did = body["did"]
                            self.arrivals.syncs[did] = max(self.arrivals.syncs.get(did, ""), body["rev"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any close: resume from the last seq
                note(f"soak: follower reconnects after {type(exc).__name__}: {str(exc)[:80]}")
            await asyncio.sleep(0.2)


@dataclass
class Crowd:
    """Consumers joining and leaving: one joins every ``every`` s while fewer than ``size`` are on."""

    url: str
    follower: Follower
    size: int
    every: float
    rng: random.Random
    joins: dict[str, int] = field(default_factory=dict)
    cut: int = 0
    on: set[asyncio.Task[None]] = field(default_factory=set)

    async def run(self) -> None:
        while True:
            if len(self.on) < self.size:
                task = asyncio.create_task(self._one(self.rng.choice(CROWD_KINDS), self.rng.uniform(5, 60)))
                self.on.add(task)
                task.add_done_callback(self.on.discard)
            await asyncio.sleep(self.every)

    async def _one(self, kind: str, stay: float) -> None:
        self.joins[kind] = self.joins.get(kind, 0) + 1
        cursor = max(0, self.follower.last_seq - self.rng.randint(1000, 20_000)) if kind == "replay" else None
        consumer = CountingConsumer(self.url, cursor=cursor, read_delay=0.02 if kind == "slow" else 0.0,
                                    stalled=kind == "stalled").start()
        try:
            await asyncio.sleep(stay)
        finally:
            if consumer.closed_reason:
                self.cut += 1
            await consumer.stop()

    async def stop(self) -> None:
        for task in list(self.on):
            task.cancel()
        await asyncio.gather(*self.on, return_exceptions=True)


def slope_per_minute(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) samples, in MB per minute (nan with < 2 samples)."""
    if len(samples) < 2:
        return float("nan")
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    cov = sum((t - mt) * (v - mv) for t, v in samples)
    return 60.0 * cov / var if var else float("nan")


def floor_slope_per_minute(samples: list[tuple[float, float]], window: float = 300.0) -> float:
    """Slope (MB per minute) of the RSS's floor: the least-squares line through the lowest sample of
    each consecutive ``window`` seconds (from the first sample on; a last window shorter than half
    of ``window`` is left out). The trimmer (``firehose.memtrim``) gives free heap back only once
    32 MiB of it lie resident, so the raw RSS is a saw-tooth of that height whose phase at either
    end of the run moves a raw slope by up to its height over the run's length; the floor is what
    the process holds right after giving back what it does not use. Both are printed: a flat
    floor under a rising raw slope says free heap waiting for a trim, a rising floor says growth."""
    if not samples:
        return float("nan")
    t0, t_end = samples[0][0], samples[-1][0]
    lows: dict[int, tuple[float, float]] = {}
    for t, v in samples:
        k = int((t - t0) // window)
        if (k + 0.5) * window > t_end - t0 + 1e-9 and k > 0:
            continue  # the last window, shorter than half
        if k not in lows or v < lows[k][1]:
            lows[k] = (t, v)
    return slope_per_minute(sorted(lows.values()))


def diagnose(pids: list[int], directory: Path, label: str, *, trim: bool = False) -> None:
    """Ask every relay process to describe its memory (see ``bench/_diagnose``); with ``trim``
    each also gives its free heap memory back afterwards and says what that returned."""
    if trim:
        (directory / "trim").touch()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR2)
        except ProcessLookupError:
            continue
    note(f"soak: memory dumps requested ({label}) from {len(pids)} processes")


def diagnose_diff(directory: Path) -> None:
    """Print, per process, what grew between its first and its last dump."""
    by_pid: dict[str, list[Path]] = {}
    for path in sorted(directory.glob("*-*.json"), key=lambda p: int(p.stem.split("-")[1])):
        by_pid.setdefault(path.stem.split("-")[0], []).append(path)
    for pid, paths in by_pid.items():
        if len(paths) < 2:
            continue
        a, b = (json.loads(p.read_text()) for p in (paths[0], paths[-1]))
        sizes = " ".join(f"{k} {(b.get(k, 0) - a.get(k, 0)) / 1e6:+.1f} MB"
                         for k in ("VmRSS", "RssAnon", "RssFile", "heap_in_use", "heap_free", "sqlite_memory", "traced"))
        note(f"soak: pid {pid} {' '.join(b['argv'])}: {sizes}, python blocks {b['py_blocks'] - a['py_blocks']:+d}")
        for path in paths:
            doc = json.loads(path.read_text())
            extra = {k: doc[k] for k in ("mst_key_heights_cached", "did_keys_cached") if k in doc}
            trimmed = f", after malloc_trim {doc['VmRSS_after_trim'] / 1e6:.1f}" if "VmRSS_after_trim" in doc else ""
            note(f"soak:   dump {path.stem}: VmRSS {doc['VmRSS'] / 1e6:.1f} MB{trimmed}, heap in use "
                 f"{doc.get('heap_in_use', 0) / 1e6:.1f} free {doc.get('heap_free', 0) / 1e6:.1f}, sqlite "
                 f"{doc.get('sqlite_memory', 0) / 1e6:.1f}, python blocks {doc['py_blocks']}, {extra}")
        types = {t: b["types"].get(t, 0) - a["types"].get(t, 0) for t in set(a["types"]) | set(b["types"])}
        grew = {k: b.get("containers", {}).get(k, 0) - a.get("containers", {}).get(k, 0)
                for k in set(a.get("containers", {})) | set(b.get("containers", {}))}
        note("soak:   containers " + ", ".join(f"{k} {d:+d} (now {b.get('containers', {}).get(k, 0)})"
                                              for k, d in sorted(grew.items(), key=lambda kv: -abs(kv[1]))[:12])
             + f"; asyncio tasks {a.get('asyncio_tasks')} -> {b.get('asyncio_tasks')}")
        note("soak:   objects " + ", ".join(f"{t} {d:+d}" for t, d in sorted(types.items(), key=lambda kv: -abs(kv[1]))[:12]))
        if "sites" in b and "sites" in a:
            before = {site: size for site, size, _ in a["sites"]}
            grown = sorted(((size - before.get(site, 0), site) for site, size, _ in b["sites"]), reverse=True)[:10]
            for delta, site in grown:
                note(f"soak:   {delta / 1e6:+.2f} MB at {site}")


def parse_faults(text: str) -> dict[str, float]:
    """``kind=rate,…`` → dict; ``none`` switches every fault off."""
    if text.strip() == "none":
        return {}
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, rate = part.partition("=")
        out[kind] = float(rate)
    return out


async def run(a: argparse.Namespace) -> None:
    rng = random.Random(a.seed)
    per_host = max(1, a.accounts // a.hosts)
    fleet = SimFleet(SimConfig(hosts=a.hosts, accounts_per_host=per_host, seed=a.seed, log_limit=200_000,
                                 log_bytes=LOG_BYTES_PER_HOST))
    await fleet.start()
    faults = parse_faults(a.faults) if a.faults is not None else FAULTS
    seconds = a.minutes * 60
    warmup = 60 * (a.warmup if a.warmup is not None else min(10.0, a.minutes / 4))
    database_url = f"{PG_DSN}?schema=bench_soak_{int(time.time())}" if a.db == "postgres" else None
    samples: list[tuple[float, float]] = []
    harness_peak = rss_bytes([os.getpid()]) / 1e6  # this process: simulator, follower and crowd
    main_samples: list[tuple[float, float]] = []  # the main process alone (the rest: validation workers)
    sample_file = open(a.samples, "w", encoding="utf-8") if a.samples else None  # noqa: SIM115 - written all run
    env: dict[str, str] = {}
    if a.diagnose:
        Path(a.diagnose).mkdir(parents=True, exist_ok=True)
        env = {"PYTHONPATH": str(ROOT / "bench" / "_diagnose"), "SOAK_DIAGNOSE_DIR": str(Path(a.diagnose).resolve())}
        if a.tracemalloc:
            env["PYTHONTRACEMALLOC"] = "1"
    try:
        async with relay(fleet.plc_url, database_url=database_url, extra=shlex.split(a.relay_args), env=env) as r:
            follower = Follower(r.ws_url)
            tasks = [asyncio.create_task(follower.run())]
            await asyncio.wait_for(follower.connected.wait(), 30)
            await r.crawl([h.hostname for h in fleet.hosts])
            for host in fleet.hosts:
                for kind, rate in faults.items():
                    host.set_fault(kind, rate)
            crowd = Crowd(r.ws_url, follower, a.crowd, a.churn_every, rng)
            tasks.append(asyncio.create_task(crowd.run()))
            t0 = time.monotonic()
            start_truth = len(fleet.ground_truth)
            producer = asyncio.create_task(fleet.run(a.rate, seconds))
            next_note = 60.0
            next_dump = warmup
            while not producer.done():
                t = time.monotonic() - t0
                samples.append((t, r.rss() / 1e6))
                main_samples.append((t, rss_bytes([r.proc.pid]) / 1e6))
                if sample_file is not None:  # as it is taken: a run cut short keeps what it measured
                    sample_file.write(f"{t:.1f} {samples[-1][1]:.1f} {main_samples[-1][1]:.1f}\n")
                    sample_file.flush()
                harness_peak = max(harness_peak, rss_bytes([os.getpid()]) / 1e6)
                if a.diagnose and t >= next_dump:
                    diagnose(r.refresh_pids(), Path(a.diagnose), f"at {t / 60:.1f} min")
                    next_dump += 60 * a.dump_every
                if t >= next_note:
                    next_note += 60.0
                    note(f"soak: {t / 60:.0f} min rss {samples[-1][1]:.0f} MB (harness "
                         f"{rss_bytes([os.getpid()]) / 1e6:.0f} MB), follower at seq "
                         f"{follower.last_seq}, crowd {len(crowd.on)}, load {load_average():.1f}")
                await asyncio.sleep(SAMPLE_EVERY)
            made = await producer
            live = fleet.ground_truth[start_truth:]
            per_process = {pid: rss_bytes([pid]) / 1e6 for pid in r.refresh_pids()}
            if a.diagnose:
                diagnose(r.pids, Path(a.diagnose), "as the commits stop", trim=True)
            await crowd.stop()
            for host in fleet.hosts:
                host.faults.clear()
            markers = await fleet.markers()
            deadline = time.monotonic() + a.settle
            while time.monotonic() < deadline and lost_commits(markers, follower.arrivals):
                await asyncio.sleep(0.5)
            note(f"soak: markers {len(markers) - len(lost_commits(markers, follower.arrivals))}/{len(markers)} arrived")
            rss_end = r.rss() / 1e6
            metrics = await r.metrics()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await fleet.stop()
    arrivals = follower.arrivals
    delays = [arrivals.commits[(tr.did, tr.rev)] - tr.sent_at for tr in live
              if tr.kind == "#commit" and tr.verdict == "accept" and tr.rev and (tr.did, tr.rev) in arrivals.commits]
    lost = lost_commits(fleet.ground_truth, arrivals)
    after = [(t, v) for t, v in samples if t >= warmup]
    main_after = [(t, v) for t, v in main_samples if t >= warmup]
    workers_after = [(t, v - m) for (t, v), (_, m) in zip(samples, main_samples, strict=True) if t >= warmup]
    result("soak_minutes", a.minutes)
    result("soak_commit_rate", made / seconds)
    result("soak_fault_modes", len(faults))
    result("soak_rss_slope_mb_per_min", round(slope_per_minute(after), 3))
    result("soak_rss_slope_main_mb_per_min", round(slope_per_minute(main_after), 3))
    result("soak_rss_slope_workers_mb_per_min", round(slope_per_minute(workers_after), 3))
    result("soak_rss_floor_slope_mb_per_min", round(floor_slope_per_minute(after), 3))
    result("soak_rss_floor_slope_main_mb_per_min", round(floor_slope_per_minute(main_after), 3))
    result("soak_rss_floor_slope_workers_mb_per_min", round(floor_slope_per_minute(workers_after), 3))
    result("soak_rss_start_mb", round(samples[0][1], 1) if samples else float("nan"))
    result("soak_rss_after_warmup_mb", round(after[0][1], 1) if after else float("nan"))
    result("soak_rss_end_mb", round(rss_end, 1))
    result("soak_rss_peak_mb", round(max([v for _, v in samples] + [rss_end]), 1))
    main_pid = min(per_process)
    result("soak_rss_main_process_mb", round(per_process[main_pid], 1))
    harness_peak = max(harness_peak, rss_bytes([os.getpid()]) / 1e6)
    result("soak_harness_rss_peak_mb", round(harness_peak, 1))
    result("soak_rss_workers_mb", round(sum(v for pid, v in per_process.items() if pid != main_pid), 1))
    result("soak_commits_expected", sum(1 for tr in fleet.ground_truth if tr.kind == "#commit" and tr.verdict == "accept"))
    result("soak_lost", len(lost))
    result("soak_replaced_by_sync", len(undelivered_commits(fleet.ground_truth, arrivals)) - len(lost))
    result("soak_duplicates", follower.duplicate_seqs + arrivals.duplicates)
    result("soak_delay_p50_s", round(percentile(delays, 0.50), 3))
    result("soak_delay_p99_s", round(percentile(delays, 0.99), 3))
    result("soak_follower_connections", follower.connections)
    result("soak_crowd_joins", sum(crowd.joins.values()))
    result("soak_crowd_cut_too_slow", crowd.cut)
    result("soak_relay_too_slow_total", metric_sum(metrics, "relay_broadcast_events_total", event="too_slow"))
    result("soak_relay_rejects", metric_sum(metrics, "relay_verdicts_total", kind="reject"))
    result("soak_load_average", load_average())
    for tr in lost[:5]:  # what else happened to the account around it (a fault the verdicts may not foresee)
        mine = [t for t in fleet.ground_truth if t.did == tr.did]
        i = mine.index(tr)
        note(f"soak: lost {tr.host} {tr.did} {tr.kind} rev {tr.rev} sent {tr.sent_at:.1f}; the account's events around it: "
             + "; ".join(f"{t.kind} {t.rev} {t.verdict} {t.reason or ''} {t.fault or ''} {t.host}" for t in mine[max(0, i - 4):i + 3]))
    if a.diagnose:
        diagnose_diff(Path(a.diagnose))
    if sample_file is not None:
        sample_file.close()
    note("soak: rss samples (min, MB): " + " ".join(f"{t / 60:.1f}:{v:.0f}" for t, v in samples[::12]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0, help="length of the run")
    p.add_argument("--warmup", type=float, default=None, help="minutes left out of the slope (default: a quarter, ≤ 10)")
    p.add_argument("--rate", type=float, default=200.0, help="commits per second over the fleet")
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--accounts", type=int, default=400, help="accounts in all (spread over the hosts)")
    p.add_argument("--faults", default=None, help="kind=rate,… instead of FAULTS ('none': no faults)")
    p.add_argument("--crowd", type=int, default=6, help="crowd consumers connected at most at once")
    p.add_argument("--churn-every", type=float, default=5.0, help="seconds between joins")
    p.add_argument("--settle", type=float, default=120.0, help="seconds the markers may take")
    p.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--relay-args", default="", help="extra `relay serve` options")
    p.add_argument("--diagnose", default=None, metavar="DIR", help="dump each relay process's memory make-up here")
    p.add_argument("--tracemalloc", action="store_true", help="with --diagnose: trace Python allocations too (slow)")
    p.add_argument("--samples", default=None, metavar="FILE",
                   help="write every RSS sample here: seconds, relay total MB, main process MB")
    p.add_argument("--dump-every", type=float, default=5.0, help="with --diagnose: minutes between dumps after the warm-up")
    asyncio.run(run(p.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
