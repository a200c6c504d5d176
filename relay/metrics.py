"""Prometheus metrics of one relay instance.

Each ``RelayMetrics`` owns a private ``CollectorRegistry`` so that several relays can live in one
process (tests). ``/metrics`` renders this registry followed by the process-wide default one
(where other packages may register their own collectors).

Cost per host stays small and goes away with the host: the per-host series live outside
``prometheus_client`` in :class:`relay.host_series.HostSeries` (plain counters, each host's text
rendered once per change), are removed by :meth:`RelayMetrics.forget_host` when a host is banned,
and no ``*_created`` copies are exported (``prometheus_client.disable_created_metrics``,
process-wide). :meth:`render` is safe to call from another thread while the event loop updates
the metrics; ``/metrics`` renders in a worker thread, and what it renders per host is cached, so a
scrape of thousands of hosts holds the GIL for milliseconds, not a second.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from relay.host_series import HostSeries

#: Fields of ``firehose.broadcast.BroadcastStats`` exported as ``relay_broadcast_events_total{event}``.
BROADCAST_EVENTS = ("too_slow", "lagged", "future_cursor", "outdated_cursor", "replay_overflows", "bus_gaps_filled",
                    "bus_errors", "replay_waits", "replay_stalled")

#: Fields of ``firehose.publisher.PublisherStats`` exported as ``relay_bus_publish_events_total{result}``.
PUBLISH_RESULTS = ("published", "dropped")

__all__ = ["CONTENT_TYPE_LATEST", "RelayMetrics"]

disable_created_metrics()  # type: ignore[no-untyped-call]  # a *_created series per labelled child doubles every per-host family


class RelayMetrics:
    """Every metric the relay exports; labels are fixed enumerations, never free text."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._render_lock: asyncio.Lock | None = None
        #: ``relay_events_in_total{host,type}``, ``relay_host_cursor_resets_total{host,reason}``,
        #: ``relay_host_accounts{host}``, ``relay_host_account_limit{host}``
        self.host_series = HostSeries()
        # Counted per upstream event: plain counters read at scrape time (``TallyCounter``...).
        self.verdicts = TallyCounter("relay_verdicts_total", "Judgements on upstream events",
                                     ["kind", "reason"], registry=r)
        self.events_out = TallyCounter("relay_events_sequenced_total", "Events sequenced and published",
                                       ["type"], registry=r)
        self.current_seq = TallyGauge("relay_current_seq", "Highest sequence number assigned", registry=r)
        self.lag = TallyHistogram("relay_ingest_to_broadcast_seconds",
                                  "Time from receiving an upstream frame to publishing it",
                                  buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                                  registry=r)
        self.consumers = Gauge("relay_consumers", "Connected subscribeRepos consumers", registry=r)
        self.mst_compiled = Gauge("relay_mst_compiled",
                                  "1 if commit verification runs on the compiled mst build (mst.native), else 0",
                                  registry=r)
        self.bytes_out = Counter("relay_consumer_sent_bytes_total",
                                 "Bytes written to stream consumers as sent, by encoding (cbor: subscribeRepos; "
                                 "json: the JSON stream /subscribe, its zstd frames included)", ["encoding"],
                                 registry=r)
        for encoding in ("cbor", "json"):  # both series from the start (a rate() over them starts at 0)
            self.child(self.bytes_out, encoding)
        self.resync_queue = Gauge("relay_resync_queue", "Accounts waiting for a resync", registry=r)
        self.repairs_deferred = Gauge("relay_repairs_deferred",
                                      "Spark repairs waiting for the relay to catch up with their host", registry=r)
        self.store_up = Gauge("relay_store_up", "1 if the database answered the last readiness check, else 0",
                              registry=r)
        self.sequencer_state = Gauge("relay_sequencer_state",
                                     "1 for the sequencer's current state (running, retrying, failed, waiting, stopped)",
                                     ["state"], registry=r)
        self.ready = Gauge("relay_ready", "1 if /_ready answered 200 at the last check, else 0", registry=r)
        self.bus_up = Gauge("relay_bus_up", "0 if the Redis bus did not answer the last readiness PING "
                            "(scale-out), else 1 (always 1 without Redis)", registry=r)
        self.bus_up.set(1)
        self.since_sequenced = Gauge("relay_last_sequenced_age_seconds",
                                     "Seconds since the sequencer last committed a batch", registry=r)
        self.resyncs = Counter("relay_resyncs_total", "Finished resyncs", ["result"], registry=r)
        self.identity_cache = TallyCounter("relay_identity_cache_total", "Identity cache lookups",
                                           ["result"], registry=r)
        self.identity_resolutions = Counter("relay_identity_resolutions_total",
                                            "DID resolutions against PLC / did:web", ["result"], registry=r)
        self.handle_checks = Counter("relay_handle_checks_total",
                                     "Handle -> DID verifications by method and outcome", ["result"], registry=r)
        self.hosts = Gauge("relay_hosts", "Upstream hosts by status", ["status"], registry=r)
        self.host_connects = Counter("relay_host_connects_total", "Upstream connection attempts",
                                     ["result"], registry=r)
        self.getrepo = Counter("relay_getrepo_total", "getRepo requests by how they were answered",
                               ["result"], registry=r)
        self.getrepo_fetches = Counter("relay_getrepo_fetches_total",
                                       "getRepo proxy: repository fetches from PDSes by outcome", ["result"],
                                       registry=r)
        self.crawl_requests = Counter("relay_crawl_requests_total", "requestCrawl outcomes",
                                      ["result"], registry=r)
        self.admin_requests = Counter("relay_admin_requests_total", "Admin API requests",
                                      ["result"], registry=r)
        self.jetstream = Counter("relay_jetstream_total",
                                 "JSON stream (/subscribe) connections, refusals by reason and client messages",
                                 ["event"], registry=r)
        self.jetstream_messages = Counter("relay_jetstream_messages_total", "JSON stream messages sent",
                                          ["compressed"], registry=r)
        self.heal_checked = Counter("relay_status_heal_checked_total",
                                    "Account statuses compared with their host's answer (list: listRepos pages, "
                                    "status: getRepoStatus)", ["source"], registry=r)
        self.heal_divergences = Counter("relay_status_heal_divergences_total",
                                        "Account statuses found to differ from the host's, by the host's status",
                                        ["kind"], registry=r)
        self.heal_repairs = Counter("relay_status_heal_repairs_total",
                                    "Status divergences handed to the account's lane, by the host's status and "
                                    "outcome (applied, stale, ...)", ["kind", "outcome"], registry=r)
        self.heal_host_failures = Counter("relay_status_heal_host_failures_total",
                                          "Status checks a host could not answer (skipped and retried)",
                                          ["reason"], registry=r)
        self.sibling_forwards = Counter("relay_sibling_forwards_total",
                                        "Changes passed on to sibling relays (RELAY_SIBLING_RELAYS), by sibling and "
                                        "result: forwarded, retried, rejected, failed (given up), dropped (queue full)",
                                        ["sibling", "result"], registry=r)
        self.sibling_queue_bytes = Gauge("relay_sibling_queue_bytes", "Changes waiting to be sent to each sibling "
                                         "relay, in bytes", ["sibling"], registry=r)
        self.sibling_received = Counter("relay_sibling_received_total",
                                        "Changes received from a sibling relay (carrying our Via): applied, not "
                                        "passed on again", registry=r)

    def forget_host(self, hostname: str) -> None:
        """Remove every series labelled with ``hostname`` (the host was banned or removed): a
        relay that has seen thousands of hosts exports only those it still follows. Call it
        after the host's run has stopped (a later count would bring the series back from zero)."""
        self.host_series.forget(hostname)

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, kept once per label tuple: ``labels()`` costs a lock and a
        tuple build per call, too much for per-event counters on the ingest path."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def watch_broadcast(self, stats: Callable[[], Any]) -> None:
        """Export the broadcaster's counters (read at scrape time from ``stats()``); calling it
        again (a restarted service) replaces the source."""
        collector = getattr(self, "_broadcast_collector", None)
        if collector is None:
            collector = self._broadcast_collector = _BroadcastCollector(stats)
            self.registry.register(collector)
        collector.stats = stats

    def watch_publisher(self, stats: Callable[[], Any]) -> None:
        """Export the bus publisher's counters (read at scrape time from ``stats()``)."""
        collector = getattr(self, "_publisher_collector", None)
        if collector is None:
            collector = self._publisher_collector = _PublisherCollector(stats)
            self.registry.register(collector)
        collector.stats = stats

    def watch_ingest_buffer(self, source: Callable[[], Any]) -> None:
        """Export ``relay_ingest_buffer_bytes{state}`` read at scrape time from ``source()`` (the
        host runs, ``relay.ingest.hostruns.Upstreams``, or None): the ingest budget's ``limit``,
        what frames hold of it now (``used``), and the frames read and waiting for admission
        (``waiting``: outside the budget, at most one per host). Calling it again replaces the source."""
        collector = getattr(self, "_ingest_buffer_collector", None)
        if collector is None:
            collector = self._ingest_buffer_collector = _IngestBufferCollector(source)
            self.registry.register(collector)
        collector.source = source

    async def render_off_loop(self) -> bytes:
        """:meth:`render` in a worker thread, one at a time (concurrent scrapes queue here): the
        event loop keeps serving while a large exposition is built."""
        lock = self._render_lock
        if lock is None:
            lock = self._render_lock = asyncio.Lock()
        async with lock:
            return await asyncio.to_thread(self.render)

    def set_host_accounts(self, accounts: dict[str, tuple[int, int | None]]) -> None:
        """Replace the per-host account gauges: ``{hostname: (accounts, limit or None)}``. Only
        the hosts of the last call are exported (a removed host's series go with it);
        ``relay_host_account_limit`` only for hosts that have a limit."""
        self.host_series.set_accounts(accounts)

    def watch_resyncs(self, source: ResyncSource) -> None:
        """Export the resync queue's state, read at scrape time from ``source``:
        ``relay_desynchronized_accounts{age}`` (accounts waiting for a resync by how long they have
        been desynchronized: ``under_1m``, ``under_10m``, ``under_1h``, ``under_1d``, ``older``), ``relay_resync_held_bytes`` (frames
        held for them) and ``relay_resync_kicks_total`` (waiting retries brought forward because
        the account's host sent something new). Calling it again replaces the source."""
        collector = getattr(self, "_resync_collector", None)
        if collector is None:
            collector = self._resync_collector = _ResyncCollector(source)
            self.registry.register(collector)
        collector.source = source

    def render(self) -> bytes:
        """Text exposition of this relay's registry plus the process default registry. Safe in a
        worker thread (see the module docstring)."""
        return generate_latest(self.registry) + self.host_series.render().encode() + generate_latest(REGISTRY)


