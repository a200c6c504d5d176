"""Fan-out: 50 consumers at 2,000 events/s — latency and relay CPU per delivered frame, compared in
the same run with a plain ``websockets`` broadcast of the same frames.

Phases (one simulator, one ``relay serve`` child, consumers in a separate child process that
parses WebSocket frames cheaply, see ``bench/_rawws.py``):

1. relay, 1 consumer, ``--rate`` commits/s for ``--seconds`` → relay CPU with no fan-out;
2. relay, ``--consumers`` consumers, same rate and length → latency (simulator send → consumer
   receive, 5 recording consumers) and relay CPU; the marginal fan-out cost per delivered frame is
   (CPU₂ − CPU₁) / (frames₂ − frames₁);
3. baseline: a plain ``websockets`` server (child process) broadcasting phase 2's frames at the
   same rate to the same number of consumers → CPU per delivered frame and latency.

Where the relay's CPU goes: ``fanout_relay_cpu_us_per_event_{main,workers}_{1,n}`` split each
phase's CPU per accepted event between the main process and the validation workers,
``fanout_relay_sys_us_per_frame_marginal`` is the kernel's part of the marginal cost, and
``--profile OUT`` runs the main process under cProfile timed by its main thread's CPU clock
(``bench/_cpuprofile.py``) and prints its CPU by module and its costliest functions (cProfile's
per-call overhead inflates code made of many small calls).

    .venv/bin/python bench/fanout.py [--quick] [--rate 2000] [--consumers 50] [--seconds S] [--profile OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (  # noqa: E402
    CLK_TCK,
    cpu_seconds,
    listener_extra,
    load_average,
    note,
    relay,
    result,
    self_cpu,
    wait_until,
)

#: extra ``relay serve`` flags chosen by --listener
LISTENER: list[str] = []

RECORDING = 5


# -- child: many consumers ------------------------------------------------------------------------
async def consumers_child(url: str, n: int, k: int) -> None:
    from bench._rawws import subscribe
    from firehose.frames import decode_frame

    stop = asyncio.Event()
    counts = [0] * n
    samples: list[tuple[str, str, float]] = []
    connected = [0]

    def make(i: int):  # type: ignore[no-untyped-def]
        if i < k:
            def cb(msg: bytes, t: float) -> None:
                counts[i] += 1
                if b"#commit" in msg[:24]:
                    body = decode_frame(msg).body
                    samples.append((body["repo"], body["rev"], t))
        else:
            def cb(msg: bytes, t: float) -> None:
                counts[i] += 1
        return cb

    def on_connect() -> None:
        connected[0] += 1

    tasks = [asyncio.create_task(subscribe(url, make(i), stop=stop, connected=on_connect)) for i in range(n)]
    await wait_until(lambda: connected[0] >= n or any(t.done() for t in tasks), 60)
    print(f"CONNECTED {connected[0]}", flush=True)
    loop = asyncio.get_running_loop()
    line = asyncio.ensure_future(loop.run_in_executor(None, sys.stdin.readline))
    while not line.done():
        print(f"PROGRESS {counts[0]}", flush=True)
        await asyncio.wait((line,), timeout=0.5)
    stop.set()
    ends = await asyncio.gather(*tasks, return_exceptions=True)
    print(json.dumps({"counts": counts, "samples": samples, "cpu": self_cpu(),
                      "ends": [str(e) for e in ends[:3]]}), flush=True)


# -- child: plain websockets broadcast ----------------------------------------------------------
async def baseline_child(frames_file: str, rate: float, n: int) -> None:
    from websockets.asyncio.server import broadcast, serve

    frames: list[bytes] = pickle.loads(Path(frames_file).read_bytes())
    conns: set = set()

    async def handler(ws) -> None:  # type: ignore[no-untyped-def]
        conns.add(ws)
        try:
            await ws.wait_closed()
        finally:
            conns.discard(ws)

    async with serve(handler, "127.0.0.1", 0, compression=None, ping_interval=None) as server:
        port = server.sockets[0].getsockname()[1]
        print(f"PORT {port}", flush=True)
        await wait_until(lambda: len(conns) >= n, 60, 0.02)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)  # GO
        cpu0 = self_cpu()
        t0 = time.perf_counter()
        sent_at: list[float] = []
        i = 0
        while i < len(frames):
            due = min(len(frames), int((time.perf_counter() - t0) * rate) + 1)
            now = time.time()
            while i < due:
                broadcast(conns, frames[i])
                sent_at.append(now)
                i += 1
            await asyncio.sleep(0.005)
        await asyncio.sleep(1.0)
        print(json.dumps({"cpu": self_cpu() - cpu0, "sent": len(frames), "sent_at": sent_at}), flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)


# -- orchestration ------------------------------------------------------------------------------
class Child:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.progress = 0

    @classmethod
    async def spawn(cls, *args: str) -> Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=1 << 28)
        return cls(proc)

    async def line(self, timeout: float = 120, *, skip_progress: bool = True) -> str:
        assert self.proc.stdout is not None
        while True:
            raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
            if not raw:
                raise RuntimeError("child exited")
            text = raw.decode().strip()
            if text.startswith("PROGRESS "):
                self.progress = int(text.split()[1])
                if skip_progress:
                    continue
            return text

    async def wait_progress(self, target: int, stall: float = 15.0) -> bool:
        """Follow PROGRESS lines until consumer 0 has ``target`` frames or stops advancing."""
        last, last_t = -1, time.monotonic()
        while self.progress < target:
            await self.line(stall + 5, skip_progress=False)
            if self.progress != last:
                last, last_t = self.progress, time.monotonic()
            elif time.monotonic() - last_t > stall:
                return False
        return True

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((text + "\n").encode())

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


def _sys_seconds(pid: int) -> float:
    """System (kernel) CPU seconds of one process: socket writes, and on loopback the receiving side
    of TCP too, are charged here."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        return int(fh.read().decode(errors="replace").rsplit(")", 1)[1].split()[12]) / CLK_TCK


def percentiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0] if values else float("nan"),) * 2  # type: ignore[return-value]
    q = statistics.quantiles(values, n=100)
    return statistics.median(values), q[98]


async def phase(fleet, r, url: str, n: int, rate: float, count: int):  # type: ignore[no-untyped-def]
    """Release ``count`` prepared commits at ``rate`` to ``n`` consumers; returns measurements."""
    child = await Child.spawn("--child-consumers", url, str(n), str(min(n, RECORDING)))
    try:
        connected = await child.line()
        note(f"fanout: {connected} consumers on {url}")
        held, fleet._pending = fleet._pending, []
        batch, rest = held[:count], held[count:]
        fleet._pending = batch
        first_truth = [p.truth for p in batch if p.truth is not None]
        expected = sum(1 for t in first_truth if t.verdict == "accept")
        cpu0 = r.cpu() if r is not None else 0.0
        main0 = cpu_seconds([r.proc.pid]) if r is not None else 0.0
        sys0 = _sys_seconds(r.proc.pid) if r is not None else 0.0
        t0 = time.time()
        await fleet.release(rate)
        fleet._pending = rest
        drained = await child.wait_progress(expected)
        note(f"fanout: phase with {n} consumers drained={drained} ({child.progress}/{expected})")
        cpu = (r.cpu() - cpu0) if r is not None else 0.0
        main_cpu = (cpu_seconds([r.proc.pid]) - main0) if r is not None else 0.0
        main_sys = (_sys_seconds(r.proc.pid) - sys0) if r is not None else 0.0
        wall = time.time() - t0
        child.send("STOP")
        data = json.loads(await child.line())
    finally:
        await child.close()
    sent = {(t.did, t.rev): t.sent_at for t in first_truth if t.kind == "#commit"}
    lat = [(tr - sent[(d, rv)]) * 1000 for d, rv, tr in data["samples"] if (d, rv) in sent]
    frames = sum(data["counts"])
    return {"cpu": cpu, "main_cpu": main_cpu, "main_sys": main_sys, "events": expected, "frames": frames, "wall": wall, "latencies": lat,
            "consumer_cpu": data["cpu"], "per_consumer": data["counts"], "batch": batch}


def print_profile(path: str, top: int = 25) -> None:
    """The main process's CPU (cProfile, CPU clock) by source file, then its costliest functions."""
    import pstats

    stats = pstats.Stats(path, stream=sys.stderr)
    by_file: dict[str, float] = {}
    total = 0.0
    for (filename, _line, _name), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        key = filename.split("site-packages/")[-1].replace(str(Path(__file__).resolve().parent.parent) + "/", "")
        by_file[key] = by_file.get(key, 0.0) + tt
        total += tt
    note(f"fanout profile: main thread CPU {total:.2f}s (cProfile, CPU clock), by file (own time):")
    for key, tt in sorted(by_file.items(), key=lambda kv: -kv[1])[:top]:
        note(f"  {100 * tt / max(total, 1e-9):5.1f}%  {tt:7.3f}s  {key}")
    stats.sort_stats("tottime").print_stats(top)


