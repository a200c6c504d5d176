"""The downstream streams compared, and the JSON stream under a mixed load.

One simulator (this process), one ``relay serve --ws-deflate true`` child (its CPU, with every
descendant, read from ``/proc``), consumers in a separate child process (``bench/_rawws.py``
receivers: cheap, so the figures describe the relay). Each phase releases its own slice of one
batch of commits at ``--rate`` (the simulator's realistic write mix, the same for every phase), waits until consumer 0 has every commit, and reads the relay's CPU. Each phase's commits
are generated before its consumers connect, outside the measured time.

**Modes** (default): for each of

* ``cbor``: ``subscribeRepos``; ``cbor_deflate``: the same with permessage-deflate negotiated;
* ``json``: ``GET /subscribe`` (Jetstream JSON, one message per op); ``json_zstd``: ``?compress=true``;

one phase with a consumer of each mode side by side (the same events), then per mode a phase
with 1 consumer and one with ``--consumers`` consumers, giving

* ``streams_<mode>_bytes_per_event``: bytes on the wire (WebSocket framing included, after the
  handshake) per sequenced event, per consumer, from the side-by-side phase; ``_bytes_per_message``
  likewise per message;
* ``streams_<mode>_relay_cpu_us_per_event_per_consumer``: the marginal relay CPU of one more
  consumer, (CPU_N / events_N - CPU_1 / events_1) / (N - 1); ``_relay_cpu_us_per_event_total_n``:
  all of the relay's CPU (ingest included) per event with N consumers. The pairs of phases run
  ``--repeat`` times, modes interleaved; the medians are reported.

**Mixed** (``--mixed``): 50 JSON consumers (10 unfiltered, 10 ``app.bsky.feed.post``, 10
``app.bsky.feed.*``, 10 likes + follows, 10 ``wantedDids`` of 20 accounts, half of those also
``app.bsky.feed.post``; 17 of them ``compress=true``) at ``--rate`` (2,000) events/s:

* ``streams_mixed_relay_cpu_us_per_delivered_message`` (all of the relay's CPU over every message
  delivered) and ``_marginal`` (over a phase with one unfiltered consumer);
* ``streams_mixed_latency_p50_ms`` / ``_p99_ms``: the simulator sending the commit's frame to a
  consumer receiving its first message (one recording consumer per group);
* ``streams_mixed_release_rate`` (what the simulator managed), ``streams_mixed_drain_lag_s`` (how
  long after the last frame was sent consumer 0 had everything: near 0 when the relay keeps up).

    .venv/bin/python bench/streams.py [--quick] [--modes cbor,cbor_deflate,json,json_zstd]
                                      [--consumers 20] [--rate 1000] [--seconds 15] [--repeat 2]
    .venv/bin/python bench/streams.py --mixed [--quick] [--rate 2000] [--seconds 30] [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import load_average, note, relay, result, self_cpu, wait_until  # noqa: E402
from bench.fanout import Child as FanoutChild  # noqa: E402

MODES = ("cbor", "cbor_deflate", "json", "json_zstd")
SUBSCRIBE_REPOS = "/xrpc/com.atproto.sync.subscribeRepos"


# -- child: the consumers ---------------------------------------------------------------------
async def consumers_child(base: str, specs: list[dict[str, Any]]) -> None:
    """``specs``: ``{"path", "kind": "cbor"|"json", "deflate", "zstd", "record"}`` per consumer."""
    import httpx
    import zstandard

    from bench._rawws import subscribe
    from firehose.frames import decode_frame

    stop = asyncio.Event()
    n = len(specs)
    counts = [0] * n
    wire = [0] * n
    first: list[dict[tuple[str, str], float]] = [{} for _ in range(n)]
    connected = [0]
    decompressor = None
    if any(s["zstd"] and s["record"] for s in specs):
        async with httpx.AsyncClient(base_url=base.replace("ws://", "http://")) as http:
            dictionary = (await http.get("/subscribe/zstd-dictionary")).content
        decompressor = zstandard.ZstdDecompressor(dict_data=zstandard.ZstdCompressionDict(dictionary))

    def make(i: int, spec: dict[str, Any]):  # type: ignore[no-untyped-def]
        seen = first[i]
        if not spec["record"]:
            def count(msg: bytes, t: float) -> None:
                counts[i] += 1
            return count
        if spec["kind"] == "cbor":
            def cbor(msg: bytes, t: float) -> None:
                counts[i] += 1
                if b"#commit" in msg[:24]:
                    body = decode_frame(msg).body
                    seen.setdefault((body["repo"], body["rev"]), t)
            return cbor
        zstd = spec["zstd"]

        def jet(msg: bytes, t: float) -> None:
            counts[i] += 1
            if zstd:
                assert decompressor is not None
                msg = decompressor.decompress(msg)
            ev = json.loads(msg)
            if ev.get("kind") == "commit":
                seen.setdefault((ev["did"], ev["commit"]["rev"]), t)
        return jet

    def on_connect() -> None:
        connected[0] += 1

    def meter(i: int):  # type: ignore[no-untyped-def]
        def add(k: int) -> None:
            wire[i] += k
        return add

    tasks = [asyncio.create_task(subscribe(base + s["path"], make(i, s), stop=stop, connected=on_connect,
                                           deflate=s["deflate"], inflate=s["record"], on_bytes=meter(i)))
             for i, s in enumerate(specs)]
    await wait_until(lambda: connected[0] >= n or any(t.done() for t in tasks), 60)
    print(f"CONNECTED {connected[0]}", flush=True)
    loop = asyncio.get_running_loop()
    line = asyncio.ensure_future(loop.run_in_executor(None, sys.stdin.readline))
    while not line.done():
        print(f"PROGRESS {len(first[0])}", flush=True)
        await asyncio.wait((line,), timeout=0.25)
    stop.set()
    ends = await asyncio.gather(*tasks, return_exceptions=True)
    samples = [[(d, r, t) for (d, r), t in first[i].items()] for i in range(n)]
    print(json.dumps({"counts": counts, "wire": wire, "samples": samples, "cpu": self_cpu(),
                      "ends": sorted({str(e) for e in ends})[:5]}), flush=True)


# -- orchestration --------------------------------------------------------------------------
class Child(FanoutChild):
    """A consumer child of this benchmark (``bench/fanout.py``'s line protocol: CONNECTED, PROGRESS, STOP)."""

    @classmethod
    async def consumers(cls, base: str, specs: list[dict[str, Any]]) -> Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--child", base, json.dumps(specs),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 28)
        return cls(proc)


def spec(kind: str, *, deflate: bool = False, zstd: bool = False, record: bool = False,
         query: list[tuple[str, str]] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    from urllib.parse import urlencode

    params = list(query) + ([("compress", "true")] if zstd else [])
    path = SUBSCRIBE_REPOS if kind == "cbor" else "/subscribe" + (f"?{urlencode(params)}" if params else "")
    return {"path": path, "kind": kind, "deflate": deflate, "zstd": zstd, "record": record}


def mode_specs(mode: str, n: int) -> list[dict[str, Any]]:
    """``n`` consumers of one mode; the first records (progress + latency)."""
    kind = "cbor" if mode.startswith("cbor") else "json"
    return [spec(kind, deflate=mode == "cbor_deflate", zstd=mode == "json_zstd", record=i == 0) for i in range(n)]


def mixed_specs(dids: list[str], seed: int = 50) -> tuple[list[dict[str, Any]], list[str]]:
    """The 50 mixed-filter consumers (one recording consumer per group) and their group names."""
    rng = random.Random(seed)
    wanted = [("wantedDids", d) for d in rng.sample(dids, min(20, len(dids)))]
    groups: list[tuple[str, list[tuple[str, str]], int, list[tuple[str, str]]]] = [
        # name, query, how many compressed, extra query for the second half
        ("all", [], 5, []),
        ("posts", [("wantedCollections", "app.bsky.feed.post")], 2, []),
        ("feed_prefix", [("wantedCollections", "app.bsky.feed.*")], 3, []),
        ("likes_follows", [("wantedCollections", "app.bsky.feed.like"),
                           ("wantedCollections", "app.bsky.graph.follow")], 5, []),
        ("dids", wanted, 2, [("wantedCollections", "app.bsky.feed.post")]),
    ]
    specs: list[dict[str, Any]] = []
    names: list[str] = []
    for name, query, zstd_n, half in groups:
        for i in range(10):
            q = query + (half if i >= 5 else [])
            specs.append(spec("json", zstd=i < zstd_n, record=i == 0, query=q))
            names.append(name)
    return specs, names


def percentiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0] if values else float("nan"),) * 2  # type: ignore[return-value]
    return statistics.median(values), statistics.quantiles(values, n=100)[98]