class Tally:
    """One series of a :class:`TallyCounter`: ``inc`` adds to a plain int (no lock: the event loop
    is its only writer; a scrape in another thread reads the int, which is atomic under the GIL).
    ``_value.get()`` reads it, as on a ``prometheus_client`` child."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        """Add ``amount`` (≥ 0) to the count."""
        self.value += amount

    @property
    def _value(self) -> Tally:
        return self

    def get(self) -> int:
        """The count now."""
        return self.value


class TallyCounter:
    """A labelled counter for the per-event paths, exported exactly as a ``prometheus_client``
    ``Counter`` of the same name and labels (``<name>_total``, no ``_created``): each series is a
    :class:`Tally`, and the family is built from them at scrape time. ``labels()`` (positional or
    by name) returns the series, kept once per label tuple. Only the event loop's thread may
    count; a scrape may run in any thread."""

    def __init__(self, name: str, documentation: str, labelnames: list[str], *,
                 registry: CollectorRegistry) -> None:
        self.name = name.removesuffix("_total")
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], Tally] = {}
        registry.register(self)

    def labels(self, *values: str, **named: str) -> Tally:
        """The series of these label values (created at zero on first use)."""
        if named:
            values = tuple(named[n] for n in self.labelnames)
        key = tuple(str(v) for v in values)
        if len(key) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {key}")
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = Tally()
        return found

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> list[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, tally in self._series.copy().items():  # copied at once: the loop may add a series
            family.add_metric(key, tally.value)
        return [family]


class TallyGauge:
    """An unlabelled gauge set on the per-event path: ``set`` stores a plain number, exported
    at scrape time exactly as a ``prometheus_client`` ``Gauge`` of the same name."""

    def __init__(self, name: str, documentation: str, *, registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.value: float = 0
        registry.register(self)

    def set(self, value: float) -> None:
        """The gauge's value from now on."""
        self.value = value

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(self.name, self.documentation)]

    def collect(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(self.name, self.documentation, value=self.value)]


