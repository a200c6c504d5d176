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

from relay.fdlimit import raise_open_file_limit
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
