"""Shared pieces of the whole-relay benchmarks: run ``relay serve`` as a child process, measure its
CPU and RSS (the process and all its descendants, e.g. validation workers) from ``/proc``, point it
at a simulated fleet, and consume its stream.

Every benchmark prints its figures as ``RESULT <name>=<value>`` lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
PG_DSN = os.environ.get("RELAY_BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def result(name: str, value: float | int | str) -> None:
    """Print one figure in the ``RESULT name=value`` format."""
    if isinstance(value, float):
        value = f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
    print(f"RESULT {name}={value}", flush=True)


def load_average() -> float:
    """1-minute load average (the machine is shared; figures depend on it)."""
    return os.getloadavg()[0]


def note(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    return kids


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    kids = _children()
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(kids.get(p, []))
    return out


def cpu_seconds(pids: list[int]) -> float:
    """user+system CPU seconds of ``pids`` (live processes only)."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat", "rb") as fh:
                fields_ = fh.read().decode(errors="replace").rsplit(")", 1)[1].split()
            total += int(fields_[11]) + int(fields_[12])
        except OSError:
            continue
    return total / CLK_TCK


def rss_bytes(pids: list[int]) -> int:
    """Resident set size of ``pids`` summed."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/statm") as fh:
                total += int(fh.read().split()[1]) * PAGE
        except OSError:
            continue
    return total


def pids_named(name: str) -> list[int]:
    """Processes whose ``comm`` is ``name`` (e.g. the PostgreSQL backends)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/comm") as fh:
                    if fh.read().strip() == name:
                        out.append(int(d))
            except OSError:
                continue
    return out


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class RelayProc:
    """A running ``relay serve`` child process."""

    proc: asyncio.subprocess.Process
    url: str
    log_path: Path
    workdir: tempfile.TemporaryDirectory[str] | None = None
    pids: list[int] = field(default_factory=list)
    #: ws:// base of the plain-websockets listener when started with ``--firehose-bind``.
    firehose_url: str | None = None

    @property
    def ws_url(self) -> str:
        """The subscribeRepos URL consumers use: the fast listener when there is one."""
        base = self.firehose_url or self.url.replace("http://", "ws://")
        return base + "/xrpc/com.atproto.sync.subscribeRepos"

    def refresh_pids(self) -> list[int]:
        self.pids = tree(self.proc.pid)
        return self.pids

    def cpu(self) -> float:
        return cpu_seconds(self.refresh_pids())

    def rss(self) -> int:
        return rss_bytes(self.refresh_pids())

    async def crawl(self, hostnames: list[str], concurrency: int = 1) -> None:
        """requestCrawl each host, ``concurrency`` requests in flight (in order when 1)."""
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as http:
            async def one(h: str) -> None:
                for attempt in range(5):  # idempotent: a relay busy with the first hosts may be slow to answer
                    try:
                        async with sem:
                            r = await http.post("/xrpc/com.atproto.sync.requestCrawl", json={"hostname": h})
                        r.raise_for_status()
                        return
                    except httpx.TimeoutException:
                        if attempt == 4:
                            raise

            if concurrency <= 1:
                for h in hostnames:
                    await one(h)
            else:
                await asyncio.gather(*(one(h) for h in hostnames))

    async def metrics(self) -> str:
        """The relay's Prometheus text ("" if it does not answer within a minute)."""
        try:
            async with httpx.AsyncClient(base_url=self.url, timeout=60) as http:
                return (await http.get("/metrics")).text
        except httpx.HTTPError as exc:
            note(f"metrics unavailable: {exc!r}")
            return ""


def metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


