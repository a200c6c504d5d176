"""The operator console on one process, every action through the page in Chromium.

A relay fed by the simulator (four PDS hosts, two crawled, two added through the page) plus 1,500
stored hosts for the host table's server-side search, sort and pages. Each action is clicked on
the page, then checked where it lands (the admin API, the store, the public XRPC, the audit),
and the page must show the result. Consumers' bytes are checked against what two real clients
(a CBOR subscribeRepos one and a JSON /subscribe one) received on the wire. Screenshots are
written to ``$RELAY_TEST_ARTIFACTS`` and checked (a real image, not blank, with the expected text).
"""

from __future__ import annotations

import httpx
import pytest

from backfill.store import Store
from backfill.types import HostState
from sim import SimConfig, SimFleet
from tests.relay.conftest import RelayFactory
from tests.relay.console_page import (
    WireCounter,
    console,
    flashed,
    login,
    polled,
    screenshot,
    shown,
    valued,
)
from tests.relay.e2e import crawl, metric_value
from tests.waiting import until_async

#: a long browser flow on a loaded machine
pytestmark = pytest.mark.timeout(600)
TOKEN = "console-token"
BULK_HOSTS = 1500


async def test_console_every_action_in_chromium(relay_factory: RelayFactory) -> None:
    fleet = SimFleet(SimConfig(hosts=4, accounts_per_host=3, seed=41))
    await fleet.start()
    a, b, c, d = fleet.hosts
    auth = {"authorization": f"Bearer {TOKEN}"}
    try:
        async with relay_factory(allow_insecure_hosts=True, plc_url=fleet.plc_url, handle_resolver_url=fleet.plc_url,
                                 validation_workers=0, admin_token=TOKEN, resync_retry_base="0.2s",
                                 resync_retry_max="1s") as relay, \
                httpx.AsyncClient(base_url=relay.url, headers=auth, timeout=30) as http:
            store = relay.service.store
            for i in range(BULK_HOSTS):  # stored, never followed (no run is started for them)
                await store.upsert_host(HostState(hostname=f"pds{i:04d}.bulk.example", status="idle",
                                                  account_count=i % 3, created_at=1.0))
            ws = relay.url.replace("http://", "ws://")
            async with WireCounter(ws + "/xrpc/com.atproto.sync.subscribeRepos") as cbor, \
                    WireCounter(ws + "/subscribe") as json_consumer:
                for host in (a, b):
                    await crawl(relay.url, host.hostname)
                victim = next(acct for acct in fleet.accounts if acct.host is a)
                fleet.inject("bad_signature", victim)
                await fleet.generate(20)
                await settle(http, fleet, {a.hostname, b.hostname})
                await drive(relay.url, http, store, fleet, cbor, json_consumer)
    finally:
        await fleet.stop()


async def settle(http: httpx.AsyncClient, fleet: SimFleet, hosts: set[str]) -> None:
    """Wait until every accepted event of ``hosts`` is sequenced."""
    accepted = len([t for t in fleet.ground_truth if t.verdict == "accept" and t.host in hosts])

    async def done() -> bool:
        return metric_value((await http.get("/metrics")).text, "relay_events_sequenced_total") >= accepted

    await until_async(done, "every accepted event to be sequenced")


