"""A relay process killed with SIGKILL and restarted loses and duplicates nothing."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from sim import SimConfig, SimFleet
from tests.relay.e2e import Consumer, check_stream, crawl, key_of, settle

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _start_relay(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "relay.cli", "serve"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=log.open("ab"))
    url = f"http://{env['RELAY_BIND']}"
    deadline = time.monotonic() + 30
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                health = await http.get(url + "/_health")
                if health.status_code == 200 and health.json()["state"] == "running":  # not still starting
                    return proc
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    proc.kill()
    raise AssertionError("relay did not start: " + log.read_text()[-3000:])


async def test_sigkill_restart_no_loss_no_duplicate(database_url: str, tmp_path: Path) -> None:
    fleet = SimFleet(SimConfig(hosts=2, accounts_per_host=4, seed=11))
    await fleet.start()
    port = _free_port()
    env = {**os.environ, "RELAY_DATABASE_URL": database_url, "RELAY_BIND": f"127.0.0.1:{port}",
           "RELAY_ALLOW_INSECURE_HOSTS": "true", "RELAY_PLC_URL": fleet.plc_url,
           "RELAY_VALIDATION_WORKERS": "0", "RELAY_LOG_LEVEL": "warning"}
    url = f"http://127.0.0.1:{port}"
    ws_url = f"ws://127.0.0.1:{port}/xrpc/com.atproto.sync.subscribeRepos"
    log = tmp_path / "relay.log"
    proc = await _start_relay(env, log)
    try:
        for host in fleet.hosts:
            await crawl(url, host.hostname)
        async with Consumer(ws_url, cursor=0) as first:
            await fleet.generate(150)
            await first.wait_for(lambda evs: len(evs) >= 40)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        seen_before_kill = len(first.events)
        await fleet.generate(40)  # emitted while the relay is down
        proc = await _start_relay(env, log)
        valid = [t for t in fleet.ground_truth if t.verdict == "accept"]
        async with Consumer(ws_url, cursor=0) as after:
            await after.wait_for(lambda evs: len(evs) >= len(valid), timeout=60)
            markers = await settle(fleet, after)  # a duplicate would come before these
        expected = Counter(key_of(t.kind, t.did, t.rev) for t in valid + markers)
        got = Counter(key_of(e.t, e.did, e.rev) for e in after.events)
        assert got == expected
        check_stream(after.events)
        # what the first consumer saw before the crash is a prefix of the durable stream
        assert [e.seq for e in first.events] == [e.seq for e in after.events[:seen_before_kill]]
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise AssertionError("relay did not stop on SIGTERM: " + log.read_text()[-2000:]) from None
        await fleet.stop()
