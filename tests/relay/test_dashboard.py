"""The operator dashboard in a real browser (Debian's Chromium driven by Playwright).

Against a relay fed by the simulator, the page must show the same numbers as ``/metrics`` once
the traffic has settled; the admin view must need the token and act through the admin API. A
screenshot is written to ``$RELAY_TEST_ARTIFACTS`` (default ``test-artifacts/``) for a person to look at.
"""

from __future__ import annotations

import time

import httpx
from playwright.async_api import Page

from sim import SimConfig, SimFleet
from tests.relay.conftest import RelayFactory
from tests.relay.console_page import console, screenshot
from tests.relay.e2e import crawl, metric_value
from tests.waiting import until_async

TOKEN = "dash-token"


def number(text: str | None) -> float:
    assert text is not None
    return float(text.replace(",", ""))


async def shown(page: Page, selector: str) -> float:
    return number(await page.locator(selector).text_content())


async def settled_polls(page: Page, after: int) -> None:
    """Wait until the page has rendered a poll made after ``after`` polls."""
    await page.wait_for_function(f"Number(document.body.dataset.polls || 0) >= {after}", timeout=20_000)


async def test_dashboard_matches_metrics_in_chromium(relay_factory: RelayFactory) -> None:
    fleet = SimFleet(SimConfig(hosts=2, accounts_per_host=4, seed=33))
    await fleet.start()
    try:
        async with relay_factory(allow_insecure_hosts=True, plc_url=fleet.plc_url, validation_workers=0,
                                 admin_token=TOKEN) as relay, httpx.AsyncClient(base_url=relay.url) as http:
            for host in fleet.hosts:
                await crawl(relay.url, host.hostname)
            await fleet.generate(40)
            accepted = len([t for t in fleet.ground_truth if t.verdict == "accept"])

            async def all_sequenced() -> bool:
                text = (await http.get("/metrics")).text
                return metric_value(text, "relay_events_sequenced_total") >= accepted

            await until_async(all_sequenced, "every accepted event to be sequenced")
            read_at = time.time()
            metrics = (await http.get("/metrics")).text  # traffic has stopped: these numbers hold

            async def report_after_metrics() -> bool:
                """The console shows this process's report of every ``interval`` (2 s): wait for
                one collected after the metrics were read (on a fast machine the whole run takes
                less than an interval, and the page would show the report made while starting)."""
                writer = (await http.get("/dashboard/data")).json().get("writer")
                return writer is not None and float(writer["time"]) > read_at

            await until_async(report_after_metrics, "a console report collected after the metrics were read")

            async with console(relay.url) as page:
                await settled_polls(page, 3)
                assert await shown(page, "#seq") == metric_value(metrics, "relay_current_seq") > 0
                assert await shown(page, "#sequenced-total") == metric_value(metrics, "relay_events_sequenced_total")
                assert await shown(page, "#events-in") == metric_value(metrics, "relay_events_in_total")
                assert await shown(page, "#consumers") == metric_value(metrics, "relay_consumers")
                assert await shown(page, "#resync-queue") == metric_value(metrics, "relay_resync_queue")
                assert await page.locator("#store").text_content() == "up"
                for kind in ("#commit", "#identity", "#account"):
                    cell = f'#sequenced tr[data-type="{kind}"] td[data-field="count"]'
                    assert await shown(page, cell) == metric_value(metrics, "relay_events_sequenced_total", type=kind)
                verdict = '#verdicts tr[data-verdict="accept/ok"] td[data-field="count"]'
                assert await shown(page, verdict) == metric_value(metrics, "relay_verdicts_total",
                                                                  kind="accept", reason="ok")
                for host in fleet.hosts:
                    row = f'#hosts tr[data-host="{host.hostname}"]'
                    assert await shown(page, row + ' td[data-field="eventsIn"]') == \
                        metric_value(metrics, "relay_events_in_total", host=host.hostname) > 0
                    assert await page.locator(row + ' td[data-field="status"]').text_content() == "active"
                    assert await shown(page, row + ' td[data-field="accounts"]') == 4
                    stored = await relay.service.store.get_host(host.hostname)
                    assert stored is not None and await shown(page, row + ' td[data-field="cursor"]') == stored.cursor
                await screenshot(page, "dashboard", ["Relay console", fleet.hosts[0].hostname])

                # read-only without the token: no mutating control on the page
                assert await page.locator("button[data-action]").count() == 0
                assert (await http.get("/dashboard/data", headers={"authorization": "Bearer nope"})).status_code == 403
                # with it: connections are listed and a host can be blocked (through the admin API)
                await page.fill("#token", TOKEN)
                await page.click("#token-set")
                target = fleet.hosts[0].hostname
                button = f'#hosts tr[data-host="{target}"] button[data-action="block"]'
                await page.wait_for_selector(button, timeout=20_000)
                await page.click(button)
                await page.wait_for_selector(f'#hosts tr[data-host="{target}"] button[data-action="unblock"]',
                                             timeout=20_000)
                listed = (await http.get("/admin/hosts", headers={"authorization": f"Bearer {TOKEN}"})).json()
                assert {h["hostname"]: h["status"] for h in listed["hosts"]}[target] == "banned"
                audit = (await http.get("/admin/audit", headers={"authorization": f"Bearer {TOKEN}"})).json()
                assert any(a["target"] == target for a in audit["actions"])
    finally:
        await fleet.stop()