class TallyHistogram:
    """An unlabelled histogram observed on the per-event path, exported exactly as a
    ``prometheus_client`` ``Histogram`` with the same name and buckets: ``observe`` adds one to a
    plain list of per-bucket counts (found by bisection) and to the sum; the cumulative buckets
    are built at scrape time. A scrape in another thread may see the sum one observation ahead
    of the buckets (as the counts of a ``Histogram`` are read one by one too)."""

    def __init__(self, name: str, documentation: str, *, buckets: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        """Count one observation of ``value``."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> list[HistogramMetricFamily]:
        counts, total, running = list(self.counts), self.sum, 0
        buckets: list[tuple[str, float]] = []
        for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
            running += n
            buckets.append((floatToGoString(bound), running))  # type: ignore[no-untyped-call]
        return [HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=total)]


class _BroadcastCollector:
    """``relay_broadcast_events_total{event}``: consumers cut off as too slow, future and
    outdated cursors, replay buffers discarded, bus gaps filled from the store, bus errors."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        family = CounterMetricFamily("relay_broadcast_events", "Downstream stream events by kind",
                                     labels=["event"])
        stats = self.stats()
        for event in BROADCAST_EVENTS:
            family.add_metric([event], getattr(stats, event, 0) if stats is not None else 0)
        yield family
        budget = GaugeMetricFamily("relay_replay_budget_bytes", "The replay budget: its limit, the bytes replaying "
                                   "consumers hold now, the most they held", labels=["state"])
        for state in ("limit", "used", "peak"):
            budget.add_metric([state], getattr(stats, f"replay_budget_{state}", 0) if stats is not None else 0)
        yield budget



