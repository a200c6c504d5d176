"""``relay simulate`` as a process: prints its URLs, serves real streams, exits cleanly."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx

from firehose.frames import decode_frame
from sim.cli import build_parser, main, parse_faults
from sim.weather import Delay
from tests.sim.harness import read_frames

ROOT = Path(__file__).resolve().parents[2]


def test_fault_spec_parsing() -> None:
    assert parse_faults("bad_signature=0.1@1,slow=0.5", 2) == [(1, "bad_signature", 0.1), (0, "slow", 0.5),
                                                               (1, "slow", 0.5)]
    assert main(["--faults", "gremlins=1"]) == 2
    assert main(["--hosts", "1", "--faults", "slow=0.1@3"]) == 2
    weather = build_parser().parse_args(["--plc-delay", "0.05/3", "--handle-delay", "2", "--dns"])
    assert (weather.plc_delay, weather.handle_delay, weather.dns) == (Delay.tail(0.05, 3.0), Delay.fixed(2.0), True)


async def test_simulate_process_serves_hosts_and_plc(tmp_path: Path) -> None:
    truth_file = tmp_path / "truth.jsonl"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relay.cli", "simulate", "--hosts", "2", "--accounts", "3", "--rate", "40",
        "--duration", "60", "--faults", "bad_signature=0.3@0", "--truth", str(truth_file), "--dns", "--plc-delay", "0.01",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        while not lines or lines[-1] != "READY":
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert line, (await proc.stderr.read()).decode() if proc.stderr else "no output"
            lines.append(line.decode().strip())
        plc = next(x.split()[1] for x in lines if x.startswith("PLC "))
        hosts = [x.split()[1] for x in lines if x.startswith("HOST ")]
        assert len(hosts) == 2
        assert any(x.startswith("DNS 127.0.0.1:") for x in lines), lines
        frames, _ = await read_frames(hosts[0], 0, count=20, limit=15)
        bodies = [decode_frame(f).body for f in frames]
        assert len(bodies) >= 9 and [b["seq"] for b in bodies] == list(range(1, len(bodies) + 1))
        did = bodies[0]["did"]
        async with httpx.AsyncClient() as http:
            doc = (await http.get(f"{plc}/{did}")).json()
            assert doc["service"][0]["serviceEndpoint"] == hosts[0]
        proc.terminate()  # SIGTERM: graceful stop, summary and truth file
        rest = (await asyncio.wait_for(proc.stdout.read(), 30)).decode()
        assert "DONE commits=" in rest
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    truth = [json.loads(x) for x in truth_file.read_text().splitlines()]
    assert any(t["verdict"] == "reject" and t["reason"] == "bad_signature" for t in truth)
    assert {t["host"] for t in truth} == {h.removeprefix("http://") for h in hosts}
