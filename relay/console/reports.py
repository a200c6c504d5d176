"""Each relay process's report for the operator console, and the deployment as all of them.

A :class:`ReplicaReporter` (one per ``RelayService``) collects what its process knows — role,
phase, readiness, seq, the ingest's rates and verdicts, frames in and rate per host, consumers
with the bytes actually written to them per encoding, the resync queue — from the same sources as
``/metrics`` (the process's registry, read after the same refresh a scrape does), the broadcaster
and the consumer registry. Rates are over the interval between two collections.

Scale-out. Every ``interval`` seconds the report is also written to Redis, into one hash
(``<RELAY_REDIS_STREAM>:console``, a field per process), so the console on any replica shows the
whole deployment: the ingest (and a standby), every fan-out, and the ingest's per-host rates for
the host table. A report older than ``stale_after`` (a process that went away) is not shown and
is deleted. Without Redis (one process) the deployment is the process itself. A Redis that does
not answer only leaves the console with this process's own report (``redisError`` says why).

Counters in a report are **since that process started** (labelled so on the page); rates are
per second over the last interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

if TYPE_CHECKING:
    from relay.metrics import RelayMetrics
    from relay.service_view import ServiceView

log = logging.getLogger("relay.console")

#: How many desynchronized accounts a report carries (the oldest first).
DESYNC_IN_REPORT = 200
#: How many consumer sessions (the most lagging first) and connections (the most bytes sent
#: first) a report carries; ``count`` and the per-encoding totals always cover them all.
SESSIONS_IN_REPORT = 100

Samples = dict[str, list[tuple[dict[str, str], float]]]


def samples(registry: CollectorRegistry) -> Samples:
    """Every sample of ``registry`` by sample name (``relay_verdicts_total``, ``…_bucket``, …)."""
    out: Samples = {}
    for family in registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def value(found: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for lab, v in found.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def by_label(found: Samples, name: str, label: str) -> dict[str, float]:
    """Sum of the samples of ``name`` per value of ``label``."""
    out: dict[str, float] = {}
    for lab, v in found.get(name, []):
        out[lab.get(label, "")] = out.get(lab.get(label, ""), 0.0) + v
    return out


def _read_registry(metrics: RelayMetrics, prev_hosts: dict[str, float] | None,
                   dt: float) -> tuple[Samples, dict[str, float], dict[str, dict[str, Any]]]:
    """Every sample of ``metrics.registry``, ``relay_events_in_total`` per host (from
    ``metrics.host_series``), and per host its frames in and rate since ``prev_hosts`` (``dt``
    seconds ago; None: no rate yet). Run in a worker thread."""
    found = samples(metrics.registry)
    events_in = metrics.host_series.events_in()
    before = prev_hosts or {}
    hosts = {host: {"eventsIn": n, "rate": None if prev_hosts is None else _rate(n, before.get(host), dt)}
             for host, n in events_in.items()}
    return found, events_in, hosts


def quantile(buckets: list[tuple[str, float]], count: float, q: float) -> float | None:
    """The ``q`` quantile of a cumulative histogram (``[(le, cumulative)]``, ``+Inf`` last),
    linear inside the bucket; None without observations."""
    if count <= 0:
        return None
    want = q * count
    lower_le, lower_cum = 0.0, 0.0
    for le, cum in buckets:
        upper = float("inf") if le == "+Inf" else float(le)
        if cum >= want:
            if upper == float("inf"):
                return lower_le
            inside = cum - lower_cum
            return lower_le + (upper - lower_le) * (want - lower_cum) / inside if inside > 0 else upper
        lower_le, lower_cum = upper, cum
    return lower_le


def _rate(now: float, before: float | None, dt: float) -> float | None:
    return None if before is None or dt <= 0 else max(0.0, (now - before) / dt)


_SERVICES = itertools.count(1)


def replica_id(role: str) -> str:
    """``<host name>/<pid>/<role>``: unique per process of a deployment (pod names are unique);
    a second service in one process (tests) adds ``#<n>``."""
    n = next(_SERVICES)
    return f"{socket.gethostname()}/{os.getpid()}/{role}" + (f"#{n}" if n > 1 else "")