class _IngestBufferCollector:
    """``relay_ingest_buffer_bytes{state}``: see :meth:`RelayMetrics.watch_ingest_buffer`."""

    def __init__(self, source: Callable[[], Any]) -> None:
        self.source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        runs = self.source()
        family = GaugeMetricFamily("relay_ingest_buffer_bytes", "The ingest budget: its limit, what frames read from "
                                   "upstream hosts hold of it now, and frames waiting for admission (outside it)",
                                   labels=["state"])
        family.add_metric(["limit"], runs.budget.limit if runs is not None else 0)
        family.add_metric(["used"], runs.budget.used if runs is not None else 0)
        family.add_metric(["waiting"], runs.waiting_bytes if runs is not None else 0)
        yield family


class _PublisherCollector:
    """``relay_bus_publish_events_total{result}`` (published, or dropped from a full queue — the
    fan-outs read those from the store), ``relay_bus_publish_errors_total`` (failed or timed-out
    bus calls, each retried) and ``relay_bus_publish_queue_bytes``."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self.stats()
        events = CounterMetricFamily("relay_bus_publish_events", "Committed events handed to the bus, by result",
                                     labels=["result"])
        for result in PUBLISH_RESULTS:
            events.add_metric([result], getattr(stats, result, 0) if stats is not None else 0)
        yield events
        yield CounterMetricFamily("relay_bus_publish_errors", "Bus publish calls that failed or timed out (retried)",
                                  value=getattr(stats, "errors", 0) if stats is not None else 0)
        yield GaugeMetricFamily("relay_bus_publish_queue_bytes", "Committed events waiting for the bus, in bytes",
                                value=getattr(stats, "queued_bytes", 0) if stats is not None else 0)

class ResyncSource(Protocol):
    """What ``RelayMetrics.watch_resyncs`` reads (``relay.ingest.resync_queue.ResyncQueue``)."""

    kicks: int

    @property
    def held_bytes(self) -> int: ...

    def by_age(self) -> dict[str, int]: ...


class _ResyncCollector:
    """See ``RelayMetrics.watch_resyncs``."""

    def __init__(self, source: ResyncSource) -> None:
        self.source = source

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        ages = GaugeMetricFamily("relay_desynchronized_accounts",
                                 "Accounts waiting for a resync, by how long they have been desynchronized "
                                 "(under_1m, under_10m, under_1h, under_1d, older)", labels=["age"])
        for label, count in self.source.by_age().items():
            ages.add_metric([label], count)
        yield ages
        yield GaugeMetricFamily("relay_resync_held_bytes", "Bytes of frames held for accounts being resynchronised",
                                value=self.source.held_bytes)
        yield CounterMetricFamily("relay_resync_kicks", "Waiting resync retries started early because the "
                                  "account's host sent something new for it", value=self.source.kicks)