async def run(rate: float, consumers: int, seconds: float, profile: str | None = None) -> None:
    from sim import SimConfig, SimFleet

    count = int(rate * seconds)
    fleet = SimFleet(SimConfig(hosts=4, accounts_per_host=100, seed=2))
    await fleet.start()
    t = time.perf_counter()
    fleet.prepare(2 * count)
    note(f"fanout: pre-generated {2 * count} commits in {time.perf_counter() - t:.1f}s")
    try:
        async with relay(fleet.plc_url, extra=LISTENER, profile=profile) as r:
            await r.crawl([h.hostname for h in fleet.hosts])
            # announcements must be through before measuring
            warm = await Child.spawn("--child-consumers", r.ws_url + "?cursor=0", "1", "0")
            await warm.line()
            await warm.wait_progress(len(fleet.ground_truth) - fleet.pending)
            warm.send("STOP")
            await warm.line()
            await warm.close()
            one = await phase(fleet, r, r.ws_url, 1, rate, count)
            many = await phase(fleet, r, r.ws_url, consumers, rate, count)
    finally:
        await fleet.stop()
    p50, p99 = percentiles(many["latencies"])
    per_frame_total = many["cpu"] / max(1, many["frames"])
    marginal = (many["cpu"] - one["cpu"]) / max(1, many["frames"] - one["frames"])
    # baseline: same frames (the simulator's bytes of phase 2), same rate, same consumers
    frames = [p.entry.frame for p in many["batch"] if p.entry is not None]
    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as fh:
        fh.write(pickle.dumps(frames))
    base = await Child.spawn("--child-baseline", fh.name, str(rate), str(consumers))
    try:
        port = (await base.line()).split()[1]
        cons = await Child.spawn("--child-consumers", f"ws://127.0.0.1:{port}/", str(consumers), str(RECORDING))
        await cons.line()
        base.send("GO")
        await cons.wait_progress(len(frames))
        bdata = json.loads(await base.line(300))
        await asyncio.sleep(0.5)
        cons.send("STOP")
        cdata = json.loads(await cons.line())
        base.send("END")
    finally:
        await base.close()
        Path(fh.name).unlink(missing_ok=True)
    keyed = {}
    for p, ts in zip([p for p in many["batch"] if p.entry is not None], bdata["sent_at"], strict=False):
        if p.truth is not None and p.truth.kind == "#commit":
            keyed[(p.truth.did, p.truth.rev)] = ts
    blat = [(t - keyed[(d, rv)]) * 1000 for d, rv, t in cdata["samples"] if (d, rv) in keyed]
    bframes = sum(cdata["counts"])
    b_per_frame = bdata["cpu"] / max(1, bframes)
    b50, b99 = percentiles(blat)
    result("fanout_load_average", load_average())
    result("fanout_consumers", consumers)
    result("fanout_input_rate", rate)
    result("fanout_delivered_events_per_s_per_consumer", many["frames"] / consumers / max(1e-9, many["wall"]))
    result("fanout_frames_delivered", many["frames"])
    result("fanout_frames_expected", consumers * sum(1 for p in many["batch"] if p.truth and p.truth.verdict == "accept"))
    result("fanout_latency_p50_ms", p50)
    result("fanout_latency_p99_ms", p99)
    result("fanout_relay_cpu_us_per_frame_total", per_frame_total * 1e6)
    result("fanout_relay_cpu_us_per_frame_marginal", marginal * 1e6)
    result("fanout_relay_cpu_cores_1_consumer", one["cpu"] / max(1e-9, one["wall"]))
    result("fanout_relay_cpu_cores_n_consumers", many["cpu"] / max(1e-9, many["wall"]))
    for tag, ph in (("1", one), ("n", many)):
        per_event = 1e6 / max(1, ph["events"])
        result(f"fanout_relay_cpu_us_per_event_main_{tag}", ph["main_cpu"] * per_event)
        result(f"fanout_relay_cpu_us_per_event_workers_{tag}", (ph["cpu"] - ph["main_cpu"]) * per_event)
    result("fanout_relay_sys_us_per_frame_marginal",
           (many["main_sys"] - one["main_sys"]) * 1e6 / max(1, many["frames"] - one["frames"]))
    result("fanout_baseline_cpu_us_per_frame", b_per_frame * 1e6)
    result("fanout_baseline_frames_delivered", bframes)
    result("fanout_baseline_latency_p50_ms", b50)
    result("fanout_baseline_latency_p99_ms", b99)
    result("fanout_cpu_ratio_marginal_vs_baseline", marginal / max(1e-12, b_per_frame))
    result("fanout_cpu_ratio_total_vs_baseline", per_frame_total / max(1e-12, b_per_frame))
    if profile:
        print_profile(profile)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child-consumers":
        asyncio.run(consumers_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--child-baseline":
        asyncio.run(baseline_child(sys.argv[2], float(sys.argv[3]), int(sys.argv[4])))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rate", type=float, default=2000.0)
    p.add_argument("--consumers", type=int, default=50)
    p.add_argument("--seconds", type=float, default=None)
    p.add_argument("--profile", default=None,
                   help="run the relay's main process under cProfile (CPU clock), stats here; prints a summary")
    p.add_argument("--listener", choices=["asgi", "websockets"], default="asgi",
                   help="consumers connect to the main port (asgi) or to a --firehose-bind listener")
    a = p.parse_args()
    LISTENER[:] = listener_extra(a.listener)
    seconds = a.seconds or (2.0 if a.quick else 30.0)
    asyncio.run(run(a.rate, a.consumers, seconds, a.profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
