"""Executor-side pieces without Spark: JSON form of records, the judgement, SSRF check, fetches
against a real simulated host, DID resolution from the simulated PLC directory, DB URL handling."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import replace
from pathlib import Path

import httpcore
import httpx
import pytest

from mst.cbor import encode
from mst.cid import cid_for_cbor, cid_str, parse_cid
from mst.errors import CBORError
from spark.config import FetchConfig
from spark.dagjson import _ENCODER, block_json, record_json
from spark.db import split_schema, to_dollar
from spark.fetch import FetchError, HostFetcher, TokenBucket, shared_ssl_context
from spark.identity import IdentityClient, IdentityError
from spark.partitioning import cid_strs
from spark.repo_check import FetchedRepo, StoredAccount, judge
from spark.ssrf import SsrfError, check_url, pinned_transport
from tests.spark.helpers import FleetThread

RAW_CID = "bafkreie5737gdxlw5i64vzichcalba3z2v5n6icifvx5xytvske7mr3hpm"  # raw codec


def test_record_json_uses_link_and_bytes_forms() -> None:
    cid = cid_for_cbor(b"\xa0")
    text = record_json({"b": b"\x00\x01\xff", "a": cid, "n": [1, None, True], "s": "é"})
    link = '{"$link":"' + cid_str(cid) + '"}'
    assert text == '{"a":' + link + ',"b":{"$bytes":"AAH/"},"n":[1,null,true],"s":"é"}'


def test_block_json_is_the_strict_decode_rendered_like_the_stdlib_encoder() -> None:
    """The C encoder built once renders exactly what ``JSONEncoder.encode`` would (escapes,
    nesting, key order), and a block that is not strict DAG-CBOR is refused."""
    cid = cid_for_cbor(b"\xa0")
    record = {"text": 'é "q" \\ \n\u2028', "z": [{"b": b"\x00", "a": cid}, [], {}], "n": -(2**63), "t": True}
    expected = _ENCODER.encode(record)
    assert block_json(encode(record)) == expected == record_json(record)
    assert json.loads(expected)["z"][0] == {"a": {"$link": cid_str(cid)}, "b": {"$bytes": "AA"}}
    with pytest.raises(CBORError):
        block_json(encode(record) + b"\x00")  # trailing bytes
    with pytest.raises(CBORError):
        block_json(b"\xa2\x61b\x01\x61a\x02")  # map keys out of canonical order


def test_cid_strs_equals_cid_str_for_each() -> None:
    cids = [cid_for_cbor(encode(i)) for i in range(300)] + [parse_cid(RAW_CID)]
    assert cid_strs(cids) == [cid_str(c) for c in cids]
    assert cid_strs([]) == []


def _fetched(rev: str, commit: str, data: str) -> FetchedRepo:
    return FetchedRepo("did:plc:x", rev, commit, data, b"", {}, {}, 1)


@pytest.mark.parametrize(
    ("stored", "expected"),
    [
        (("3k2", "c1", "d1", "synced"), ("ok", None)),
        (("3k2", "c1", "d1", "desynchronized"), ("queued", "desync_cleared")),
        ((None, None, None, "desynchronized"), ("queued", "state_missing")),
        (("3k1", "c0", "d0", "synced"), ("queued", "state_diverged")),
        (("3k2", "c1", "dX", "synced"), ("queued", "state_diverged")),
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


def test_repairs_are_applied_only_on_top_of_what_the_job_saw() -> None:
    """``decide_repair``: the compare-and-set each outbox row passes in its account's lane."""
    from backfill.outbox import Repair, RepairOutcome, decide_repair
    from firehose.state import AccountState

    did = "did:plc:x"
    relay = AccountState(did=did, host="h", rev="3k2", commit_cid="c2", data_cid="d2")
    sync = Repair(1, "#sync", did, host="h", rev="3k5", commit_cid="c5", data_cid="d5", blocks=b"car")
    assert decide_repair(sync, relay) == RepairOutcome.APPLIED  # the relay missed 3k3..3k5
    assert decide_repair(sync, replace(relay, rev="3k5", commit_cid="c5")) == RepairOutcome.STALE
    assert decide_repair(sync, replace(relay, rev="3k7")) == RepairOutcome.STALE  # never rolled back
    flagged = replace(relay, rev="3k5", commit_cid="c5", sync_state="desynchronized")
    assert decide_repair(sync, flagged) == RepairOutcome.DESYNC_CLEARED
    assert decide_repair(sync, replace(flagged, commit_cid="other")) == RepairOutcome.STALE
    assert decide_repair(sync, replace(relay, upstream_status="deactivated")) == RepairOutcome.INACTIVE
    assert decide_repair(sync, replace(relay, local_status="takendown")) == RepairOutcome.INACTIVE
    assert decide_repair(sync, replace(relay, sync_state="throttled")) == RepairOutcome.INACTIVE
    assert decide_repair(sync, replace(relay, host="elsewhere")) == RepairOutcome.STALE  # it moved
    assert decide_repair(sync, None) == RepairOutcome.UNKNOWN_ACCOUNT
    assert decide_repair(replace(sync, blocks=None), relay) == RepairOutcome.BAD_ROW
    assert decide_repair(replace(sync, kind="#commit"), relay) == RepairOutcome.BAD_ROW

    status = Repair(2, "#account", did, host="h", active=False, status="takendown", base_status="active")
    assert decide_repair(status, relay) == RepairOutcome.APPLIED
    assert decide_repair(status, replace(relay, upstream_status="takendown")) == RepairOutcome.STALE
    # the relay saw the host deactivate the account after the job looked: its own news is newer
    assert decide_repair(status, replace(relay, upstream_status="deactivated")) == RepairOutcome.STALE
    reactivated = Repair(3, "#account", did, host="h", active=True, base_status="deactivated")
    assert decide_repair(reactivated, replace(relay, upstream_status="deactivated")) == RepairOutcome.APPLIED

    desync = Repair(4, "desync", did, host="h", base_rev="3k2", base_commit_cid="c2")
    assert decide_repair(desync, relay) == RepairOutcome.APPLIED
    assert decide_repair(desync, replace(relay, rev="3k3", commit_cid="c3")) == RepairOutcome.STALE  # caught up
    assert decide_repair(desync, replace(relay, sync_state="resyncing")) == RepairOutcome.STALE

    add = Repair(5, "add", did, host="h", active=True)
    assert decide_repair(add, None) == RepairOutcome.APPLIED
    assert decide_repair(add, relay) == RepairOutcome.STALE