@contextlib.asynccontextmanager
async def relay(plc_url: str, *, database_url: str | None = None, extra: list[str] | None = None,
                env: dict[str, str] | None = None, profile: str | None = None) -> AsyncIterator[RelayProc]:
    """Start ``relay serve`` on an ephemeral port (SQLite in a temp dir unless ``database_url``).

    With ``profile`` the relay's main process runs under cProfile (timed by its main thread's CPU
    clock: ``bench/_cpuprofile.py``) and writes its stats there.
    """
    workdir = tempfile.TemporaryDirectory(prefix="relay-bench-")
    db = database_url or str(Path(workdir.name) / "relay.sqlite")
    log_path = Path(workdir.name) / "relay.log"
    prof = [str(ROOT / "bench" / "_cpuprofile.py"), profile] if profile else []
    args = [sys.executable, *prof, "-m", "relay.cli", "serve", "--bind", "127.0.0.1:0", "--database-url", db,
            "--plc-url", plc_url, "--handle-resolver-url", plc_url, "--allow-insecure-hosts", "true",
            "--default-account-limit", "10000000", "--new-hosts-per-day", "100000", "--crawl-requests-per-minute", "0", "--log-level", "info",
            *(extra or [])]
    logf = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = await asyncio.create_subprocess_exec(*args, cwd=ROOT, stdout=logf, stderr=logf,
                                                env={**os.environ, **(env or {})})
    url = firehose_url = None
    deadline = time.monotonic() + 60
    while url is None and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        if proc.returncode is not None:
            break
        for line in log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if rec.get("msg") == "listening":
                    url = rec.get("url")
                elif rec.get("msg") == "firehose listening":
                    firehose_url = rec.get("url")
    running = False
    async with httpx.AsyncClient(timeout=5) as http:  # the port opens before the service starts
        while url is not None and not running and time.monotonic() < deadline and proc.returncode is None:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                running = (await http.get(url + "/_health")).json().get("state") == "running"
            if not running:
                await asyncio.sleep(0.1)
    if url is None or not running:
        proc.kill()
        raise RuntimeError("relay did not start:\n" + log_path.read_text(errors="replace")[-3000:])
    rp = RelayProc(proc, url, log_path, workdir, firehose_url=firehose_url)
    rp.refresh_pids()
    try:
        yield rp
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        logf.close()
        keep = Path(tempfile.gettempdir()) / "relay-bench-last.log"
        with contextlib.suppress(OSError):
            keep.write_bytes(log_path.read_bytes()[-2_000_000:])
            note(f"relay log kept at {keep}")
        workdir.cleanup()


class CountingConsumer:
    """A subscribeRepos client that counts frames and remembers receive times of #commit frames.

    ``record`` keeps ``(repo, rev) -> receive time`` (for latency); ``read_delay`` sleeps after each
    frame (a slow consumer); ``stalled`` connects and never reads.
    """

    def __init__(self, url: str, *, cursor: int | None = None, record: bool = False,
                 read_delay: float = 0.0, stalled: bool = False) -> None:
        self.url = url if cursor is None else f"{url}?cursor={cursor}"
        self.record = record
        self.read_delay = read_delay
        self.stalled = stalled
        self.frames = 0
        self.commits = 0
        self.bytes = 0
        self.first_at = 0.0
        self.last_at = 0.0
        self.received: dict[tuple[str, str], float] = {}
        self.closed_reason = ""
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()

    def start(self) -> CountingConsumer:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        from websockets.asyncio.client import connect

        from firehose.frames import decode_frame

        try:
            async with connect(self.url, max_size=None, compression=None, max_queue=4 if self.stalled else 16,
                               open_timeout=30, ping_interval=None) as ws:
                self.connected.set()
                if self.stalled:
                    ws.transport.pause_reading()
                    await asyncio.Future()
                async for msg in ws:
                    now = time.time()
                    if not self.frames:
                        self.first_at = now
                    self.last_at = now
                    self.frames += 1
                    self.bytes += len(msg)
                    if msg[:20].find(b"#commit") >= 0:
                        self.commits += 1
                        if self.record:
                            body = decode_frame(msg).body
                            self.received[(body["repo"], body["rev"])] = now
                    if self.read_delay:
                        await asyncio.sleep(self.read_delay)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # closed by the relay (e.g. ConsumerTooSlow)
            self.closed_reason = type(exc).__name__ + ":" + str(exc)[:80]
        finally:
            self.connected.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


async def wait_until(pred, timeout: float, step: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(step)
    return bool(pred())


def listener_extra(name: str) -> list[str]:
    """``relay serve`` flags for the subscribeRepos listener a benchmark's consumers use:
    ``asgi`` = the main port (Starlette route); ``websockets`` = ``--firehose-bind`` (plain
    ``websockets`` server beside it)."""
    return ["--firehose-bind", "127.0.0.1:0"] if name == "websockets" else []

