"""The relay as one object: its lifecycle (start, phase, stop), readiness and what the handlers
reach; the parts themselves are built, in order, by ``relay.wiring``.

Roles:

* ``serve``  — everything in one process (the embedded default: SQLite + in-process bus; with
  ``RELAY_REDIS_URL`` the bus and identity cache go to Redis).
* ``ingest`` — crawler, validation, sequencer (single writer: the store's writer lease, a
  Postgres advisory lock, guarantees one active instance) + admin/requestCrawl/XRPC; publishes to
  Redis Streams.
* ``fanout`` — stateless: replays from the store and follows Redis Streams; serves
  subscribeRepos and the read-only XRPC endpoints.

``RelayService(config, role=…)``; ``await start()`` / ``await stop()``; ``build_app()``.

Lifecycle (``phase``): ``starting`` (store, bus, identity being set up) → ``standby`` (ingest only:
waiting for another process's writer lease, ``lease_holder`` says whose) → ``running`` →
``stopping``. ``relay.gate.ServiceGate`` serves the probes, metrics and dashboard in every phase
(the HTTP port opens before ``start()``), everything else once ``running``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

from starlette.applications import Starlette

from backfill.failure import describe_store_error
from backfill.outbox import DrainResult, drain_repair_outbox
from backfill.sequencer import Publish, Sequencer
from backfill.store import Store
from firehose.broadcast import Broadcaster
from firehose.bus import EventBus
from firehose.memtrim import glibc_trimmer
from firehose.pipeline import ValidationPool
from firehose.publisher import BusPublisher, classify_bus_error
from firehose.state import AccountState, SequencedEvent
from relay.config import RelayConfig
from relay.console.api import HostIndex
from relay.console.ledger import HostLedger
from relay.console.reports import ReplicaReporter
from relay.consumers import ConsumerRegistry
from relay.fdlimit import hosts_allowed, raise_open_file_limit
from relay.hosts import HostManager
from relay.identity import IdentityResolver
from relay.identity_store import PersistedIdentities
from relay.ingest.admission import Admission
from relay.ingest.hostruns import Upstreams
from relay.ingest.lanes import FRAME_HOST, AccountLanes
from relay.ingest.resync import ResyncManager
from relay.jetstream_server import JetstreamServer
from relay.jsonlog import fields
from relay.metrics import RelayMetrics
from relay.repo_proxy import RepoProxy
from relay.siblings import SERVER_NAME, SiblingForwarder
from relay.ssrf import AddressGuard, Resolver, SafeClient
from relay.status_heal import StatusHealer
from relay.wiring import Core, Ingest, Writer, open_core, open_ingest, open_writer

log = logging.getLogger("relay.service")

ROLES = ("serve", "ingest", "fanout")
SEQUENCER_STATES = ("running", "retrying", "failed", "waiting", "stopped")
VERSION = "0.1.0"


class RelayService:
    """See the module docstring. ``resolver`` replaces public DNS (tests)."""

    def __init__(self, config: RelayConfig, *, role: str = "serve", resolver: Resolver | None = None,
                 store_schema: str | None = None, bus_stream: str | None = None,
                 store: Store | None = None) -> None:
        """``store``: an already opened store to use instead of opening ``config.database_url``
        (tests inject faults through it); it is migrated at start and closed at stop."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        self.config = config
        self.role = role
        self.version = VERSION
        self.metrics = RelayMetrics()
        self.consumers = ConsumerRegistry(self.metrics)
        self.guard = AddressGuard(allow_insecure=config.allow_insecure_hosts, resolver=resolver)
        self.safe = SafeClient(self.guard)
        self.store_schema = store_schema
        self.bus_stream = bus_stream or config.redis_stream
        self._phase = "starting"
        #: the full app, built once ``start()`` has finished (``relay.gate`` serves it then)
        self.app: Starlette | None = None
        self._given_store = store
        #: what start() opened, closed in reverse order by stop() (``relay.wiring``)
        self._stack = contextlib.AsyncExitStack()
        #: the parts, each set once complete (``relay.wiring``): None until start() got that far
        self.core: Core | None = None
        self.writer: Writer | None = None
        self.ingest: Ingest | None = None
        #: set once a write to the store has succeeded since start (readiness waits for it)
        self.store_written = asyncio.Event()
        self._write_error: BaseException | None = None
        self._tasks: list[asyncio.Task[None]] = []
        #: The ``RELAY_FIREHOSE_BIND`` listener (a ``websockets`` server) and its ws:// base URL.
        self.firehose_server: Any = None
        self.firehose_url: str | None = None
        self._outbox_error = ""
        #: the operator console: verdicts per host, this process's report (shared through Redis in
        #: scale-out) and the host table's index (``relay.console``)
        self.host_ledger = HostLedger()
        self.reporter = ReplicaReporter(self, redis=lambda: self.core.redis if self.core is not None else None, key=f"{self.bus_stream}:console")
        self.console_hosts = HostIndex(self)

    # -- the parts (``relay.wiring``), for the handlers --------------------------------------
    def _core(self) -> Core:
        if self.core is None:
            raise RuntimeError("the relay has not started")
        return self.core

    @property
    def store(self) -> Store:
        return self._core().store

    @property
    def bus(self) -> EventBus:
        return self._core().bus

    @property
    def broadcaster(self) -> Broadcaster:
        return self._core().broadcaster

    @property
    def identity(self) -> IdentityResolver:
        return self._core().identity

    @property
    def identities(self) -> PersistedIdentities | None:
        return self.core.identities if self.core is not None else None

    @property
    def jetstream(self) -> JetstreamServer | None:
        return self.core.jetstream if self.core is not None else None

    @property
    def repo_proxy(self) -> RepoProxy | None:
        """getRepo served by the relay (RELAY_GETREPO_PROXY); None: getRepo redirects to the PDS."""
        return self.core.repo_proxy if self.core is not None else None

    @property
    def sequencer(self) -> Sequencer | None:
        return self.writer.sequencer if self.writer is not None else None

    @property
    def publisher(self) -> BusPublisher | None:
        """Hands committed batches to the bus off the durable path (not in a fan-out process)."""
        return self.writer.publisher if self.writer is not None else None

    @property
    def pool(self) -> ValidationPool | None:
        return self.ingest.pool if self.ingest is not None else None

    @property
    def admission(self) -> Admission | None:
        return self.ingest.admission if self.ingest is not None else None

    @property
    def lanes(self) -> AccountLanes | None:
        return self.ingest.lanes if self.ingest is not None else None

    @property
    def upstreams(self) -> Upstreams | None:
        return self.ingest.upstreams if self.ingest is not None else None

    @property
    def resync(self) -> ResyncManager | None:
        return self.ingest.resync if self.ingest is not None else None

    @property
    def hosts(self) -> HostManager | None:
        return self.ingest.hosts if self.ingest is not None else None

    @property
    def siblings(self) -> SiblingForwarder | None:
        """Passes admin changes and requestCrawls on to RELAY_SIBLING_RELAYS (not in a fan-out)."""
        return self.ingest.siblings if self.ingest is not None else None

    @property
    def healer(self) -> StatusHealer | None:
        """Account-status self-healing (``relay.status_heal``; None when off or not ingesting)."""
        return self.ingest.healer if self.ingest is not None else None

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        config = self.config
        if self.role in ("ingest", "fanout") and not (config.uses_postgres and config.redis_url):
            raise RuntimeError(f"role {self.role!r} needs RELAY_DATABASE_URL=postgresql://… and RELAY_REDIS_URL")
        if not config.uses_postgres:
            parent = os.path.dirname(os.path.abspath(config.database_url))
            os.makedirs(parent, exist_ok=True)
        from mst import native

        self.metrics.mst_compiled.set(1 if native.active() else 0)
        files = raise_open_file_limit()
        log.info("open-file limit" + (" raised" if files.raised else ""),
                 extra=fields(before=files.before, limit=files.soft, hard=files.hard,
                              hosts_allowed=hosts_allowed(files.soft)))
        stack = self._stack
        stack.push_async_callback(self.safe.aclose)
        self.core = core = await open_core(stack, config, metrics=self.metrics, safe=self.safe,
                                           consumers=self.consumers, store_schema=self.store_schema,
                                           bus_stream=self.bus_stream, given_store=self._given_store)
        self.reporter.start()
        trimmer = glibc_trimmer()  # what a burst (a replay crowd, giant frames) freed goes back to the OS
        if trimmer is not None:
            self._tasks.append(asyncio.create_task(trimmer.run(), name="memory-trim"))
        self.metrics.watch_broadcast(lambda: core.broadcaster.stats)
        if self.role != "fanout":
            self.writer = writer = open_writer(stack, config, core, publish=self.sequencer_publish,
                                               wait_for_lock=self.role == "ingest")
            self.metrics.watch_publisher(lambda: writer.publisher.stats)
            await writer.sequencer.start()  # in standby until the writer lease is ours (ingest)
            if not await self._write_check():  # first try inline: a healthy start is ready at once
                self._tasks.append(asyncio.create_task(self._prove_writable(), name="store-write-check"))
        await core.broadcaster.start()
        if config.firehose_bind:
            await self._start_firehose_listener(config.firehose_bind)
        if self.writer is None:
            self._running()
            return
        self.ingest = ingest = await open_ingest(stack, config, core, self.writer, metrics=self.metrics,
                                                 guard=self.guard, safe=self.safe, count=self._count,
                                                 limit_raised=self._limit_raised)
        self._tasks.append(asyncio.create_task(self._housekeeping(), name="housekeeping"))
        self._tasks.append(asyncio.create_task(self._repairs(), name="repairs"))
        if ingest.healer is not None:
            self._tasks.append(asyncio.create_task(ingest.healer.run(), name="status-heal"))
        self._running()
        log.info("relay started", extra=fields(role=self.role, mst=native.STATUS, **config.describe()))

    def _running(self) -> None:
        self.app = self.build_app()
        self._phase = "running"

    @property
    def phase(self) -> str:
        """``starting`` | ``standby`` (waiting for the writer lease) | ``running`` | ``stopping``."""
        if self._phase == "starting" and self.sequencer is not None and self.sequencer.state == "waiting":
            return "standby"
        return self._phase

    @property
    def lease_holder(self) -> str | None:
        """While in standby: who holds the writer lease, as the database tells it."""
        return self.sequencer.lease_holder if self.sequencer is not None else None

    async def _start_firehose_listener(self, bind: str) -> None:
        """The optional plain-websockets listener for subscribeRepos (``RELAY_FIREHOSE_BIND``)."""
        from firehose.serve_websockets import serve_subscribe_repos
        from relay.config import parse_bind

        host, port = parse_bind(bind, "RELAY_FIREHOSE_BIND")
        self.firehose_server = await serve_subscribe_repos(self.broadcaster, host, port,
                                                           track=self.consumers.tracking,
                                                           deflate=self.config.ws_deflate, server_header=SERVER_NAME)
        bound = next(iter(self.firehose_server.sockets)).getsockname()
        self.firehose_url = f"ws://{bound[0]}:{bound[1]}"
        log.info("firehose listening", extra=fields(url=self.firehose_url))

    async def _limit_raised(self, hostname: str) -> None:
        assert self.resync is not None and self.admission is not None
        self.admission.forget_host(hostname)
        await self.resync.release_throttled(hostname)

    def sequencer_publish(self, publisher: BusPublisher) -> Publish:
        """The publish step the sequencer calls after each committed batch: count every committed
        event by type — upstream ones, the lanes' operations (takedowns, resync ``#sync``) and Spark
        repairs alike — then queue the batch for the bus (``publisher.offer``: returns at once,
        whatever the bus does). The fault suite's subclass (``tests/faults/faulty_relay.py``) wraps
        it to crash between commit and publish."""
        metrics = self.metrics

        async def publish(events: list[SequencedEvent]) -> None:
            for event in events:
                metrics.child(metrics.events_out, event.kind).inc()
            publisher.offer(events)

        return publish

    async def _write_check(self, timeout: float = 5.0) -> bool:
        """Write to the store once (a setting: when this process last proved it can write).
        Sets ``store_written`` on success; notes (and logs, once) the error otherwise."""
        try:
            await asyncio.wait_for(self.store.set_setting("last_write_check", repr(time.time())), timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._write_error is None:
                log.warning("the store cannot be written; not ready until a write succeeds",
                            extra=fields(error=describe_store_error(exc)))
            self._write_error = exc
            return False
        if self._write_error is not None:
            log.warning("the store takes writes again")
        self._write_error = None
        self.store_written.set()
        return True

    async def _prove_writable(self, retry_max: float = 5.0) -> None:
        """Repeat the write check with capped backoff until it succeeds: until then readiness
        says the store is not writable (a relay started on a read-only database must not look
        ready). A batch the sequencer commits proves it as well."""
        attempt = 0
        while not self.store_written.is_set():
            attempt += 1
            await asyncio.sleep(min(retry_max, 0.1 * 2 ** min(attempt, 10)))
            if not self.store_written.is_set():
                await self._write_check()

    def _count(self, kind: str, reason: str) -> None:
        self.metrics.child(self.metrics.verdicts, kind, reason).inc()
        if kind != "accept":  # (the ledger keeps no accepts: no context look-up for them)
            self.host_ledger.count(FRAME_HOST.get(), kind, reason)

    async def _housekeeping(self, interval: float = 5.0) -> None:
        """Host status watch, retention trim."""
        ticks = 0
        while True:
            await asyncio.sleep(interval)
            ticks += 1
            try:
                if self.upstreams is not None:
                    await self.upstreams.watch_hosts()
                if ticks % 12 == 0:
                    await self.store.trim(older_than_seconds=self.config.replay_window)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("housekeeping failed")

    async def _repairs(self) -> None:
        """Apply the Spark outbox every ``repair_interval`` (see ``apply_repairs``)."""
        while True:
            await asyncio.sleep(self.config.repair_interval)
            await self.apply_repairs()

    async def apply_repairs(self) -> DrainResult | None:
        """Apply the repairs Spark jobs queued, each in its account's lane with a compare-and-set,
        once the relay has caught up with the row's host (``backfill.outbox``). Store errors are
        logged once per distinct error and retried the next time; returns None after one."""
        if self.lanes is None or self.upstreams is None:
            return None
        upstreams, settle = self.upstreams, self.config.repair_settle
        try:
            result = await drain_repair_outbox(
                self.store, self.lanes.apply_repair,
                lambda repair: upstreams.caught_up(repair.host, repair.observed_at, settle))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"[:300]
            if message != self._outbox_error:
                log.warning("repair outbox drain failed", extra=fields(error=message))
            self._outbox_error = message
            return None
        self._outbox_error = ""
        self.metrics.repairs_deferred.set(result.deferred)
        return result

    async def stop(self) -> None:
        """Stop whatever ``start()`` got to (also after a failed or cancelled start): the
        background tasks, the ``RELAY_FIREHOSE_BIND`` listener, then every part in the reverse of
        the order it was opened in (``relay.wiring``)."""
        self._phase = "stopping"
        await self.reporter.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self.firehose_server is not None:
            self.firehose_server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.firehose_server.wait_closed(), 5)
            self.firehose_server = None
        await self._stack.aclose()

    # -- used by the app ------------------------------------------------------------------
    async def readiness(self) -> list[str]:
        """Why this process should not receive traffic now (empty: ready). Each reason is
        ``what: cause (Type: message)``, the cause one word an operator can act on
        (``backfill.failure.classify_store_error``: ``disk_full``, ``read_only``,
        ``store_unreachable``, ``writer_lease_lost``…; ``firehose.publisher.classify_bus_error``:
        ``bus_hung``, ``bus_unreachable``…). Checks the store (a read within 2 s), that a write has
        succeeded since start (``store_not_writable`` until then), the sequencer (``running``; not
        ``retrying``/``failed``) and, in scale-out, the Redis bus (a PING within 2 s, and the
        publisher's current outage). Also refreshes the matching gauges (and ``relay_current_seq``
        from the same store read)."""
        reasons: list[str] = []
        phase = self.phase
        if phase == "standby":
            reasons.append("standby: waiting for the writer lease" + (f" held by {self.lease_holder}"
                                                                     if self.lease_holder else ""))
        elif phase != "running":
            reasons.append(phase)
        if self.core is None:
            return reasons
        try:
            self.metrics.current_seq.set(await asyncio.wait_for(self.store.latest_seq(), 2.0))
            self.metrics.store_up.set(1)
        except Exception as exc:
            self.metrics.store_up.set(0)
            reasons.append(f"store_unavailable: {describe_store_error(exc)}")
        sequencer = self.sequencer
        if sequencer is not None:
            for state in SEQUENCER_STATES:
                self.metrics.sequencer_state.labels(state=state).set(1 if sequencer.state == state else 0)
            self.metrics.since_sequenced.set(max(0.0, time.monotonic() - sequencer.last_commit_at))
            if sequencer.state not in ("running", "waiting"):  # waiting: the standby reason above
                detail = sequencer.failure or sequencer.unavailable
                reasons.append(f"sequencer_{sequencer.state}" + (f": {describe_store_error(detail)}" if detail else ""))
            elif sequencer.state == "running" and not self._written():
                error = self._write_error
                reasons.append("store_not_writable: " + (describe_store_error(error) if error is not None
                                                         else "no write has succeeded yet"))
        publisher = self.publisher
        failing = publisher.failing if publisher is not None else None
        redis = self.core.redis
        if failing is not None and redis is None:
            self.metrics.bus_up.set(0)
            reasons.append(f"bus_unavailable: {classify_bus_error(failing)} ({type(failing).__name__}: "
                           f"{str(failing)[:160]}; publishing held, ingest goes on)")
        elif redis is not None:
            # A publisher still failing while Redis answers again is catching up (its next retry is
            # at most RELAY_BUS_PUBLISH_TIMEOUT away, and fan-outs follow the store meanwhile): the
            # bus is up. Unready only while Redis itself does not answer.
            try:
                await asyncio.wait_for(redis.ping(), 2.0)
                self.metrics.bus_up.set(1)
            except Exception as exc:
                self.metrics.bus_up.set(0)
                cause = failing if failing is not None else exc
                reasons.append(f"bus_unavailable: {classify_bus_error(cause)} ({type(cause).__name__}: "
                               f"{str(cause)[:160]}; publishing held, ingest goes on)")
        return reasons

    def _written(self) -> bool:
        """A write to the store has succeeded since start (the check, or a committed batch)."""
        if not self.store_written.is_set() and self.sequencer is not None and self.sequencer.stats.batches:
            self.store_written.set()
        return self.store_written.is_set()

    async def refresh_gauges(self) -> None:
        """Before a scrape: readiness (store, sequencer, bus, current seq) and host statuses. The
        resync queue gauge is kept current by the queue itself."""
        self.metrics.ready.set(0 if await self.readiness() else 1)
        if self.hosts is not None:
            with contextlib.suppress(Exception):
                await self.hosts.refresh_status_gauge()

    async def set_local_status(self, did: str, local_status: str) -> AccountState:
        if self.lanes is None or self.hosts is None:
            raise RuntimeError("takedowns are handled by the ingest process")
        state = await self.lanes.set_local_status(did, local_status)
        await self.hosts.record_action("set_local_status", did, local_status=local_status)
        return state

    def build_app(self) -> Starlette:
        """The full app over this service (``relay.routes``)."""
        from relay.routes import build_app

        return build_app(self)
