"""Crash safety with a real SIGKILL of the writing process, on both backends.

After every kill: each upstream event is either fully present (event row + account state +
covered by the host cursor) or absent and re-delivered from the cursor; seq has no duplicate and
no gap; the high-water mark covers every stored seq. Re-delivery from an older cursor is ignored.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
from pathlib import Path

from tests.backfill.conftest import StoreTarget, decode_frame
from tests.backfill.helpers import commit_event

REPO = Path(__file__).resolve().parents[2]
TOTAL = 400
DIDS = 17


async def spawn(target: StoreTarget, first: int, last: int, *extra: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.backfill.crash_child",
        target.full_url,
        str(first),
        str(last),
        *extra,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )


async def read_until(proc: asyncio.subprocess.Process, predicate, timeout: float = 60) -> list[str]:  # type: ignore[no-untyped-def]
    lines: list[str] = []

    async def _read() -> None:
        assert proc.stdout is not None
        while True:
            raw = await proc.stdout.readline()
            if not raw:
                raise AssertionError(f"child exited early: {lines[-5:]}")
            lines.append(raw.decode().strip())
            if predicate(lines):
                return

    await asyncio.wait_for(_read(), timeout)
    return lines


async def kill(proc: asyncio.subprocess.Process, *, may_have_finished: bool = False) -> None:
    """SIGKILL the child (with ``may_have_finished``, a child that already ran to the end and
    exited 0 is accepted too)."""
    try:
        proc.send_signal(signal.SIGKILL)
    except ProcessLookupError:
        pass
    rc = await asyncio.wait_for(proc.wait(), 30)
    assert rc == -signal.SIGKILL or (may_have_finished and rc == 0), rc


async def check_invariants(target: StoreTarget) -> int:
    """Assert the crash invariants; returns the host cursor (where the upstream resumes)."""
    store = await target.open()
    try:
        cursor = await store.host_cursor("pds.example") or 0
        events = await store.read_after(0, 10 * TOTAL)
        seqs = [e.seq for e in events]
        upstream = [decode_frame(e.frame)[1]["upstream"] for e in events]
        # No duplicate seq, no gap (nothing was trimmed and ignored re-deliveries take no seq).
        assert seqs == list(range(1, len(events) + 1))
        assert await store.latest_seq() == len(events)
        # Exactly the events up to the durable cursor, each once, in upstream order.
        assert upstream == list(range(1, cursor + 1))
        for event in events:
            assert decode_frame(event.frame)[1]["seq"] == event.seq
        # Account state is that of the last stored event of each account.
        accounts = await store.get_accounts([f"did:plc:acct{i:04d}" for i in range(DIDS)])
        for i in range(DIDS):
            did = f"did:plc:acct{i:04d}"
            mine = [n for n in upstream if n % DIDS == i]
            if mine:
                assert accounts[did].rev == commit_event(mine[-1]).rev
                assert accounts[did].commit_cid == f"bafycommit{mine[-1]}"
            else:
                assert did not in accounts
        host = await store.get_host("pds.example")
        assert host is None or host.account_count == len(accounts)
        return cursor
    finally:
        await store.close()


async def test_sigkill_mid_batch_then_resume(target: StoreTarget) -> None:
    # 1. Freeze inside the transaction of the batch reaching upstream seq 200, then SIGKILL.
    proc = await spawn(target, 1, TOTAL, "--stall-at", "200")
    lines = await read_until(proc, lambda ls: ls[-1] == "STALL")
    await kill(proc)
    assert any(line.startswith("PUBLISHED") for line in lines)
    cursor = await check_invariants(target)
    assert 0 < cursor < 200  # the stalled batch (which had written its events) left nothing

    # 2. Resume from an older cursor (the upstream re-delivers 30 already-sequenced events);
    #    kill at a random moment while batches are flowing.
    proc = await spawn(target, max(1, cursor - 30), TOTAL)
    await read_until(proc, lambda ls: sum(line.startswith("PUBLISHED") for line in ls) >= 3)
    await asyncio.sleep(random.uniform(0, 0.05))
    await kill(proc, may_have_finished=True)
    second = await check_invariants(target)
    assert second >= cursor

    # 3. Resume again (overlapping by 10) and run to the end.
    proc = await spawn(target, max(1, second - 10), TOTAL)
    lines = await read_until(proc, lambda ls: ls[-1] == "DONE", timeout=120)
    assert await asyncio.wait_for(proc.wait(), 30) == 0
    assert await check_invariants(target) == TOTAL