async def drive(url: str, http: httpx.AsyncClient, store: Store, fleet: SimFleet, cbor: WireCounter,
                json_consumer: WireCounter) -> None:
    """Every console action through the page at ``url`` (one process, or a fan-out of a
    deployment), each checked where it lands: ``http`` is a client of the relay that holds the
    hosts (the process itself, or the ingest) with the admin token; ``store`` its store."""
    a, b, c, d = fleet.hosts
    dialogs: list[str] = []
    async with console(url, dialogs) as page, httpx.AsyncClient(base_url=url) as here:
        # -- public view: host table served in pages by the server; no action anywhere
        await shown(page, "#host-page", f"1–50 of {BULK_HOSTS + 2:,}")
        assert await page.locator("button[data-action]").count() == 0
        assert not await page.locator("#accounts").is_visible()
        assert (await here.get("/dashboard/api/accounts?q=x")).status_code == 401
        assert (await here.get("/dashboard/api/accounts?q=x", headers={"authorization": "Bearer no"})).status_code == 403
        await page.click("#host-next")
        await shown(page, "#host-page", f"51–100 of {BULK_HOSTS + 2:,}")
        # by name: the two sim hosts (127.0.0.1:…), then pds0000…; the second page starts at the 51st
        await page.wait_for_function("document.querySelector('#hosts tbody tr').dataset.host === 'pds0048.bulk.example'",
                                     timeout=30_000)
        await page.fill("#host-q", b.hostname.split(":")[1])  # the port: only host b matches
        await shown(page, "#host-page", "1–1 of 1")
        await shown(page, f'#hosts tr[data-host="{b.hostname}"] td[data-field="status"]', "active")
        await page.fill("#host-q", "")
        await shown(page, "#host-page", f"1–50 of {BULK_HOSTS + 2:,}")
        await page.click('#hosts th[data-sort="accounts"]')  # most accounts first: the two sim hosts (3 each)
        await page.wait_for_function("document.querySelector('#hosts th[data-sort=accounts]').dataset.order === 'desc'")
        await page.wait_for_function(
            f"""() => {{ const rows = [...document.querySelectorAll('#hosts tbody tr')].slice(0, 2).map(r => r.dataset.host);
                 return rows.length === 2 && rows.includes('{a.hostname}') && rows.includes('{b.hostname}'); }}""")
        metrics = (await http.get("/metrics")).text
        await valued(page, f'#hosts tr[data-host="{a.hostname}"] td[data-field="eventsIn"]',
                     metric_value(metrics, "relay_events_in_total", host=a.hostname))
        await screenshot(page, "console-public", ["Relay console", "Deployment", a.hostname, "frames in (since start)"])

        # -- admin
        await login(page, TOKEN)
        # add a host (with an account limit) and have another ask for a crawl, both from the page
        await page.fill("#add-host-name", c.hostname)
        await page.fill("#add-host-limit", "5")
        await page.click("#add-host")
        await flashed(page, f"add host {c.hostname}: done")
        await page.fill("#add-host-name", d.hostname)
        await page.click("#request-crawl")
        await flashed(page, f"requestCrawl {d.hostname}: done")
        listed = {h["hostname"]: h for h in (await http.get("/admin/hosts?limit=1000")).json()["hosts"]}
        assert listed[c.hostname]["accountLimit"] == 5 and listed[d.hostname]["status"] == "active"
        await settle(http, fleet, {h.hostname for h in fleet.hosts})

        # host detail: verdicts by reason (the injected bad signature), cursor, connection
        await page.fill("#host-q", a.hostname.split(":")[1])
        await page.click(f'#hosts tr[data-host="{a.hostname}"] a[data-action="detail"]')
        rejected = [t for t in fleet.ground_truth if t.host == a.hostname and t.verdict == "reject"]
        assert [t.reason for t in rejected] == ["bad_signature"]
        await valued(page, '#detail-verdicts tr[data-verdict="reject/bad_signature"] td[data-field="count"]', 1)
        await shown(page, '#detail-connection [data-field="connected"]', "true")
        stored = await store.get_host(a.hostname)
        assert stored is not None
        await shown(page, '#detail-kv [data-field="cursor"]', f"{stored.cursor:,}")
        # limits
        await page.fill("#limit-accounts", "2")
        await page.fill("#limit-per-second", "7")
        await page.click("#limits-save")
        await flashed(page, f"limits of {a.hostname}: done")
        view = {h["hostname"]: h for h in (await http.get("/admin/hosts?limit=1000")).json()["hosts"]}[a.hostname]
        assert view["accountLimit"] == 2 and view["rateLimits"]["perSecond"] == 7
        await shown(page, '#detail-kv [data-field="accountLimit"]', "2")
        # block, then unblock (a confirmation first)
        await page.click("#detail-block")
        await flashed(page, f"block {a.hostname}: done")
        assert await _status(store, a.hostname) == "banned"
        assert any("Block" in m for m in dialogs)
        await shown(page, "#detail-block", "unblock")
        await page.click("#detail-block")
        await flashed(page, f"unblock {a.hostname}: done")
        assert await _status(store, a.hostname) == "active"
        # resync every account of the host
        await page.click("#detail-resync")
        text = await flashed(page, f"resync host {a.hostname}: done")
        assert "(3 accounts queued)" in text

        async def resynced() -> bool:
            return metric_value((await http.get("/metrics")).text, "relay_resyncs_total", result="ok") >= 3

        await until_async(resynced, "the host's three accounts to be resynced")

        # domain bans
        await page.fill("#ban-domain", "spam.example")
        await page.click("#ban-add")
        await flashed(page, "ban spam.example: done")
        await page.wait_for_selector('#bans tr[data-domain="spam.example"]', timeout=30_000)
        assert (await http.get("/admin/domain-bans")).json()["domains"] == ["spam.example"]
        await page.click('#bans tr[data-domain="spam.example"] button[data-action="unban"]')
        await flashed(page, "unban spam.example: done")
        await page.wait_for_selector('#bans tr[data-domain="spam.example"]', state="detached", timeout=30_000)
        assert (await http.get("/admin/domain-bans")).json()["domains"] == []

        # accounts: by handle, take down and restore, resync (its host failing first: desynchronized, by age)
        acct = next(x for x in fleet.accounts if x.host is b)
        await page.fill("#account-q", acct.handle)
        await page.click("#account-search")
        row = f'#accounts tr[data-did="{acct.did}"]'
        await shown(page, row + ' td[data-field="handle"]', acct.handle)
        await shown(page, row + ' td[data-field="status"]', "active")
        await page.click(row + ' button[data-action="takedown"]')
        await flashed(page, f"take down {acct.did}: done")
        await shown(page, row + ' td[data-field="localStatus"]', "takendown")
        status = (await http.get("/xrpc/com.atproto.sync.getRepoStatus", params={"did": acct.did})).json()
        assert status == {"did": acct.did, "active": False, "status": "takendown"}
        await page.click(row + ' button[data-action="restore"]')
        await flashed(page, f"restore {acct.did}: done")
        await shown(page, row + ' td[data-field="localStatus"]', "active")
        assert (await http.get("/xrpc/com.atproto.sync.getRepoStatus", params={"did": acct.did})).json()["active"]
        b.fail_repos("500")
        await page.click(row + ' button[data-action="resync"]')
        await flashed(page, f"resync {acct.did}: done")
        desync_row = f'#desync tr[data-did="{acct.did}"]'
        await page.wait_for_selector(desync_row, timeout=30_000)
        await page.wait_for_function(
            f"""() => {{ const r = document.querySelector('{desync_row}'); return r && r.cells[4].textContent !== '–'; }}""",
            timeout=30_000)  # its last failure is shown
        await screenshot(page, "console-admin", ["Desynchronized accounts", acct.did, "Domain bans", a.hostname])
        b.heal_repos()
        await page.wait_for_selector(desync_row, state="detached", timeout=30_000)
        await shown(page, row + ' td[data-field="syncState"]', "synced")

        # public crawling off
        await page.click("#crawling-toggle")
        await flashed(page, "public crawling: done")
        assert (await http.get("/admin/crawling")).json()["enabled"] is False

        # audit: every action above, performed through the admin API
        actions = {x["action"] for x in (await http.get("/admin/audit")).json()["actions"]}
        assert {"add_host", "set_limits", "block_host", "unblock_host", "resync_host", "ban_domain",
                "unban_domain", "set_local_status", "resync_account", "set_crawling"} <= actions, actions

        # consumers: bytes per encoding as the clients received them
        await until_async(lambda: _quiet(here), "delivery to finish")
        for encoding, client in (("cbor", cbor), ("json", json_consumer)):
            assert client.bytes > 0
            await valued(page, f'#encodings tr[data-encoding="{encoding}"] td[data-field="bytesSent"]', client.bytes)
        assert json_consumer.bytes != cbor.bytes
        await polled(page)
        await screenshot(page, "console-consumers", ["Consumers by encoding", "json", "cbor", "since start"])


async def _quiet(http: httpx.AsyncClient) -> bool:
    """Nothing sequenced is waiting for a consumer (every session is at the broadcast head)."""
    data = (await http.get("/dashboard/data")).json()
    return bool(data["consumers"]["maxLag"] == 0)


async def _status(store: Store, hostname: str) -> str:
    host = await store.get_host(hostname)
    assert host is not None
    return host.status
