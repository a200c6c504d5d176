"""Prometheus metrics of one relay instance.

Each ``RelayMetrics`` owns a private ``CollectorRegistry`` so that several relays can live in one
process (tests). ``/metrics`` renders this registry followed by the process-wide default one
(where other packages may register their own collectors).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily

#: Fields of ``firehose.broadcast.BroadcastStats`` exported as ``relay_broadcast_events_total{event}``.
BROADCAST_EVENTS = ("too_slow", "lagged", "future_cursor", "outdated_cursor", "replay_overflows", "bus_gaps_filled",
                    "bus_errors")

__all__ = ["CONTENT_TYPE_LATEST", "RelayMetrics"]


class RelayMetrics:
    """Every metric the relay exports; labels are fixed enumerations, never free text."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.events_in = Counter("relay_events_in_total", "Frames received from upstream hosts",
                                 ["host", "type"], registry=r)
        self.verdicts = Counter("relay_verdicts_total", "Judgements on upstream events",
                                ["kind", "reason"], registry=r)
        self.events_out = Counter("relay_events_sequenced_total", "Events sequenced and published",
                                  ["type"], registry=r)
        self.current_seq = Gauge("relay_current_seq", "Highest sequence number assigned", registry=r)
        self.lag = Histogram("relay_ingest_to_broadcast_seconds",
                             "Time from receiving an upstream frame to publishing it",
                             buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                             registry=r)
        self.consumers = Gauge("relay_consumers", "Connected subscribeRepos consumers", registry=r)
        self.mst_compiled = Gauge("relay_mst_compiled",
                                  "1 if commit verification runs on the compiled mst build (mst.native), else 0",
                                  registry=r)
        self.bytes_out = Counter("relay_bytes_out_total", "Bytes sent to consumers", registry=r)
        self.resync_queue = Gauge("relay_resync_queue", "Accounts waiting for a resync", registry=r)
        self.repairs_deferred = Gauge("relay_repairs_deferred",
                                      "Spark repairs waiting for the relay to catch up with their host", registry=r)
        self.store_up = Gauge("relay_store_up", "1 if the database answered the last readiness check, else 0",
                              registry=r)
        self.sequencer_state = Gauge("relay_sequencer_state",
                                     "1 for the sequencer's current state (running, retrying, failed, waiting, stopped)",
                                     ["state"], registry=r)
        self.since_sequenced = Gauge("relay_seconds_since_last_sequenced",
                                     "Seconds since the sequencer last committed a batch", registry=r)
        self.resyncs = Counter("relay_resyncs_total", "Finished resyncs", ["result"], registry=r)
        self.identity_cache = Counter("relay_identity_cache_total", "Identity cache lookups",
                                      ["result"], registry=r)
        self.identity_resolutions = Counter("relay_identity_resolutions_total",
                                            "DID resolutions against PLC / did:web", ["result"], registry=r)
        self.handle_checks = Counter("relay_handle_checks_total",
                                     "Handle -> DID verifications by method and outcome", ["result"], registry=r)
        self.hosts = Gauge("relay_hosts", "Upstream hosts by status", ["status"], registry=r)
        self.host_connects = Counter("relay_host_connects_total", "Upstream connection attempts",
                                     ["result"], registry=r)
        self.host_resets = Counter("relay_host_cursor_resets_total",
                                   "Upstream cursors reset: the host's stream went backwards or it answered "
                                   "FutureCursor (wiped or restored), or a frame it keeps replaying is unreadable",
                                   ["host", "reason"], registry=r)
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

    def render(self) -> bytes:
        """Text exposition of this relay's registry plus the process default registry."""
        return generate_latest(self.registry) + generate_latest(REGISTRY)


class _BroadcastCollector:
    """``relay_broadcast_events_total{event}``: consumers cut off as too slow, future and
    outdated cursors, replay buffers discarded, bus gaps filled from the store, bus errors."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("relay_broadcast_events", "Downstream stream events by kind",
                                     labels=["event"])
        stats = self.stats()
        for event in BROADCAST_EVENTS:
            family.add_metric([event], getattr(stats, event, 0) if stats is not None else 0)
        yield family

