"""``relay simulate``: run a fleet of simulated PDS hosts and a PLC directory on 127.0.0.1.

Prints one ``PLC <url>`` line, one ``HOST <url>`` line per host and ``READY``, then produces
commits at ``--rate`` commits/s until ``--duration`` elapses or it is interrupted. With
``--pregenerate N`` the first N commits are built before READY and released at the rate, so the
fleet can push far more frames per second than it could sign on the fly.

Weather: ``--plc-delay`` (``2`` fixed, ``0.05/3`` p50/p99 tail) holds every DID document back;
``--dns`` also serves the handles over DNS (a ``DNS 127.0.0.1:<port>`` line, for
``RELAY_DNS_SERVERS``); ``--handle-delay`` slows every handle check the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import signal
import sys
import time
from collections import Counter

from sim.faults import FAULT_KINDS
from sim.fleet import SimConfig, SimFleet
from sim.weather import Delay


def parse_faults(spec: str, hosts: int) -> list[tuple[int, str, float]]:
    """``kind=rate[@host][,…]`` → ``[(host, kind, rate)]``; without ``@host`` every host."""
    out: list[tuple[int, str, float]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, rest = part.partition("=")
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r} (known: {', '.join(FAULT_KINDS)})")
        rate_s, _, host_s = rest.partition("@")
        rate = float(rate_s or "0.01")
        targets = [int(host_s)] if host_s else list(range(hosts))
        for h in targets:
            if not 0 <= h < hosts:
                raise ValueError(f"fault {kind}: no host {h}")
            out.append((h, kind, rate))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relay simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2, help="number of simulated PDS hosts")
    p.add_argument("--accounts", type=int, default=10, help="accounts per host")
    p.add_argument("--rate", type=float, default=10.0, help="commits per second over the whole fleet")
    p.add_argument("--duration", type=float, default=None, help="seconds to run (default: until interrupted)")
    p.add_argument("--faults", default="", help="kind=rate[@host],… e.g. bad_signature=0.01,slow=0.1@0")
    p.add_argument("--port-base", type=int, default=0, help="host i listens on port-base+i (0: ephemeral)")
    p.add_argument("--plc-port", type=int, default=0, help="PLC directory port (0: ephemeral)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--initial-records", type=int, default=0, help="records per account before start")
    p.add_argument("--pregenerate", type=int, default=0, help="build this many commits before READY")
    p.add_argument("--no-announce", action="store_true", help="do not emit #identity/#account at start")
    p.add_argument("--plc-delay", type=Delay.parse, default=None, help="DID documents answered after: S or P50/P99")
    p.add_argument("--handle-delay", type=Delay.parse, default=None, help="handle checks answered after: S or P50/P99")
    p.add_argument("--dns", action="store_true", help="serve the handles over DNS (TXT _atproto.<handle>)")
    p.add_argument("--truth", default=None, help="write the ground truth as JSON lines here on exit")
    return p


async def run(args: argparse.Namespace) -> int:
    cfg = SimConfig(hosts=args.hosts, accounts_per_host=args.accounts, seed=args.seed,
                    announce_accounts=not args.no_announce, initial_records=args.initial_records,
                    port_base=args.port_base, plc_port=args.plc_port, dns=args.dns)
    faults = parse_faults(args.faults, args.hosts)
    fleet = SimFleet(cfg)
    await fleet.start()
    for h, kind, rate in faults:
        fleet.hosts[h].set_fault(kind, rate)
    fleet.plc.delay = args.plc_delay
    if args.handle_delay is not None:
        fleet.slow_handle(fleet.accounts, args.handle_delay)
    if args.pregenerate:
        fleet.prepare(args.pregenerate)
    print(f"PLC {fleet.plc_url}")
    if fleet.dns is not None:
        print(f"DNS {fleet.dns.address}")
    for host in fleet.hosts:
        print(f"HOST {host.url}")
    print("READY", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    t0 = time.perf_counter()

    async def produce() -> None:
        if fleet.pending:
            await fleet.release(args.rate)
        left = None if args.duration is None else max(0.0, args.duration - (time.perf_counter() - t0))
        if left is None or left > 0:
            await fleet.run(args.rate, left)

    task = asyncio.create_task(produce())
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    task.cancel()
    waiter.cancel()
    elapsed = time.perf_counter() - t0
    frames = sum(h.published_seq for h in fleet.hosts)
    verdicts = Counter(t.verdict for t in fleet.ground_truth)
    print(f"DONE commits={fleet.commits_generated} events={len(fleet.ground_truth)} seconds={elapsed:.1f} "
          f"verdicts={dict(verdicts)} frames_published~{frames}", flush=True)
    if args.truth:
        with open(args.truth, "w") as fh:
            for t in fleet.ground_truth:
                fh.write(json.dumps(dataclasses.asdict(t)) + "\n")
    await fleet.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        parse_faults(args.faults, args.hosts)
    except ValueError as exc:
        print(f"relay simulate: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