async def phase(fleet, r, specs: list[dict[str, Any]], count: int, rate: float) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Generate ``count`` commits (held back), connect ``specs``, release the commits at ``rate``; measure."""
    assert not fleet.pending
    t = time.perf_counter()
    fleet.prepare(count)
    note(f"streams: pre-generated {count} commits in {time.perf_counter() - t:.1f}s")
    truths = [p.truth for p in fleet._pending if p.truth is not None and p.truth.verdict == "accept"]
    commits = {(t.did, t.rev) for t in truths if t.kind == "#commit"}
    base = r.url.replace("http://", "ws://")
    child = await Child.consumers(base, specs)
    try:
        note(f"streams: {await child.line()} ({len(specs)} asked)")
        cpu0 = r.cpu()
        t0 = time.monotonic()
        release_s = await fleet.release(rate)
        released = time.monotonic()
        drained = await child.wait_progress(len(commits), stall=20.0)
        done = time.monotonic()
        cpu = r.cpu() - cpu0
        if not drained:
            note(f"streams: consumer 0 stalled at {child.progress}/{len(commits)} commits")
        child.send("STOP")
        data = json.loads(await child.line())
    finally:
        await child.close()
    sent = {(t.did, t.rev): t.sent_at for t in truths if t.kind == "#commit"}
    lat = [(t - sent[(d, rv)]) * 1000 for per in data["samples"] for d, rv, t in per if (d, rv) in sent]
    return {"cpu": cpu, "wall": done - t0, "release_s": release_s, "drain_lag": done - released,
            "events": len(truths), "commits": len(commits), "counts": data["counts"], "wire": data["wire"],
            "latencies": lat, "drained": drained, "consumer_cpu": data["cpu"], "ends": data["ends"]}


async def start_fleet():  # type: ignore[no-untyped-def]
    from sim import SimConfig, SimFleet

    fleet = SimFleet(SimConfig(hosts=4, accounts_per_host=100, seed=15))
    await fleet.start()
    return fleet


async def warm_up(fleet, r) -> None:  # type: ignore[no-untyped-def]
    """Crawl, and wait until the fleet's announcements (identity/account events) are through."""
    await r.crawl([h.hostname for h in fleet.hosts])
    base = r.url.replace("http://", "ws://")
    warm = await Child.consumers(base, [{**spec("cbor", record=True), "path": SUBSCRIBE_REPOS + "?cursor=0"}])
    await warm.line()
    await fleet.generate(50)
    want = {(t.did, t.rev) for t in fleet.ground_truth if t.kind == "#commit" and t.verdict == "accept"}
    await warm.wait_progress(len(want))
    warm.send("STOP")
    await warm.line()
    await warm.close()


