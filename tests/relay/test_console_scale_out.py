"""The operator console in scale-out: an ingest and three fan-outs on PostgreSQL + Redis.

The page is opened on a fan-out (where the chart's Ingress sends ``/dashboard``). It must show the
whole deployment — every process, the ingest's rates, the hosts with their frames in, consumers
connected to other fan-outs — and every action clicked there must reach the ingest (forwarded to
``RELAY_CONSOLE_INGEST_URL``): the same drive as on one process (``test_console.drive``). A fan-out
without that setting refuses actions with 501, and a wrong token is refused on the fan-out itself.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from backfill.types import HostState
from relay.config import RelayConfig
from relay.service import RelayService
from sim import SimConfig, SimFleet
from tests.relay.console_page import WireCounter, console, screenshot, shown, valued
from tests.relay.e2e import crawl, metric_value
from tests.relay.helpers import drop_schema_and_stream, serve_asgi
from tests.relay.test_console import BULK_HOSTS, TOKEN, drive, settle

#: a long browser flow on a loaded machine
pytestmark = pytest.mark.timeout(600)
ROWS = "#replicas tbody tr"


@contextlib.asynccontextmanager
async def serving(config: RelayConfig, role: str, stream: str) -> AsyncIterator[tuple[RelayService, str]]:
    service = RelayService(config, role=role, bus_stream=stream)
    await service.start()
    try:
        async with serve_asgi(service.build_app()) as url:
            yield service, url
    finally:
        await service.stop()


async def test_console_scale_out_in_chromium(pg_dsn: str, redis_url: str) -> None:
    schema = f"t_relay_{uuid.uuid4().hex[:12]}"
    stream = f"test:relay:{schema}"
    fleet = SimFleet(SimConfig(hosts=4, accounts_per_host=3, seed=43))
    await fleet.start()
    a, b, _, _ = fleet.hosts
    base = {"database_url": f"{pg_dsn}?schema={schema}", "redis_url": redis_url, "bind": "127.0.0.1:0",
            "allow_insecure_hosts": "true", "plc_url": fleet.plc_url, "handle_resolver_url": fleet.plc_url,
            "validation_workers": "0", "admin_token": TOKEN, "resync_retry_base": "0.2s", "resync_retry_max": "1s"}
    auth = {"authorization": f"Bearer {TOKEN}"}
    try:
        async with serving(RelayConfig.from_values(base), "ingest", stream) as (ingest, ingest_url):
            fanout = RelayConfig.from_values({**base, "console_ingest_url": ingest_url})
            async with serving(fanout, "fanout", stream) as (_, page_url), \
                    serving(fanout, "fanout", stream) as (other, other_url), \
                    serving(RelayConfig.from_values(base), "fanout", stream) as (_, lone_url), \
                    httpx.AsyncClient(base_url=ingest_url, headers=auth, timeout=30) as http:
                for i in range(BULK_HOSTS):
                    await ingest.store.upsert_host(HostState(hostname=f"pds{i:04d}.bulk.example", status="idle",
                                                             account_count=i % 3, created_at=1.0))
                # consumers on two other fan-outs: the page's fan-out shows them too
                async with WireCounter(other_url.replace("http://", "ws://") + "/xrpc/com.atproto.sync.subscribeRepos") as cbor, \
                        WireCounter(lone_url.replace("http://", "ws://") + "/subscribe") as json_consumer:
                    for host in (a, b):
                        await crawl(ingest_url, host.hostname)
                    victim = next(acct for acct in fleet.accounts if acct.host is a)
                    fleet.inject("bad_signature", victim)
                    await fleet.generate(20)
                    await settle(http, fleet, {a.hostname, b.hostname})
                    await _deployment_shown(page_url, ingest, other, http, fleet)
                    await drive(page_url, http, ingest.store, fleet, cbor, json_consumer)
                    await _refusals(lone_url, page_url, http)
    finally:
        await fleet.stop()
        await drop_schema_and_stream(pg_dsn, schema, redis_url, stream)


async def _deployment_shown(page_url: str, ingest: RelayService, other: RelayService, http: httpx.AsyncClient,
                            fleet: SimFleet) -> None:
    """The fan-out's page shows every process, the ingest's numbers and the hosts' frames in."""
    a, b, _, _ = fleet.hosts
    async with console(page_url) as page:
        await page.wait_for_function(f"document.querySelectorAll('{ROWS}').length === 4", timeout=30_000)
        roles = await page.eval_on_selector_all(ROWS + ' td[data-field="role"]', "els => els.map(e => e.textContent)")
        assert sorted(roles) == ["fanout", "fanout", "fanout", "ingest"]
        await shown(page, "#writer", ingest.reporter.id)
        await shown(page, f'#replicas tr[data-replica="{ingest.reporter.id}"] td[data-field="state"]',
                    "running · sequencer running")
        metrics = (await http.get("/metrics")).text
        seq = metric_value(metrics, "relay_current_seq")
        assert seq > 0
        await shown(page, "#seq", f"{int(seq):,}")
        await shown(page, "#events-in", f"{int(metric_value(metrics, 'relay_events_in_total')):,}")
        for host in (a, b):
            await valued(page, f'#hosts tr[data-host="{host.hostname}"] td[data-field="eventsIn"]',
                         metric_value(metrics, "relay_events_in_total", host=host.hostname))
        # the CBOR consumer on another fan-out is listed, by that fan-out
        await page.wait_for_selector(f'#replicas tr[data-replica="{other.reporter.id}"] td[data-field="consumers"][data-value="1"]',
                                     timeout=30_000)
        await screenshot(page, "console-scale-out", ["Deployment (4 processes)", ingest.reporter.id, other.reporter.id,
                                                     a.hostname])


async def _refusals(lone_url: str, page_url: str, http: httpx.AsyncClient) -> None:
    """A fan-out without RELAY_CONSOLE_INGEST_URL has no actions; a wrong token is refused on the
    fan-out and never reaches the ingest."""
    before = (await http.get("/admin/crawling")).json()["enabled"]
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(lone_url + "/dashboard/api/admin/crawling", json={"enabled": not before},
                              headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 501 and r.json()["error"] == "ActionsUnavailable"
        wrong_before = metric_value((await http.get("/metrics")).text, "relay_admin_requests_total", result="wrong")
        r = await client.post(page_url + "/dashboard/api/admin/crawling", json={"enabled": not before},
                              headers={"authorization": "Bearer nope"})
        assert r.status_code == 403 and r.json()["error"] == "InvalidToken"
        wrong_after = metric_value((await http.get("/metrics")).text, "relay_admin_requests_total", result="wrong")
        assert wrong_after == wrong_before
    async with console(lone_url) as page:
        await page.wait_for_function("document.getElementById('flash').textContent.includes('actions unavailable')",
                                     timeout=30_000)
    assert (await http.get("/admin/crawling")).json()["enabled"] is before
