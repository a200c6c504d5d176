"""Replay crowd: relay RSS before, at peak and after N WebSocket clients replay a window at once.

A PostgreSQL schema holds a window of ``--events`` (default 10,000) real simulator ``#commit``
frames (loaded as ``bench/replay.py`` does); ``relay serve`` runs on it with no upstream, and
``--rounds`` times ``--clients`` consumers (default 300, once) connect together with ``cursor=0``,
each reading the whole window, then leaving. The relay's RSS (process tree) is sampled every
0.1 s. After the last round the relay is left idle for ``--settle`` seconds and its RSS read again.
The outside check this answers: peak at most +512 MB over before, after at most 1.25 x before + 50 MB.

    .venv/bin/python bench/replay_crowd.py [--clients N] [--rounds R] [--events N] [--listener asgi|websockets]

RESULT lines: ``replay_crowd_rss_before_mb``, ``_peak_mb``, ``_after_mb`` (and per round
``replay_crowd_round<i>_peak_mb`` / ``_after_mb``), ``replay_crowd_complete`` (clients that read
every event), ``replay_crowd_seconds`` (per round, mean), ``replay_crowd_budget_peak_mb`` (the
replay budget's own high-water mark, from ``/metrics``).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import PG_DSN, listener_extra, load_average, metric_sum, note, relay, result  # noqa: E402
from bench.replay import load  # noqa: E402

MB = 1024 * 1024


def smaps_mb(pid: int) -> dict[str, float]:
    """Resident MB of ``pid`` by kind of mapping: ``heap`` (the brk heap), ``anon-1MiB`` (CPython's
    small-object arenas), ``anon-big`` (malloc's thread arenas, large blocks), ``anon-other``, ``file``."""
    out: dict[str, float] = {}
    kind = "file"
    with open(f"/proc/{pid}/smaps") as fh:
        for line in fh:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                name = parts[5] if len(parts) > 5 else ""
                size = hi - lo
                kind = ("heap" if name == "[heap]" else "file" if name.startswith("/") else name if name
                        else "anon-1MiB" if size == MB else "anon-big" if size > MB and size % MB == 0
                        else "anon-other")
            elif parts and parts[0] == "Rss:":
                out[kind] = out.get(kind, 0.0) + int(parts[1]) / 1024
    return {k: round(v, 1) for k, v in sorted(out.items())}


async def _client(url: str, events: int, done: list[int]) -> None:
    from bench._rawws import subscribe

    stop = asyncio.Event()
    got = [0]

    def on_message(msg: bytes, t: float) -> None:
        got[0] += 1
        if got[0] >= events:
            stop.set()

    try:
        await subscribe(url, on_message, stop=stop, read_size=1 << 18)
    except OSError as exc:
        note(f"replay_crowd: client failed: {exc!r}")
    if got[0] >= events:
        done.append(1)


async def run(clients: int, rounds: int, events: int, schema: str, settle: float, listener: str,
              env: dict[str, str], smaps: bool = False) -> None:
    url = f"{PG_DSN}?schema={schema}"
    have = await load(url, events)
    note(f"replay_crowd: {have} events stored, {clients} clients x {rounds} rounds")
    async with relay("http://127.0.0.1:9", database_url=url, extra=listener_extra(listener), env=env) as r:
        await asyncio.sleep(2.0)
        before = r.rss()
        if smaps:
            note(f"replay_crowd: before: {smaps_mb(r.proc.pid)}")
        peak = [before]
        sampling = True

        async def sample() -> None:
            while sampling:
                peak[0] = max(peak[0], r.rss())
                await asyncio.sleep(0.1)

        sampler = asyncio.create_task(sample())
        seconds: list[float] = []
        complete = 0
        budget_peak = 0.0
        overall_peak = before
        for i in range(rounds):
            round_peak = peak[0] = r.rss()
            done: list[int] = []
            t0 = time.perf_counter()
            await asyncio.gather(*(_client(r.ws_url + "?cursor=0", have, done) for _ in range(clients)))
            seconds.append(time.perf_counter() - t0)
            complete += len(done)
            round_peak = max(round_peak, peak[0])
            await asyncio.sleep(settle)
            text = await r.metrics()
            budget_peak = max(budget_peak, metric_sum(text, "relay_replay_budget_bytes", state="peak") / MB)
            round_after = r.rss()
            if smaps:
                note(f"replay_crowd: after round {i + 1}: {smaps_mb(r.proc.pid)}")
            note(f"replay_crowd: round {i + 1}: {len(done)}/{clients} complete in {seconds[-1]:.1f} s, "
                 f"peak {round_peak / MB:.0f} MB, after {round_after / MB:.0f} MB")
            result(f"replay_crowd_round{i + 1}_peak_mb", round(round_peak / MB, 1))
            result(f"replay_crowd_round{i + 1}_after_mb", round(round_after / MB, 1))
            overall_peak = max(overall_peak, round_peak)
        sampling = False
        await sampler
        after = r.rss()
    result("replay_crowd_clients", clients)
    result("replay_crowd_events", have)
    result("replay_crowd_complete", complete)
    result("replay_crowd_seconds", round(sum(seconds) / len(seconds), 2))
    result("replay_crowd_rss_before_mb", round(before / MB, 1))
    result("replay_crowd_rss_peak_mb", round(overall_peak / MB, 1))
    result("replay_crowd_rss_after_mb", round(after / MB, 1))
    result("replay_crowd_peak_over_before_mb", round((overall_peak - before) / MB, 1))
    result("replay_crowd_after_limit_mb", round((1.25 * before + 50 * MB) / MB, 1))
    result("replay_crowd_budget_peak_mb", round(budget_peak, 1))
    result("replay_crowd_load_average", load_average())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=300)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--events", type=int, default=10_000)
    p.add_argument("--schema", default="bench_replay_crowd")
    p.add_argument("--settle", type=float, default=5.0, help="seconds idle before reading RSS after a round")
    p.add_argument("--listener", choices=["asgi", "websockets"], default="asgi")
    p.add_argument("--smaps", action="store_true", help="note the relay's resident MB by kind of mapping")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment for the relay (e.g. RELAY_REPLAY_BUFFER_MB=64)")
    a = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, a.clients * 2 + 256)), hard))
    env = dict(kv.split("=", 1) for kv in a.env)
    asyncio.run(run(a.clients, a.rounds, a.events, a.schema, a.settle, a.listener, env, a.smaps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
