"""What the chart's fan-out preStop drain relies on: a relay process sent SIGTERM closes every
subscribeRepos consumer with a WebSocket close frame (1012, service restart, on the main port;
1001, going away, on the firehose listener), so consumers see a clean close and reconnect
elsewhere with their cursor, and the process exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from websockets.asyncio.client import connect

from tests.waiting import until_async

SUBSCRIBE = "/xrpc/com.atproto.sync.subscribeRepos"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_sigterm_closes_consumers_with_a_close_frame(tmp_path: Path) -> None:
    port, firehose_port = free_port(), free_port()
    relay = str(Path(sys.executable).parent / "relay")
    env = {**os.environ, "RELAY_FIREHOSE_BIND": f"127.0.0.1:{firehose_port}", "RELAY_ADMIN_TOKEN": ""}
    proc = subprocess.Popen([relay, "serve", "--bind", f"127.0.0.1:{port}", "--database-url",
                             str(tmp_path / "relay.sqlite")], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=2) as http:

            async def ready() -> bool:
                try:
                    return (await http.get("/_ready")).status_code == 200
                except httpx.TransportError:
                    return False

            await until_async(ready, "the relay to be ready", timeout=30)
        main = await connect(f"ws://127.0.0.1:{port}{SUBSCRIBE}", open_timeout=5)
        listener = await connect(f"ws://127.0.0.1:{firehose_port}{SUBSCRIBE}", open_timeout=5)
        proc.send_signal(signal.SIGTERM)
        for ws in (main, listener):
            await asyncio.wait_for(ws.wait_closed(), 10)
        # a close frame from the server (rcvd), not a dropped connection (code 1006, rcvd None)
        assert main.protocol.close_rcvd is not None and main.protocol.close_rcvd.code == 1012, main.protocol.close_rcvd
        assert listener.protocol.close_rcvd is not None and listener.protocol.close_rcvd.code == 1001, listener.protocol.close_rcvd
        assert await asyncio.to_thread(proc.wait, 15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        assert proc.stderr is not None
        proc.stderr.close()
