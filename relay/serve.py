"""``relay serve | ingest | fanout``: run the relay under uvicorn.

With no configuration: SQLite under ``./data/``, in-process bus, 127.0.0.1:2470, migrations
applied at start. Every setting is an environment variable with a matching flag (``--help``).
The port opens first: one JSON log line ``{"msg": "listening", "url": …}`` gives the bound address
(useful with port 0) while the service is still starting (``/_health`` answers ``state:
starting``, then ``standby`` or ``running``); ``{"msg": "serving"}`` follows once it runs.
The main port's connections are bounded by ``relay.connection_limits`` (header timeout,
connection and WebSocket caps: :func:`build_server`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import socket
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from relay.config import ConfigError, RelayConfig, add_arguments
from relay.jsonlog import fields, setup_logging

if TYPE_CHECKING:
    import uvicorn
    from prometheus_client import CollectorRegistry

    from relay.connection_limits import ConnectionLimits
    from relay.service import RelayService

log = logging.getLogger("relay.serve")


def build_parser(role: str = "serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"relay {role}",
        description="Run the AT Protocol relay. Every option can also be set with the environment "
                    "variable named in its help.")
    parser.add_argument("--role", choices=["serve", "ingest", "fanout"], default=role,
                        help="serve = everything in one process; ingest / fanout = scale-out halves "
                             "(need PostgreSQL and Redis)")
    add_arguments(parser)
    return parser


def _bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


#: Cyclic-GC thresholds for the relay's main process (CPython's default is (700, 10, 10)).
GC_THRESHOLDS = (10_000, 20, 50)


def tune_gc() -> tuple[int, int, int]:
    """Freeze everything allocated during start-up (modules, config, pools: never garbage) out of
    the collector's sight and collect far less often. Per event the main process allocates many
    short-lived containers that refcounting frees, but the default thresholds still ran ~550
    young, ~50 middle and ~5 full collections per 30,000 commits: 0.8–1.3 s of the main process's
    3–4.5 CPU-s. With these settings that fell to ~5 young collections (~0.08 s), and ingest
    went from 6,817/4,791 to 7,653/6,532 commits/s in paired runs. The relay's long-lived state
    (account and identity caches) is not cyclic, so collecting it rarely costs only a little
    memory held by the odd garbage cycle. The validation workers gained nothing from the same
    change and keep the defaults."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    return gc.get_threshold()


def build_server(app: Any, config: RelayConfig,
                 registry: CollectorRegistry | None = None) -> tuple[uvicorn.Server, ConnectionLimits]:
    """The uvicorn server (and its limits) of the main port for ``app``: uvicorn's sans-I/O WebSocket protocol with
    batched subscribeRepos sends, and the connection limits of ``relay.connection_limits`` (header
    timeout, connection and WebSocket caps; exported to the metrics ``registry`` when given)."""
    import uvicorn

    from relay.connection_limits import ConnectionLimits, export

    limits = ConnectionLimits(header_timeout=config.http_header_timeout, max_connections=config.max_connections,
                              max_websockets=config.max_websockets)
    if registry is not None:
        export(limits, registry)
    http, ws = limits.protocols()
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", http=http, ws=ws,
                                           # per-connection compression encodes every frame once per
                                           # consumer: off unless RELAY_WS_DEFLATE (BENCHMARKS.md)
                                           ws_per_message_deflate=config.ws_deflate,
                                           log_config=None, access_log=False, ws_max_size=1 << 20,
                                           # the app names itself (Server: atproto-relay, relay.siblings)
                                           server_header=False,
                                           # consumers' lag is probed by the broadcaster (ConsumerTooSlow
                                           # within RELAY_CONSUMER_MAX_LAG); the keepalive ping only
                                           # catches a peer that vanished while nothing was sent to it
                                           ws_ping_interval=20.0, ws_ping_timeout=config.consumer_max_lag + 20.0,
                                           timeout_graceful_shutdown=5))
    server.config.setup_event_loop = lambda: None  # type: ignore[method-assign]
    return server, limits


async def run(config: RelayConfig, role: str, service_class: type[RelayService] | None = None) -> None:
    """Open the port first (probes, metrics and dashboard answer from then on: a standby ingest
    waiting for the writer lease is alive, not ready), then start the service; serve until
    SIGINT/SIGTERM. A start that fails ends the process (the error propagates).
    ``service_class``: a ``RelayService`` subclass to run instead (the fault suite's)."""
    from relay.gate import ServiceGate
    from relay.service import RelayService

    service = (service_class or RelayService)(config, role=role)
    sock = _bind_socket(config.host, config.port)
    server, _ = build_server(ServiceGate(service), config, service.metrics.registry)
    host, port = sock.getsockname()[:2]
    starting = asyncio.create_task(service.start(), name="service-start")

    def shut_down() -> None:
        server.should_exit = True
        starting.cancel()  # a standby stops waiting for the lease; no-op once started

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, shut_down)
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="http")
    log.info("listening", extra=fields(url=f"http://{host}:{port}", role=role))
    try:
        await asyncio.wait({starting, serving}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done() and not starting.cancelled():
            starting.result()  # a failed start raises here
            thresholds = tune_gc()
            log.info("serving", extra=fields(role=role, gc_thresholds=list(thresholds),
                                             gc_frozen=gc.get_freeze_count()))
        await serving
    finally:
        server.should_exit = True
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        await service.stop()
        sock.close()
        log.info("stopped")


def main(argv: list[str] | None = None, service_class: type[RelayService] | None = None) -> int:
    """``relay serve|ingest|fanout``; ``service_class`` as for :func:`run`."""
    args = list(sys.argv[1:] if argv is None else argv)
    role = args[args.index("--role") + 1] if "--role" in args[:-1] else "serve"
    parser = build_parser(role if role in ("serve", "ingest", "fanout") else "serve")
    ns = parser.parse_args(args)
    try:
        config = RelayConfig.from_args(ns)
    except ConfigError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level)
    try:
        import uvloop

        runner: Callable[[Coroutine[Any, Any, None]], None] = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        runner = asyncio.run
    try:
        runner(run(config, ns.role, service_class))
    except KeyboardInterrupt:
        return 0
    except Exception as exc:
        log.error("relay failed to start", extra=fields(error=f"{type(exc).__name__}: {exc}"))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
