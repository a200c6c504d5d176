"""Executor-side pieces without Spark: JSON form of records, the judgement, SSRF check, fetches
against a real simulated host, DID resolution from the simulated PLC directory, DB URL handling."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpcore
import httpx
import pytest

from mst.cid import cid_for_cbor, cid_str
from spark.config import FetchConfig
from spark.dagjson import record_json
from spark.db import split_schema, to_dollar
from spark.fetch import FetchError, HostFetcher, TokenBucket, shared_ssl_context
from spark.identity import IdentityClient, IdentityError
from spark.repo_check import FetchedRepo, StoredAccount, judge
from spark.ssrf import SsrfError, check_url, pinned_transport
from tests.spark.helpers import FleetThread


def test_record_json_uses_link_and_bytes_forms() -> None:
    cid = cid_for_cbor(b"\xa0")
    text = record_json({"b": b"\x00\x01\xff", "a": cid, "n": [1, None, True], "s": "é"})
    link = '{"$link":"' + cid_str(cid) + '"}'
    assert text == '{"a":' + link + ',"b":{"$bytes":"AAH/"},"n":[1,null,true],"s":"é"}'


def _fetched(rev: str, commit: str, data: str) -> FetchedRepo:
    return FetchedRepo("did:plc:x", rev, commit, data, b"", {}, {}, 1)


@pytest.mark.parametrize(
    ("stored", "expected"),
    [
        (("3k2", "c1", "d1", "synced"), ("ok", None)),
        (("3k2", "c1", "d1", "desynchronized"), ("repaired", "desync_cleared")),
        ((None, None, None, "desynchronized"), ("repaired", "state_missing")),
        (("3k1", "c0", "d0", "synced"), ("repaired", "state_diverged")),
        (("3k2", "c1", "dX", "synced"), ("repaired", "state_diverged")),
        (("3k3", "c9", "d9", "synced"), ("ok", "relay_ahead")),
    ],
)
def test_judge(stored: tuple, expected: tuple) -> None:
    rev, commit, data, state = stored
    verdict = judge(StoredAccount("did:plc:x", "h", rev, commit, data, state), _fetched("3k2", "c1", "d1"))
    assert (verdict.outcome, verdict.reason) == expected


def test_ssrf_check() -> None:
    with pytest.raises(SsrfError) as exc:
        check_url("http://127.0.0.1:1234/x")
    assert exc.value.reason == "private_address"
    check_url("http://127.0.0.1:1234/x", allow_private=True)
    for url, reason in [("ftp://example.com/", "bad_scheme"), ("http://u:p@example.com/", "userinfo_not_allowed"),
                        ("http://[::1]:80/", "private_address"), ("http://10.1.2.3/", "private_address"),
                        ("http://169.254.169.254/latest", "private_address"), ("http://:80/", "bad_url")]:
        with pytest.raises(SsrfError) as exc:
            check_url(url)
        assert exc.value.reason == reason, url


def test_token_bucket_limits_rate() -> None:
    bucket = TokenBucket(rate=50.0, burst=1.0)
    start = time.monotonic()
    for _ in range(6):
        bucket.acquire()
    assert time.monotonic() - start >= 5 / 50.0 * 0.9


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fetch_errors_are_typed(fleet: FleetThread) -> None:
    host = fleet.fleet.hosts[0]
    cfg = FetchConfig(allow_private=True, timeout_s=5.0, retries=1, backoff_s=0.01, host_rate=1000.0)
    with HostFetcher(host.url, cfg) as fetcher:
        listing = fetcher.get("/xrpc/com.atproto.sync.listRepos").json()
        assert len(listing["repos"]) == 10
        with pytest.raises(FetchError) as exc:
            fetcher.get("/xrpc/com.atproto.sync.getRepo", {"did": "did:plc:aaaaaaaaaaaaaaaaaaaaaaaa"})
        assert exc.value.reason == "repo_not_found"
        did = listing["repos"][0]["did"]
        with pytest.raises(FetchError) as exc:
            fetcher.get("/xrpc/com.atproto.sync.getRepo", {"did": did}, max_bytes=100)
        assert exc.value.reason == "too_large"
        with pytest.raises(FetchError) as exc:
            fetcher.get("/xrpc/no.such.method")
        assert exc.value.reason == "http_404"
    with HostFetcher(host.url, FetchConfig()) as guarded:  # loopback is refused by default
        with pytest.raises(FetchError) as exc:
            guarded.get("/xrpc/com.atproto.sync.listRepos")
        assert exc.value.reason == "ssrf_private_address"
    with HostFetcher(f"http://127.0.0.1:{_closed_port()}", cfg) as dead:
        with pytest.raises(FetchError) as exc:
            dead.get("/xrpc/_health")
        assert exc.value.reason == "connect_error"


def test_identity_from_simulated_plc(fleet: FleetThread) -> None:
    acct = fleet.fleet.accounts[0]
    client = IdentityClient(FetchConfig(allow_private=True, plc_url=fleet.fleet.plc_url, retries=0))
    try:
        ident = client.resolve(acct.did)
        assert ident.signing_key == "did:key:" + acct.key.multibase
        assert ident.pds == acct.host.url
        with pytest.raises(IdentityError) as exc:
            client.resolve("did:plc:aaaaaaaaaaaaaaaaaaaaaaaa")
        assert exc.value.reason == "did_not_found"
        with pytest.raises(IdentityError) as exc:
            client.resolve("did:example:123")
        assert exc.value.reason == "unsupported_did_method"
    finally:
        client.close()


def test_db_url_helpers() -> None:
    assert to_dollar("a = ? AND b IN (?, ?)") == "a = $1 AND b IN ($2, $3)"
    assert split_schema("postgresql://u@h:5432/db?schema=s1&sslmode=disable") == (
        "postgresql://u@h:5432/db?sslmode=disable", "s1")
    assert split_schema("postgresql://u@h/db") == ("postgresql://u@h/db", None)


def test_outbox_events_respect_account_status() -> None:
    from backfill.outbox import event_for

    sync = {"kind": "#sync", "did": "did:plc:x", "rev": "3k2", "blocks": b"car", "active": None, "status": None,
            "upstream_status": "active", "local_status": "active"}
    event = event_for(sync, 0.0)
    assert event is not None and event.kind == "#sync" and event.rev is None and event.account is None
    assert event.body["rev"] == "3k2" and event.body["blocks"] == b"car" and event.body["time"].endswith("Z")
    assert event_for({**sync, "upstream_status": "deactivated"}, 0.0) is None
    assert event_for({**sync, "local_status": "takendown"}, 0.0) is None
    assert event_for({**sync, "upstream_status": None}, 0.0) is None  # account vanished
    account = {**sync, "kind": "#account", "active": False, "status": "suspended", "blocks": None}
    assert event_for(account, 0.0).body == {"did": "did:plc:x", "time": "1970-01-01T00:00:00.000Z",
                                            "active": False, "status": "suspended"}
    # an operator takedown outranks a host saying "active"
    reactivated = {**account, "active": True, "status": None, "local_status": "takendown"}
    assert event_for(reactivated, 0.0).body["status"] == "takendown"


def test_did_boundaries_split_evenly(tmp_path: Path) -> None:
    from spark.db import connect_db
    from spark.relaydb import AccountFilter, did_boundaries, read_accounts

    with connect_db(str(tmp_path / "r.sqlite")) as db:
        db.execute("CREATE TABLE accounts (did TEXT PRIMARY KEY, host TEXT, upstream_status TEXT DEFAULT 'active', "
                   "local_status TEXT DEFAULT 'active', rev TEXT, commit_cid TEXT, data_cid TEXT, "
                   "sync_state TEXT DEFAULT 'synced')")
        db.executemany("INSERT INTO accounts (did, host) VALUES (?, ?)", [(f"did:plc:{i:05d}", "h") for i in range(103)])
        for parts in (1, 2, 4, 7, 200):
            bounds = did_boundaries(db, parts, AccountFilter())
            assert len(bounds) == min(parts, 103)
            sizes = [len(read_accounts(db, lo, hi, AccountFilter())) for lo, hi in bounds]
            assert sum(sizes) == 103 and max(sizes) - min(sizes) <= max(sizes) // 2 + 1, (parts, sizes)
        assert did_boundaries(db, 4, AccountFilter(hosts=("nowhere",))) == [(None, None)]


class _RecordingNetwork(httpcore.NetworkBackend):
    """Stands in for the network below the pinned transport: records where each socket would go."""

    def __init__(self) -> None:
        self.connects: list[tuple[str, int]] = []

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):  # type: ignore[no-untyped-def]
        self.connects.append((host, port))
        raise httpcore.ConnectError("no internet here")

    def connect_unix_socket(self, path, timeout=None, socket_options=None):  # type: ignore[no-untyped-def]
        raise AssertionError("unix socket")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def test_fetcher_connections_are_pinned_to_checked_addresses() -> None:
    """The check happens when connecting, on the address the socket then uses: a name that now
    resolves to loopback is refused with no socket opened, and a public address is connected to
    as an address, not re-resolved."""
    net = _RecordingNetwork()
    with httpx.Client(transport=pinned_transport(shared_ssl_context(), 2, backend=net), trust_env=False) as client:
        with pytest.raises(SsrfError) as exc:
            client.get("http://localhost:8080/xrpc/_health")
        assert exc.value.reason == "private_address" and net.connects == []
        with pytest.raises(httpx.ConnectError):
            client.get("http://93.184.216.34/xrpc/_health")
        assert net.connects == [("93.184.216.34", 80)]
    net = _RecordingNetwork()
    with httpx.Client(transport=pinned_transport(shared_ssl_context(), 2, allow_private=True, backend=net)) as client:
        with pytest.raises(httpx.ConnectError):
            client.get("http://localhost:8080/")
        assert net.connects and net.connects[0] in (("127.0.0.1", 8080), ("::1", 8080))  # the address, not the name