class ReplicaReporter:
    """This process's report, published to Redis in scale-out (see the module docstring)."""

    def __init__(self, service: ServiceView, *, redis: Callable[[], Any] | None = None,
                 key: str = "relay:events:console", interval: float = 2.0, stale_after: float = 15.0,
                 clock: Callable[[], float] = time.time) -> None:
        """``redis()``: the process's ``redis.asyncio`` client once it has one (None: one process,
        nothing shared)."""
        self.service = service
        self._redis = redis or (lambda: None)
        self.key = key
        self.interval = interval
        self.stale_after = stale_after
        self.clock = clock
        self.id = replica_id(service.role)
        self._prev: dict[str, Any] | None = None  # the previous collection's raw counters
        self._latest: dict[str, Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self.redis_error: str | None = None

    @property
    def redis(self) -> Any:
        return self._redis()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="console-reports")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.redis.hdel(self.key, self.id), 2.0)

    async def _run(self) -> None:
        while True:
            try:
                await self.publish()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the console stop the relay; the next round tries again
                log.exception("console report failed")
            await asyncio.sleep(self.interval)

    async def publish(self) -> dict[str, Any]:
        """Collect this process's report and (scale-out) write it to Redis."""
        report = await self.collect()
        if self.redis is not None:
            try:
                payload = await asyncio.to_thread(json.dumps, report)  # large with many hosts: off the loop
                await asyncio.wait_for(self.redis.hset(self.key, self.id, payload), 2.0)
                self.redis_error = None
            except Exception as exc:
                self.redis_error = f"{type(exc).__name__}: {exc}"[:200]
        return report

    async def local(self) -> dict[str, Any]:
        """This process's latest report (the loop collects one every ``interval``; collected now
        when there is none yet, or the loop has not delivered one for ``stale_after``)."""
        latest = self._latest
        if latest is None or self.clock() - latest["time"] >= self.stale_after:
            latest = await self.collect()
        return latest

    async def deployment(self) -> list[dict[str, Any]]:
        """Every live process's report, this one's first (fresh), then by role and id."""
        mine = await self.local()
        others: list[dict[str, Any]] = []
        if self.redis is not None:
            try:
                found = await asyncio.wait_for(self.redis.hgetall(self.key), 2.0)
            except Exception as exc:
                self.redis_error = f"{type(exc).__name__}: {exc}"[:200]
                found = {}
            now = self.clock()
            stale = []
            for field, raw in found.items():
                name = field.decode() if isinstance(field, bytes) else str(field)
                if name == self.id:
                    continue
                try:
                    report = json.loads(raw)
                except ValueError:
                    stale.append(name)
                    continue
                if now - float(report.get("time", 0)) > self.stale_after:
                    stale.append(name)
                else:
                    others.append(report)
            if stale:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.redis.hdel(self.key, *stale), 2.0)
        others.sort(key=lambda r: ({"ingest": 0, "serve": 0}.get(r.get("role", ""), 1), r.get("id", "")))
        return [mine, *others]

    async def collect(self) -> dict[str, Any]:
        """This process's report now (see the module docstring)."""
        service = self.service
        now = self.clock()
        reasons = await service.readiness()  # also refreshes relay_current_seq, store and sequencer gauges
        # every series of the registry (thousands of hosts' among them): read and summed per host
        # off the event loop, as a scrape renders them (RelayMetrics.render_off_loop)
        prev = self._prev
        dt = now - prev["time"] if prev is not None else 0.0
        found, events_in, hosts = await asyncio.to_thread(_read_registry, service.metrics,
                                                          prev["eventsIn"] if prev is not None else None, dt)
        total_in = sum(events_in.values())
        sequenced = by_label(found, "relay_events_sequenced_total", "type")
        buckets = [(lab["le"], v) for lab, v in found.get("relay_ingest_to_broadcast_seconds_bucket", [])]
        count = value(found, "relay_ingest_to_broadcast_seconds_count")
        window = "since start"
        if prev is not None and count > prev["latencyCount"]:
            before = dict(prev["latencyBuckets"])
            buckets_now = [(le, c - before.get(le, 0.0)) for le, c in buckets]
            lat_count, window = count - prev["latencyCount"], f"last {dt:.0f} s"
        else:
            buckets_now, lat_count = buckets, count
        for host, rejected in service.host_ledger.totals().items():
            hosts.setdefault(host, {"eventsIn": 0.0, "rate": None})["rejected"] = rejected
        counted = service.consumers.by_encoding()
        prev_enc: dict[str, dict[str, int]] = prev["encodings"] if prev is not None else {}
        consumers: dict[str, dict[str, Any]] = {}
        for enc, row in counted.items():
            sent_before = prev_enc.get(enc, {}).get("bytesSent", 0)
            consumers[enc] = {**row, "bytesPerSecond": _rate(row["bytesSent"], sent_before, dt)
                              if prev is not None else None}
        core = service.core  # None while the relay starts
        broadcaster = core.broadcaster if core is not None else None
        head = broadcaster.latest_seq if broadcaster is not None else 0
        sessions: list[dict[str, Any]] = sorted(
            ({"lag": max(0, head - (s.last_seq if s.last_seq is not None else head)), "lastSeq": s.last_seq,
              "cursor": s.cursor, "live": s.live} for s in (broadcaster.sessions if broadcaster is not None else ())),
            key=lambda s: -int(s["lag"]))
        sequencer = service.sequencer
        resync = service.resync
        entries = resync.queue.entries() if resync is not None else []
        report: dict[str, Any] = {
            "id": self.id, "time": now, "role": service.role, "state": service.phase, "version": service.version,
            "ready": not reasons, "reasons": reasons, "waitingFor": service.lease_holder,
            "seq": value(found, "relay_current_seq") if sequencer is not None else head,
            "broadcastSeq": head,
            "sequencer": None if sequencer is None else {
                "state": sequencer.state, "secondsSinceLastCommit": value(found, "relay_last_sequenced_age_seconds")},
            "store": {"up": value(found, "relay_store_up") == 1, "backend": getattr(core.store, "backend", None) if core is not None else None},
            "bus": {"kind": "redis" if service.config.redis_url else "in-process",
                    "up": value(found, "relay_bus_up") == 1,
                    "events": by_label(found, "relay_broadcast_events_total", "event")},
            "ingest": None if sequencer is None else {
                "eventsIn": total_in, "rate": _rate(total_in, prev["eventsInTotal"] if prev else None, dt),
                "sequenced": sequenced,
                "sequencedRate": _rate(sum(sequenced.values()), prev["sequencedTotal"] if prev else None, dt),
                "verdicts": [{"kind": lab["kind"], "reason": lab["reason"], "count": v}
                             for lab, v in found.get("relay_verdicts_total", [])],
                "latency": {"p50": quantile(buckets_now, lat_count, 0.5), "p99": quantile(buckets_now, lat_count, 0.99),
                            "window": window, "count": count}},
            "hosts": hosts if sequencer is not None else {},
            "consumers": {"count": len(service.consumers), "byEncoding": consumers, "sessions": sessions[:SESSIONS_IN_REPORT],
                          "maxLag": sessions[0]["lag"] if sessions else 0, "connections": sorted(service.consumers.list(), key=lambda c: -int(c["bytesSent"]))[:SESSIONS_IN_REPORT]},
            "resync": None if resync is None else {
                "queue": len(entries), "results": by_label(found, "relay_resyncs_total", "result"),
                "oldest": [{"did": e.did, "since": e.since, "state": e.state, "attempts": e.attempts,
                            "lastFailure": e.last_failure, "lastError": e.last_error, "nextRetry": e.next_retry}
                           for e in entries[:DESYNC_IN_REPORT]]},
            "crawling": None if service.hosts is None else
            {"enabled": service.hosts.crawling_enabled, "source": service.hosts.crawling_source},
        }
        self._prev = {"time": now, "eventsIn": events_in, "eventsInTotal": total_in, "latencyCount": count,
                      "latencyBuckets": buckets, "sequencedTotal": sum(sequenced.values()),
                      "encodings": counted}
        self._latest = report
        return report


def public(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` without what only the admin may see: consumers' addresses and user agents, and
    the desynchronized accounts (``/admin/desynchronized`` is admin-only too)."""
    out = dict(report)
    consumers = dict(out["consumers"])
    consumers["connections"] = [{k: v for k, v in c.items() if k not in ("remote", "userAgent")}
                                for c in consumers.get("connections", [])]
    out["consumers"] = consumers
    if out.get("resync"):
        out["resync"] = {k: v for k, v in out["resync"].items() if k != "oldest"}
    return out
