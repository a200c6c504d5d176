"""The per-event metrics (``relay.metrics.TallyCounter``, ``TallyGauge``, ``TallyHistogram``) are
plain numbers read at scrape time: their exposition must be exactly what ``prometheus_client``'s
``Counter``, ``Gauge`` and ``Histogram`` of the same names print for the same observations, and a
scrape in another thread while the loop counts must not fail."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from relay.metrics import RelayMetrics, TallyCounter, TallyGauge, TallyHistogram

BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
#: on a bound, between bounds, below the first, above the last, zero
OBSERVED = (0.0, 0.0005, 0.001, 0.0010001, 0.003, 0.005, 0.04, 0.1, 0.7, 1.0, 2.5, 4.9, 10.0, 10.5, 99.0)


def test_the_tallies_print_what_prometheus_client_prints() -> None:
    ours, theirs = CollectorRegistry(auto_describe=True), CollectorRegistry(auto_describe=True)
    counter = TallyCounter("relay_verdicts_total", "Judgements", ["kind", "reason"], registry=ours)
    reference = Counter("relay_verdicts_total", "Judgements", ["kind", "reason"], registry=theirs)
    gauge = TallyGauge("relay_current_seq", "Highest seq", registry=ours)
    reference_gauge = Gauge("relay_current_seq", "Highest seq", registry=theirs)
    histogram = TallyHistogram("relay_lag_seconds", "Lag", buckets=BUCKETS, registry=ours)
    reference_histogram = Histogram("relay_lag_seconds", "Lag", buckets=BUCKETS, registry=theirs)
    for kind, reason, n in (("accept", "ok", 3), ("reject", "bad_signature", 1), ("ignore", "duplicate_event", 2)):
        for _ in range(n):
            counter.labels(kind, reason).inc()
            reference.labels(kind, reason).inc()
    counter.labels(kind="strip", reason="x").inc(5)  # by name too
    reference.labels(kind="strip", reason="x").inc(5)
    counter.labels("never", "counted")  # a series made and not counted is exported at 0
    reference.labels("never", "counted")
    for value in OBSERVED:
        histogram.observe(value)
        reference_histogram.observe(value)
    gauge.set(12345)
    reference_gauge.set(12345)
    assert generate_latest(ours).decode() == generate_latest(theirs).decode()
    assert counter.labels(kind="accept", reason="ok")._value.get() == 3  # as tests read a child


def test_a_scrape_in_another_thread_while_the_loop_adds_series() -> None:
    metrics = RelayMetrics()
    stop = threading.Event()
    errors: list[BaseException] = []

    def scrape() -> None:
        try:
            while not stop.is_set():
                metrics.render()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for i in range(20_000):
            metrics.child(metrics.verdicts, "reject", f"reason_{i}").inc()
            metrics.lag.observe(i / 10_000)
    finally:
        stop.set()
        scraper.join()
    assert errors == []
    text = metrics.render().decode()
    assert 'relay_verdicts_total{kind="reject",reason="reason_19999"} 1.0' in text
    assert "relay_ingest_to_broadcast_seconds_count 20000.0" in text
