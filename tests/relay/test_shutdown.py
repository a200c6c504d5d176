"""SIGTERM to the relay's whole process group (systemd, ``kill -- -PGID``): a clean stop. The
validation workers are not respawned, nothing prints a traceback, and no process is left behind."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx

from tests.relay.process import relay_child
from tests.waiting import until


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


async def test_sigterm_to_the_process_group_stops_workers_cleanly(tmp_path: Path) -> None:
    async with relay_child(tmp_path, validation_workers="2") as relay:
        await until(lambda: len(relay.children()) == 2, "two validation workers")
        workers = relay.children()
        async with httpx.AsyncClient(base_url=relay.url) as http:
            assert (await http.get("/_health")).status_code == 200
        os.killpg(relay.pid, signal.SIGTERM)
        code = await asyncio.to_thread(relay.proc.wait, 30)
        log = relay.log_text()
        assert code == 0, log[-3000:]
        assert '"msg": "stopped"' in log, log[-3000:]
        assert "Traceback" not in log and "BrokenPipeError" not in log, log[-3000:]
        assert "validation worker died" not in log, log[-3000:]
        await until(lambda: all(_gone(pid) for pid in workers), "the workers gone")