async def run_modes(modes: list[str], n: int, rate: float, seconds: float, repeat: int) -> None:
    """Per mode, ``repeat`` pairs of phases (1 consumer, then ``n``); medians over the pairs."""
    count = int(rate * seconds)
    fleet = await start_fleet()
    out: dict[str, dict[str, float]] = {}
    try:
        async with relay(fleet.plc_url, extra=["--ws-deflate", "true"]) as r:
            await warm_up(fleet, r)
            # bytes: one consumer of each mode on the very same events (commits grow as the
            # simulated repositories do, so phases apart would not compare)
            same = await phase(fleet, r, [mode_specs(m, 1)[0] for m in modes], count, rate)
            for i, mode in enumerate(modes):
                out[mode] = {"bytes_per_event": same["wire"][i] / same["events"],
                             "bytes_per_message": same["wire"][i] / max(1, same["counts"][i]),
                             "messages_per_event": same["counts"][i] / same["events"]}
            runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
            for _ in range(repeat):
                for mode in modes:
                    one = await phase(fleet, r, mode_specs(mode, 1), count, rate)
                    many = await phase(fleet, r, mode_specs(mode, n), count, rate)
                    marginal = (many["cpu"] / many["events"] - one["cpu"] / one["events"]) / (n - 1)
                    runs[mode].append({
                        "relay_cpu_us_per_event_per_consumer": marginal * 1e6,
                        "relay_cpu_us_per_event_total_1": one["cpu"] / one["events"] * 1e6,
                        "relay_cpu_us_per_event_total_n": many["cpu"] / many["events"] * 1e6,
                        "latency_p99_ms": percentiles(many["latencies"])[1],
                        "drained": float(one["drained"] and many["drained"]),
                    })
                    note(f"streams: {mode}: {runs[mode][-1]}")
            for mode, got in runs.items():
                out[mode].update({k: statistics.median(x[k] for x in got) for k in got[0]})
                out[mode]["drained"] = min(x["drained"] for x in got)
    finally:
        await fleet.stop()
    result("streams_load_average", load_average())
    result("streams_consumers", n)
    result("streams_input_rate", rate)
    for mode, figures in out.items():
        for name, value in figures.items():
            result(f"streams_{mode}_{name}", value)
    if "cbor" in out:
        for mode in out:
            result(f"streams_{mode}_bytes_vs_cbor", out[mode]["bytes_per_event"] / out["cbor"]["bytes_per_event"])