def test_outbox_rows_read_back_as_repairs() -> None:
    from backfill.outbox import Repair

    row = {"id": 7, "kind": "#account", "did": "did:plc:x", "host": "h", "rev": None, "commit_cid": None,
           "data_cid": None, "blocks": None, "active": 0, "status": None, "base_rev": None,
           "base_commit_cid": None, "base_status": "active", "observed_at": None, "created_at": 12.5}
    repair = Repair.from_row(row)
    assert (repair.active, repair.upstream_status, repair.observed_at) == (False, "deactivated", 12.5)
    assert Repair.from_row({**row, "active": 1, "blocks": memoryview(b"x")}).upstream_status == "active"


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


async def test_reconcile_skips_relay_upstreams(tmp_path: Path) -> None:
    """Reconcile lists PDSes, not relays (migration 0085 ``is_relay``): a relay is authoritative
    for no account, and listing a whole network through it would be the costliest host of all."""
    from backfill.backends import open_store
    from backfill.types import HostState
    from spark.db import connect_db
    from spark.reconcile import relay_hosts

    store = await open_store(str(tmp_path / "r.sqlite"))
    await store.migrate()
    for host in (HostState("pds.example"), HostState("relay.example", relay=True),
                 HostState("gone.example", status="banned")):
        await store.upsert_host(host)
    await store.close()
    with connect_db(str(tmp_path / "r.sqlite")) as db:
        assert relay_hosts(db) == ["pds.example"]


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


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "rename-aside"])
def test_replace_dir_puts_the_new_tree_in_place_of_the_old(tmp_path: Path, exchange: bool) -> None:
    from spark.export import replace_dir

    final, staging = tmp_path / "records", tmp_path / ".records-run.partial"
    staging.mkdir()
    (staging / "part-new").write_text("new")
    replace_dir(staging, final, exchange=exchange)  # nothing there yet: a plain rename
    assert sorted(p.name for p in tmp_path.iterdir()) == ["records"]
    staging.mkdir()
    (staging / "collection=b").mkdir()
    (staging / "collection=b" / "part-2").write_text("second")
    inode = final.stat().st_ino
    replace_dir(staging, final, exchange=exchange)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["records"]  # staging and the old tree gone
    assert sorted(p.name for p in final.iterdir()) == ["collection=b"]  # nothing of the old tree
    assert (final / "collection=b" / "part-2").read_text() == "second"
    assert final.stat().st_ino != inode


