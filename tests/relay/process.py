"""``relay serve`` as a child process in its own process group, for tests that need a real process
(memory, signals). Its JSON log (stderr) goes to a file the test can read."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RelayChild:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def status(self, field: str) -> int:
        """A ``/proc/PID/status`` size field (``VmRSS``, ``VmHWM``) in bytes."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(field)

    def reset_peak_rss(self) -> None:
        """Make ``VmHWM`` start again from the current RSS (Linux: ``5`` to ``clear_refs``)."""
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")

    def children(self) -> list[int]:
        """PIDs of the relay's child processes (its validation workers)."""
        out = []
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            out += [int(p) for p in (task / "children").read_text().split()]
        return out


@contextlib.asynccontextmanager
async def relay_child(tmp_path: Path, **settings: str) -> AsyncIterator[RelayChild]:
    """Start ``relay serve`` (SQLite under ``tmp_path``, port 0, ``settings`` as ``RELAY_*``
    variables) and wait for its ``listening`` line and its ``running`` state. On exit: SIGTERM to its process group (if it
    still runs), then SIGKILL after 20 s."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update({"RELAY_BIND": "127.0.0.1:0", "RELAY_DATABASE_URL": str(tmp_path / "relay.sqlite"),
                "RELAY_LOG_LEVEL": "info"})
    env.update({f"RELAY_{k.upper()}": v for k, v in settings.items()})
    log = tmp_path / "relay-child.log"
    proc = subprocess.Popen([sys.executable, "-m", "relay.cli", "serve"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=log.open("wb"), start_new_session=True)
    try:
        url = await _listening(proc, log)
        await _running(proc, url, log)
        yield RelayChild(proc, url, log)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


async def _listening(proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("msg") == "listening":
                    return str(record["url"])
        if proc.poll() is not None:
            raise AssertionError("relay exited at start:\n" + log.read_text(errors="replace")[-3000:])
        await asyncio.sleep(0.05)
    raise AssertionError("relay did not start:\n" + log.read_text(errors="replace")[-3000:])


async def _running(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float = 60.0) -> None:
    """The port opens before the service has started: wait for ``/_health`` to say ``running``."""
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get("/_health")).json().get("state") == "running":
                    return
            if proc.poll() is not None:
                raise AssertionError("relay exited at start:\n" + log.read_text(errors="replace")[-3000:])
            await asyncio.sleep(0.05)
    raise AssertionError("relay not running:\n" + log.read_text(errors="replace")[-3000:])
