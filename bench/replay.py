"""Replay: events/s to one consumer replaying N events (default 1,000,000) from PostgreSQL.

The events are real simulator ``#commit`` frames (a few thousand distinct bodies, re-sequenced)
written straight into a dedicated schema through ``backfill``'s writer lease; the schema is kept
between runs and reloaded only when it holds fewer events than asked for. Then ``relay serve``
runs on that database and one consumer connects with ``cursor=0`` and reads everything.

    .venv/bin/python bench/replay.py [--quick] [--events N] [--schema bench_replay]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (  # noqa: E402
    PG_DSN,
    cpu_seconds,
    listener_extra,
    load_average,
    note,
    pids_named,
    relay,
    result,
    self_cpu,
)

#: extra ``relay serve`` flags chosen by --listener
LISTENER: list[str] = []


def template_bodies(n: int) -> list[tuple[str, dict]]:
    """``n`` realistic commit bodies (without seq) from simulated repositories."""
    from sim.ident import SigningKey, plc_did
    from sim.records import WriteMix, now_iso
    from sim.repo import SimRepo

    rng = random.Random(5)
    repos = [SimRepo(plc_did(rng), SigningKey.generate("k256", rng)) for _ in range(50)]
    mix = WriteMix(rng)
    out = []
    for i in range(n):
        repo = repos[i % len(repos)]
        res = repo.apply_writes(mix.next_writes(repo.record_paths()))
        body = {"rebase": False, "tooBig": False, "repo": repo.did, "commit": res.commit_cid, "rev": res.rev,
                "since": res.since, "blocks": res.car, "ops": [o.to_wire() for o in res.ops], "blobs": [],
                "time": now_iso()}
        if res.prev_data is not None:
            body["prevData"] = res.prev_data
        out.append((repo.did, body))
    return out


async def load(url: str, events: int) -> int:
    """Make sure the store at ``url`` holds at least ``events`` events; returns the count."""
    from backfill.backends import open_store
    from backfill.store import BatchWrite
    from firehose.frames import encode_frame

    store = await open_store(url)
    try:
        await store.migrate()
        have = await store.count_events()
        if have >= events:
            note(f"replay: schema already holds {have} events")
            return have
        lease = await store.acquire_writer(wait=True, timeout=30)
        try:
            hw = await lease.high_water()
            templates = template_bodies(2000)
            t0 = time.perf_counter()
            chunk = 5000
            now = time.time()
            for start in range(hw + 1, hw + 1 + (events - have), chunk):
                stop = min(start + chunk, hw + 1 + events - have)
                rows = []
                for seq in range(start, stop):
                    did, body = templates[seq % len(templates)]
                    body["seq"] = seq
                    rows.append((seq, did, "#commit", now, encode_frame("#commit", body)))
                await lease.commit_batch(BatchWrite(expected_high_water=start - 1, new_high_water=stop - 1, events=rows))
                if (stop - hw) % 100_000 < chunk:
                    note(f"replay: loaded {stop - hw - 1} events ({(stop - hw) / (time.perf_counter() - t0):.0f}/s)")
        finally:
            await lease.release()
        return await store.count_events()
    finally:
        await store.close()


async def run(events: int, schema: str) -> None:
    from bench._rawws import subscribe

    url = f"{PG_DSN}?schema={schema}"
    have = await load(url, events)
    note(f"replay: {have} events stored")
    async with relay("http://127.0.0.1:9", database_url=url, extra=LISTENER) as r:
        count = [0]
        nbytes = [0]
        first = [0.0]
        stop = asyncio.Event()

        last = [b""]

        def on_message(msg: bytes, t: float) -> None:
            last[0] = msg
            if not count[0]:
                first[0] = time.perf_counter()
            count[0] += 1
            nbytes[0] += len(msg)
            if count[0] >= events:
                stop.set()

        cpu0 = r.cpu()
        pg = pids_named("postgres")
        pg0, me0 = cpu_seconds(pg), self_cpu()
        t0 = time.perf_counter()
        task = asyncio.create_task(subscribe(r.ws_url + "?cursor=0", on_message, stop=stop))
        seen, last_t = 0, time.monotonic()
        while not stop.is_set() and not task.done():
            # wake on the last event (not on a 0.5 s tick, which quantised the wall time)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
            if count[0] != seen:
                seen, last_t = count[0], time.monotonic()
            elif time.monotonic() - last_t > 20:
                break
        wall = time.perf_counter() - t0
        cpu = r.cpu() - cpu0
        pg_cpu, me_cpu = cpu_seconds(pg) - pg0, self_cpu() - me0
        stop.set()
        ended = await task
    result("replay_events", count[0])
    result("replay_events_per_s", count[0] / wall)
    result("replay_mb_per_s", nbytes[0] / wall / 1e6)
    result("replay_time_to_first_event_ms", (first[0] - t0) * 1000 if first[0] else float("nan"))
    result("replay_relay_cpu_cores", cpu / wall)
    result("replay_postgres_cpu_cores", pg_cpu / wall)
    result("replay_consumer_cpu_cores", me_cpu / wall)
    result("replay_load_average", load_average())
    end = str(ended)
    if last[0] and count[0] < events:
        from firehose.frames import decode_frame

        with contextlib.suppress(Exception):
            f = decode_frame(last[0])
            if f.is_error:
                end += ":" + str(f.body.get("error"))
    result("replay_stream_end", "complete" if count[0] >= events else end)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--events", type=int, default=None)
    p.add_argument("--schema", default="bench_replay")
    p.add_argument("--listener", choices=["asgi", "websockets"], default="asgi",
                   help="consumers connect to the main port (asgi) or to a --firehose-bind listener")
    a = p.parse_args()
    LISTENER[:] = listener_extra(a.listener)
    events = a.events or (100_000 if a.quick else 1_000_000)
    asyncio.run(run(events, a.schema))
    return 0


if __name__ == "__main__":
    sys.exit(main())