async def run_mixed(rate: float, seconds: float, profile: str | None) -> None:
    count = int(rate * seconds)
    fleet = await start_fleet()
    try:
        specs, names = mixed_specs([a.did for a in fleet.accounts])
        async with relay(fleet.plc_url, extra=["--ws-deflate", "true"], profile=profile) as r:
            await warm_up(fleet, r)
            one = await phase(fleet, r, [spec("json", record=True)], count, rate)
            many = await phase(fleet, r, specs, count, rate)
    finally:
        await fleet.stop()
    delivered = sum(many["counts"])
    p50, p99 = percentiles(many["latencies"])
    result("streams_mixed_load_average", load_average())
    result("streams_mixed_consumers", len(specs))
    result("streams_mixed_input_rate", rate)
    result("streams_mixed_events", many["events"])
    result("streams_mixed_release_rate", count / many["release_s"])
    result("streams_mixed_drain_lag_s", many["drain_lag"])
    result("streams_mixed_drained", int(many["drained"]))
    result("streams_mixed_messages_delivered", delivered)
    result("streams_mixed_relay_cores", many["cpu"] / many["wall"])
    result("streams_mixed_relay_cpu_us_per_event", many["cpu"] / many["events"] * 1e6)
    result("streams_mixed_relay_cpu_us_per_delivered_message", many["cpu"] / delivered * 1e6)
    result("streams_mixed_relay_cpu_us_per_delivered_message_marginal",
           (many["cpu"] - one["cpu"]) / max(1, delivered - sum(one["counts"])) * 1e6)
    result("streams_mixed_one_consumer_relay_cpu_us_per_event", one["cpu"] / one["events"] * 1e6)
    result("streams_mixed_one_consumer_latency_p99_ms", percentiles(one["latencies"])[1])
    result("streams_mixed_latency_p50_ms", p50)
    result("streams_mixed_latency_p99_ms", p99)
    result("streams_mixed_consumer_process_cpu_s", many["consumer_cpu"])
    for name in dict.fromkeys(names):
        idx = [i for i, g in enumerate(names) if g == name]
        result(f"streams_mixed_messages_per_consumer_{name}", statistics.mean(many["counts"][i] for i in idx))
    if many["ends"]:
        note(f"streams: consumer ends {many['ends']}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        asyncio.run(consumers_child(sys.argv[2], json.loads(sys.argv[3])))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixed", action="store_true", help="50 JSON consumers with mixed filters")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--consumers", type=int, default=20)
    p.add_argument("--repeat", type=int, default=2, help="pairs of phases per mode (medians are reported)")
    p.add_argument("--rate", type=float, default=None)
    p.add_argument("--seconds", type=float, default=None)
    p.add_argument("--profile", default=None, help="cProfile the relay's main process into this file (--mixed)")
    a = p.parse_args()
    seconds = a.seconds or (3.0 if a.quick else 15.0)
    if a.mixed:
        asyncio.run(run_mixed(a.rate or 2000.0, seconds, a.profile))
    else:
        modes = [m for m in a.modes.split(",") if m]
        unknown = set(modes) - set(MODES)
        if unknown:
            p.error(f"unknown modes: {sorted(unknown)}")
        asyncio.run(run_modes(modes, a.consumers, a.rate or 1000.0, seconds, 1 if a.quick else a.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
