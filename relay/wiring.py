"""The relay's parts, each built complete and in dependency order, and closed in the reverse order.

Three layers, each a frozen dataclass whose fields are all set when it exists (no part starts as
``None`` and is filled in later):

* :class:`Core` (every role): the store (migrated), the Redis client (scale-out only), the bus, the
  identity resolver over its persisted and cached layers, the optional getRepo proxy, the
  broadcaster and the Jetstream server.
* :class:`Writer` (``serve`` and ``ingest``): the bus publisher and the sequencer (the service
  starts it: it takes the writer lease, or waits for it in standby).
* :class:`Ingest` (``serve`` and ``ingest``): validation pool, admission, account lanes, host runs,
  resync, host manager, sibling forwarding and the optional status healer.

Each ``open_*`` function takes what it needs as arguments and registers the closing of what it
opened on the caller's :class:`contextlib.AsyncExitStack`, so a start that fails half-way closes
exactly what it got to, and ``RelayService.stop`` closes everything with one ``aclose()``. The
service (``relay.service``) owns the stack, the phase and the background tasks; this module owns
the order.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backfill.backends import open_store
from backfill.sequencer import Publish, Sequencer
from backfill.store import Store
from firehose.broadcast import Broadcaster
from firehose.bus import InProcessBus, RedisStreamBus, RedisTimeouts, redis_client
from firehose.pipeline import ValidationPool
from firehose.publisher import BusPublisher
from relay.config import RelayConfig, parse_nameservers
from relay.consumers import ConsumerRegistry
from relay.hosts import HostBoard, HostManager, HostPolicy
from relay.identity import (
    IdentityCache,
    IdentityResolver,
    MemoryIdentityCache,
    RedisIdentityCache,
    dns_txt_lookup,
    identity_concurrency,
)
from relay.identity_store import PersistedIdentities
from relay.ingest.admission import Admission
from relay.ingest.hostruns import Upstreams
from relay.ingest.lanes import retry_pauses
from relay.ingest.resync import ResyncManager
from relay.ingest.resync_queue import ResyncQueue
from relay.jetstream_server import JetstreamServer, jetstream_server
from relay.jsonlog import fields
from relay.metrics import RelayMetrics
from relay.redis_guard import FailFastRedis
from relay.repo_proxy import RepoProxy
from relay.siblings import SiblingForwarder
from relay.ssrf import AddressGuard, SafeClient
from relay.status_heal import HealPace, StatusHealer
from relay.status_suspects import SuspectQueue, WatchedLanes

log = logging.getLogger("relay.wiring")

#: a verdict counter: ``count(kind, reason)``
Count = Callable[[str, str], None]


@dataclass(frozen=True, slots=True)
class Core:
    """What every role has. ``redis`` is None without ``RELAY_REDIS_URL``; ``repo_proxy`` None
    unless ``RELAY_GETREPO_PROXY``."""
    store: Store
    redis: Any | None
    bus: RedisStreamBus | InProcessBus
    identities: PersistedIdentities
    identity: IdentityResolver
    repo_proxy: RepoProxy | None
    broadcaster: Broadcaster
    jetstream: JetstreamServer


@dataclass(frozen=True, slots=True)
class Writer:
    """The durable path's end: the sequencer (the store's single writer) and the publisher that
    hands its committed batches to the bus off the durable path."""
    publisher: BusPublisher
    sequencer: Sequencer


@dataclass(frozen=True, slots=True)
class Ingest:
    """The ingest side. ``healer`` is None when status self-healing is off."""
    pool: ValidationPool
    admission: Admission
    lanes: WatchedLanes
    upstreams: Upstreams
    resync: ResyncManager
    hosts: HostManager
    siblings: SiblingForwarder
    healer: StatusHealer | None


async def _close_quietly(close: Callable[[], Any]) -> None:
    with contextlib.suppress(Exception):
        await close()


async def open_core(stack: contextlib.AsyncExitStack, config: RelayConfig, *, metrics: RelayMetrics,
                    safe: SafeClient, consumers: ConsumerRegistry, store_schema: str | None, bus_stream: str,
                    given_store: Store | None = None) -> Core:
    """Open the store (``given_store`` if any: migrated here, closed at stop), Redis and the bus,
    the identity resolver, the getRepo proxy, the broadcaster (not started yet: the service
    starts it once the writer is up) and Jetstream."""
    store = given_store or await open_store(config.database_url, schema=store_schema)
    stack.push_async_callback(store.close)
    applied = await store.migrate()
    if applied:
        log.info("migrations applied", extra=fields(versions=applied))
    redis: Any | None = None
    bus: RedisStreamBus | InProcessBus
    cache: IdentityCache
    if config.redis_url:
        # bounded waits: a Redis that hangs must not hang ingest, readiness or identity lookups
        timeouts = RedisTimeouts(connect=config.redis_connect_timeout, socket=config.redis_timeout,
                                 health_check=config.redis_health_check)
        redis = redis_client(config.redis_url, timeouts)
        stack.push_async_callback(_close_quietly, redis.aclose)
        bus = RedisStreamBus(config.redis_url, stream=bus_stream, maxlen=max(1, config.bus_max_entries),
                             timeouts=timeouts)
        cache = RedisIdentityCache(FailFastRedis(redis))  # a hung Redis: one timeout per cool-off
    else:
        bus = InProcessBus()
        cache = MemoryIdentityCache()
    identities = PersistedIdentities(store)
    identities.start()
    stack.push_async_callback(identities.close)
    identity = IdentityResolver(plc_url=config.plc_url, safe_client=safe, cache=cache,
                                metrics=metrics, handle_resolver_url=config.handle_resolver_url,
                                rate=max(1.0, float(config.identity_rate)),
                                burst=max(1, int(config.identity_rate * 2.5)),
                                concurrency=identity_concurrency(config.identity_rate),
                                txt_lookup=dns_txt_lookup(parse_nameservers(config.dns_servers) or None),
                                persisted=identities, stale_after=config.identity_max_age,
                                handle_timeout=config.handle_timeout)
    stack.push_async_callback(identity.aclose)
    stack.push_async_callback(_close_quietly, bus.close)
    repo_proxy = None
    if config.getrepo_proxy:
        repo_proxy = RepoProxy(identity=identity, safe=safe, metrics=metrics,
                               cache_bytes=max(1, config.getrepo_cache_mb) * 1024 * 1024)
    broadcaster = Broadcaster(store, bus, max_lag=config.consumer_max_lag,
                              live_queue_bytes=config.consumer_max_queue_bytes,
                              replay_budget_bytes=config.replay_buffer_mb * 1024 * 1024)
    stack.push_async_callback(broadcaster.close)
    jetstream = jetstream_server(broadcaster, metrics, consumers)
    return Core(store=store, redis=redis, bus=bus, identities=identities, identity=identity,
                repo_proxy=repo_proxy, broadcaster=broadcaster, jetstream=jetstream)


def open_writer(stack: contextlib.AsyncExitStack, config: RelayConfig, core: Core, *,
                publish: Callable[[BusPublisher], Publish], wait_for_lock: bool) -> Writer:
    """Start the bus publisher and build the sequencer, not started: the caller awaits
    ``writer.sequencer.start()``, which takes the writer lease or, when ``wait_for_lock``, waits
    for it — the service is in standby meanwhile and must already hold the writer to say so.
    ``publish(publisher)``: the step the sequencer calls after each committed batch (the
    service's, which the fault suite wraps)."""
    publisher = BusPublisher(core.bus, max_bytes=config.bus_publish_max_bytes,
                             timeout=config.bus_publish_timeout)
    publisher.start()
    stack.push_async_callback(publisher.close)
    sequencer = Sequencer(core.store, publish(publisher), wait_for_lock=wait_for_lock)
    stack.push_async_callback(_close_quietly, sequencer.close)
    return Writer(publisher=publisher, sequencer=sequencer)


async def open_ingest(stack: contextlib.AsyncExitStack, config: RelayConfig, core: Core, writer: Writer, *,
                      metrics: RelayMetrics, guard: AddressGuard, safe: SafeClient, count: Count,
                      limit_raised: Callable[[str], Any]) -> Ingest:
    """Start the ingest side in dependency order: validation workers, the resync queue and
    admission, the account lanes, the host runs, resync, the host manager (which starts the
    stored hosts' runs), sibling forwarding and, when on, the status healer (built, not run: the
    service runs it as a task). ``limit_raised(hostname)``: called by the host manager when an
    operator raises a host's account limit."""
    policy = HostPolicy(config)
    # The host rows' statuses and account counts in memory, read once here before anything of the
    # ingest runs; every later change reaches it (statuses through it, account counts from the
    # sequencer's committed batches), so scrapes and housekeeping never read the hosts table.
    board = HostBoard(core.store, policy)
    await board.ensure_loaded()
    writer.sequencer.on_host_accounts = board.add_accounts
    pool = ValidationPool(config.validation_workers)
    await pool.start()
    stack.push_async_callback(pool.close)
    resync_queue = ResyncQueue(on_change=metrics.resync_queue.set,
                               held_per_account=config.resync_held_bytes_per_account,
                               held_total=config.resync_held_bytes_total)
    admission = Admission(store=core.store, identity=core.identity, policy=policy,
                          default_account_limit=config.default_account_limit, board=board)
    suspects = SuspectQueue(config.status_heal_suspect_delay, limit=100_000 if config.status_heal_interval else 0)
    lanes = WatchedLanes(suspects=suspects, store=core.store, sequencer=writer.sequencer, pool=pool,
                         admission=admission, identity=core.identity, resync=resync_queue, count=count,
                         handle_wait=config.handle_wait, history_margin=config.host_clock_skew,
                         identity_retry=retry_pauses(config.identity_retry))
    resync = ResyncManager(store=core.store, identity=core.identity, safe=safe, metrics=metrics,
                           queue=resync_queue, lanes=lanes, workers=config.resync_workers,
                           retry_base=config.resync_retry_base, retry_max=config.resync_retry_max,
                           set_host_status=board.set_status)
    stack.push_async_callback(resync.close)
    stack.push_async_callback(lanes.close)
    buffer = max(1, config.ingest_buffer_mb) * 1024 * 1024
    upstreams = Upstreams(store=core.store, sequencer=writer.sequencer, lanes=lanes, admission=admission,
                          policy=policy, guard=guard, metrics=metrics, config=config, count=count,
                          max_in_flight_bytes=buffer, max_in_flight_bytes_per_host=max(1, buffer // 8),
                          board=board)
    stack.push_async_callback(upstreams.close)
    metrics.watch_ingest_buffer(lambda: upstreams)
    hosts = HostManager(store=core.store, config=config, metrics=metrics, guard=guard, safe=safe,
                        start_host=upstreams.start_host, stop_host=upstreams.stop_host,
                        limit_raised=limit_raised, board=board)
    await hosts.load_settings()
    siblings = SiblingForwarder(config.sibling_relays, metrics=metrics)
    siblings.start()
    stack.push_async_callback(siblings.close)
    await resync.start()
    await upstreams.start_all()
    healer = None
    if config.status_heal_interval > 0:
        healer = StatusHealer(
            store=core.store, lanes=lanes, upstreams=upstreams, safe=safe, identity=core.identity,
            metrics=metrics, insecure=config.allow_insecure_hosts,
            pace=HealPace(interval=config.status_heal_interval, suspect_delay=config.status_heal_suspect_delay,
                          timeout=config.status_heal_timeout, settle=config.repair_settle), suspects=suspects)
    return Ingest(pool=pool, admission=admission, lanes=lanes, upstreams=upstreams, resync=resync,
                  hosts=hosts, siblings=siblings, healer=healer)