def test_exchange_swaps_two_directories(tmp_path: Path) -> None:
    """renameat2(RENAME_EXCHANGE) works here (else replace_dir falls back to renaming aside)."""
    from spark.export import _exchange

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "y").write_text("b")
    assert _exchange(a, b)
    assert (a / "y").read_text() == "b" and (b / "x").read_text() == "a"


def test_collection_runs_count_like_counts_from_paths() -> None:
    """Neighbouring collection names that sort around ``/`` (``post-x``, ``post.x``, ``post0``,
    ``post2``) and a path without a slash are counted exactly like the per-path count."""
    import random

    from backfill.collections import counts_from_paths
    from spark.collections import RepoCollections, collection_runs

    names = ["app.bsky.feed.post", "app.bsky.feed.post-x", "app.bsky.feed.post.x", "app.bsky.feed.post0",
             "app.bsky.feed.post2", "app.bsky.feed", "a", "é.x"]
    rng = random.Random(5)
    for _ in range(50):
        paths = sorted({f"{rng.choice(names)}/{rng.randrange(30)}" for _ in range(rng.randrange(60))}
                       | ({"app.bsky.feed.post"} if rng.random() < 0.3 else set()))
        runs = collection_runs(paths)
        summed: dict[str, int] = {}
        for c, start, end in runs:
            assert end > start and all(p.partition("/")[0] == c for p in paths[start:end])
            summed[c] = summed.get(c, 0) + end - start
        assert summed == counts_from_paths(paths)
        assert [p for _, start, end in runs for p in paths[start:end]] == paths  # contiguous, in order
        assert RepoCollections.of("did:x", "r", dict.fromkeys(reversed(paths))).counts == counts_from_paths(paths)


def test_summary_says_queued_for_the_relay_and_what_the_relay_did(capsys: pytest.CaptureFixture[str]) -> None:
    """A resync never repairs anything itself: its text summary and its progress line call what it
    found "queued for the relay", and the summary ends with what the relay did with those rows."""
    from spark.cli import LABELS, _print_summary

    _print_summary({"job": "resync", "run_id": "r1", "totals": {"ok": 27, "queued": 3},
                    "this_pass": {"ok": 27, "queued:state_diverged": 3},
                    "relay": {"applied": 1, "stale": 2}})
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "resync run r1",
        "  ok:                    27",
        "  queued for the relay:  3",
        "    this pass ok: 27",
        "    this pass queued for the relay (state_diverged): 3",
        "  relay, of 3 rows queued: applied=1 stale (discarded)=2",
    ]
    assert "repaired" not in out and LABELS["queued"] == "queued for the relay"
    _print_summary({"job": "reconcile", "run_id": "r2", "hosts": {}, "relay": {}})
    assert capsys.readouterr().out.splitlines()[-1] == "  relay, of 0 rows queued: nothing queued"
