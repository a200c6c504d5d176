"""The cost of metrics per host: no ``*_created`` copies, a banned host's series removed, the
exposition built off the event loop, and the open-file limit raised at start (one socket per host).
"""

from __future__ import annotations

import asyncio
import resource
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.metrics_core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from relay import host_series
from relay.fdlimit import raise_open_file_limit
from relay.host_series import HostSeries
from sim import SimConfig, SimFleet
from tests.relay.e2e import ADMIN_TOKEN, Consumer, crawl
from tests.waiting import until


async def test_a_banned_hosts_series_are_removed_and_no_created_copies(relay_factory: Any, tmp_path: Path) -> None:
    fleet = SimFleet(SimConfig(hosts=2, accounts_per_host=1, seed=29))
    await fleet.start()
    try:
        settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0,
                    "admin_token": ADMIN_TOKEN}
        async with relay_factory(**settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer, \
                httpx.AsyncClient(base_url=relay.url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
            gone, kept = fleet.hosts[0].hostname, fleet.hosts[1].hostname
            for host in (gone, kept):
                await crawl(relay.url, host)
            truth = await fleet.generate(6)
            await consumer.wait_for(lambda evs: {t.rev for t in truth} <= {e.rev for e in evs})
            before = (await http.get("/metrics")).text
            assert f'host="{gone}"' in before and f'host="{kept}"' in before
            assert "_created" not in before  # one series per child, not two
            r = await http.post(f"/admin/hosts/{gone}/block")
            assert r.status_code == 200, r.text
            after = (await http.get("/metrics")).text
            assert f'host="{gone}"' not in after
            assert f'relay_events_in_total{{host="{kept}"' in after
    finally:
        await fleet.stop()


class _HeldCollector:
    """A collector whose ``collect`` (run by the scrape) waits for the test to let it go."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.timed_out = False

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("relay_test_held", "held by the test")

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.entered.set()
        # on the loop's thread nothing could release it: only this bound would
        self.timed_out = not self.release.wait(10)
        yield GaugeMetricFamily("relay_test_held", "held by the test", value=1)


async def test_the_scrape_is_rendered_off_the_event_loop(relay_factory: Any) -> None:
    """While the exposition is being built (held inside a collector), the loop still answers."""
    async with relay_factory() as relay, httpx.AsyncClient(base_url=relay.url, timeout=10) as http:
        held = _HeldCollector()
        relay.service.metrics.registry.register(held)
        try:
            scrape = asyncio.create_task(http.get("/metrics"))
            await until(held.entered.is_set, "the scrape to reach the held collector")
            health = await http.get("/_health")  # served by the loop the scrape is not blocking
            assert health.status_code == 200
            assert not scrape.done()
        finally:
            held.release.set()
        text = (await scrape).text
        assert "relay_test_held 1.0" in text
        assert not held.timed_out  # released by this test, which ran while the scrape was held


def test_the_open_file_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, 4096 if hard == resource.RLIM_INFINITY else hard) - 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        found = raise_open_file_limit()
        assert found.before == lowered and found.raised
        now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert now == found.soft and now > lowered
        if hard != resource.RLIM_INFINITY:
            assert now == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _families(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` as Prometheus' own parser reads ``text``."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_per_host_series_follow_every_count_and_go_with_the_host() -> None:
    """Rendered text is cached per host; a count after a render shows in the next one, a host's
    label is escaped, and ``forget`` leaves nothing of the host behind."""
    series = HostSeries()
    odd = 'a"b\\c.example'
    series.count_in("one.example", "#commit")
    series.count_in(odd, "#identity", 2)
    series.count_reset(odd, "future_cursor")
    series.set_accounts({"one.example": (3, None), odd: (4, 10)})
    first = _families(series.render())
    assert first[("relay_events_in_total", (("host", "one.example"), ("type", "#commit")))] == 1
    assert first[("relay_events_in_total", (("host", odd), ("type", "#identity")))] == 2
    assert first[("relay_host_cursor_resets_total", (("host", odd), ("reason", "future_cursor")))] == 1
    assert first[("relay_host_accounts", (("host", odd),))] == 4
    assert first[("relay_host_account_limit", (("host", odd),))] == 10
    assert ("relay_host_account_limit", (("host", "one.example"),)) not in first
    series.count_in("one.example", "#commit", 5)  # after the render that cached one.example's lines
    series.set_accounts({"one.example": (6, None), odd: (4, 10)})
    second = _families(series.render())
    assert second[("relay_events_in_total", (("host", "one.example"), ("type", "#commit")))] == 6
    assert second[("relay_host_accounts", (("host", "one.example"),))] == 6
    assert series.events_in() == {"one.example": 6.0, odd: 2.0}
    series.forget(odd)
    third = series.render()
    assert all(dict(labels).get("host") != odd for _, labels in _families(third))
    assert "a\\\"b" not in third and odd not in series.hosts()
    assert _families(third)[("relay_events_in_total", (("host", "one.example"), ("type", "#commit")))] == 6


def test_a_scrape_of_thousands_of_hosts_renders_only_what_changed() -> None:
    """The second scrape of 2,000 hosts, two of which received a frame, formats only those two
    hosts' lines again (the others are joined from the cache)."""
    series = HostSeries()
    for i in range(2000):
        series.count_in(f"pds{i}.example", "#commit", i)
    series.render()
    series.count_in("pds7.example", "#commit")
    series.count_in("pds9.example", "#account")
    formatted: list[str] = []
    real = host_series.number

    def counted(n: int) -> str:
        formatted.append(str(n))
        return real(n)

    host_series.number = counted  # type: ignore[assignment]
    try:
        text = series.render()
    finally:
        host_series.number = real  # type: ignore[assignment]
    assert sorted(formatted) == ["1", "8", "9"]  # pds7 #commit, pds9 #commit and #account
    parsed = _families(text)
    assert parsed[("relay_events_in_total", (("host", "pds7.example"), ("type", "#commit")))] == 8
    assert parsed[("relay_events_in_total", (("host", "pds1999.example"), ("type", "#commit")))] == 1999
