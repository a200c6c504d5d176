"""``relay spark resync|reconcile|export|package [options]`` — run a batch job.

``main(argv) -> int`` (exit code 0 on success, 1 when the job ran but some repositories or hosts
failed, 2 on usage errors). Jobs run in ``local[*]`` unless ``--master`` says otherwise; under
``spark-submit`` use ``spark/submit.py`` (same options; the master comes from spark-submit).
Progress: Spark's UI address is printed, and a progress line (repositories done, outcomes) is
redrawn on stderr from the results table while the job runs.

A job never changes the relay's state: what it finds is *queued for the relay* (the outbox), and
the running relay applies each row or discards it as stale (it had caught up meanwhile). The
summary ends with those counts for the run's rows (``relay``: ``applied``, ``stale``, …,
``pending`` while the relay has not got to them; ``--wait-for-relay`` waits for them), and
``relay spark repairs --run-id ID`` tells them later.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any

from spark.config import FetchConfig, JobConfig
from spark.relaydb import AccountFilter

PACKAGES = ("mst", "firehose", "backfill", "relay", "spark")
ROOT = Path(__file__).resolve().parent.parent


def _default_db() -> str:
    env = os.environ.get("RELAY_DATABASE_URL")
    if env:
        return env
    from backfill.store import DEFAULT_SQLITE_PATH

    return DEFAULT_SQLITE_PATH


def build_parser(default_master: str | None = "local[*]") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relay spark", description="Spark batch jobs over every repository.")
    sub = parser.add_subparsers(dest="job", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--db", default=None, help="relay database URL (default: $RELAY_DATABASE_URL or the embedded SQLite file)")
        p.add_argument("--master", default=default_master, help="Spark master (default: %(default)s)")
        p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                       help="extra Spark setting (repeatable), e.g. spark.driver.extraJavaOptions= for C2")
        p.add_argument("--partitions", type=int, default=0, help="tasks (default: Spark's default parallelism)")
        p.add_argument("--run-id", default=None, help="run id (a rerun with the same id resumes it)")
        p.add_argument("--host", action="append", default=[], help="only this host (repeatable)")
        p.add_argument("--host-concurrency", type=int, default=4, help="concurrent requests per host")
        p.add_argument("--host-rate", type=float, default=20.0, help="requests per second per host")
        p.add_argument("--shards-per-host", type=int, default=1, help="tasks sharing one host's budget")
        p.add_argument("--timeout", type=float, default=30.0, help="per-request timeout, seconds")
        p.add_argument("--retries", type=int, default=3, help="retries for timeouts, 429 and 5xx")
        p.add_argument("--max-repo-bytes", type=int, default=256 * 1024 * 1024)
        p.add_argument("--plc-url", default=os.environ.get("RELAY_PLC_URL") or "https://plc.directory",
                       help="PLC directory [default: $RELAY_PLC_URL, else https://plc.directory]")
        p.add_argument("--scheme", default="https", choices=("https", "http"),
                       help="scheme for bare host names (http only for local testing)")
        p.add_argument("--allow-private", action="store_true",
                       help="allow loopback/private addresses (local testing only)")
        p.add_argument("--write-batch", type=int, default=200, help="rows per write-back transaction")
        p.add_argument("--no-progress", action="store_true", help="no progress line")
        p.add_argument("--json", action="store_true", help="print the summary as JSON")
        p.add_argument("--wait-for-relay", type=float, default=0.0, metavar="SECONDS",
                       help="after the job, wait up to this long for the relay to apply or discard what it queued")

    p = sub.add_parser("resync", help="re-verify repositories from their hosts; queue what differs for the relay")
    common(p)
    p.add_argument("--sync-state", action="append", default=[],
                   help="only accounts in this sync state (repeatable; e.g. desynchronized)")
    p.add_argument("--include-inactive", action="store_true", help="also accounts that are not active")
    p.add_argument("--resume", action="store_true", help="continue the latest unfinished resync run")
    p.add_argument("--retry-failed", action="store_true", help="when resuming, retry failed repositories")

    p = sub.add_parser("reconcile", help="compare every host's listRepos with the relay (anti-entropy)")
    common(p)

    p = sub.add_parser("export", help="records of verified repositories -> Parquet + manifest")
    common(p)
    p.add_argument("--out", required=True, help="output directory (local path)")
    p.add_argument("--collection", action="append", default=[], help="only this collection (repeatable)")
    p.add_argument("--record-format", choices=("json", "dag-cbor"), default="json",
                   help="record column: atproto JSON text, or the DAG-CBOR block's bytes (default: %(default)s)")
    p.add_argument("--row-group-mb", type=int, default=64,
                   help="Parquet row groups of about this many MiB of uncompressed data (default: %(default)s)")
    p.add_argument("--sync-state", action="append", default=[])
    p.add_argument("--include-inactive", action="store_true")

    p = sub.add_parser("repairs", help="what the relay did with the rows a run queued (applied, stale, pending)")
    p.add_argument("--db", default=None, help="relay database URL (default: $RELAY_DATABASE_URL or the embedded SQLite file)")
    p.add_argument("--run-id", required=True, help="the job run whose rows to count")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long while rows are still pending")
    p.add_argument("--json", action="store_true", help="print the counts as JSON")

    p = sub.add_parser("package", help="zip the project's packages for spark-submit --py-files")
    p.add_argument("--out", default="dist/relay-spark.zip")
    return parser


def package(out: str) -> Path:
    """Write a zip of the project's Python packages (for ``--py-files``); returns its path."""
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in PACKAGES:
            for path in sorted((ROOT / name).rglob("*.py")):
                if "__pycache__" not in path.parts:
                    zf.write(path, path.relative_to(ROOT).as_posix())
    return target


#: how outcomes are shown to people (the stored code on the left)
LABELS = {"queued": "queued for the relay"}


def relay_outcomes(db_url: str, run_id: str, wait: float = 0.0, poll: float = 1.0) -> dict[str, int]:
    """What the relay did with the rows ``run_id`` queued (``spark.relaydb.repair_outcomes``),
    waiting up to ``wait`` seconds while some are still ``pending``."""
    from spark.db import connect_db
    from spark.relaydb import repair_outcomes

    deadline = time.monotonic() + wait
    while True:
        with connect_db(db_url) as db:
            counts = repair_outcomes(db, run_id)
        if not counts.get("pending") or time.monotonic() >= deadline:
            return counts
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))


def relay_line(counts: dict[str, int]) -> str:
    """``relay, of N rows queued: applied=… stale (discarded)=… pending=…``."""
    total = sum(counts.values())
    shown = {"stale": "stale (discarded)"}
    parts = " ".join(f"{shown.get(k, k)}={v}" for k, v in sorted(counts.items()))
    return f"relay, of {total} rows queued: {parts or 'nothing queued'}"


class Progress:
    """Redraws ``<job>: N/total repositories  ok=… queued for the relay=… failed=…`` on stderr."""

    def __init__(self, db_url: str, run_id: str, job: str, total: int | None, every: float = 2.0) -> None:
        self.db_url, self.run_id, self.job, self.total, self.every = db_url, run_id, job, total, every
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="spark-progress")

    def _line(self) -> str:
        from spark.db import connect_db
        from spark.relaydb import result_counts

        with connect_db(self.db_url) as db:
            counts = result_counts(db, self.run_id)
        done = sum(counts.values())
        parts = " ".join(f"{LABELS.get(k, k)}={v}" for k, v in sorted(counts.items()))
        if self.total:
            width = 30
            filled = min(width, int(width * done / max(1, self.total)))
            return f"{self.job}: [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}  {parts}"
        return f"{self.job}: {done} repositories  {parts}"

    def _loop(self) -> None:
        while not self.stop_event.wait(self.every):
            try:
                sys.stderr.write("\r" + self._line()[:150].ljust(150))
                sys.stderr.flush()
            except Exception:  # noqa: BLE001 - progress must never break the job
                pass

    def __enter__(self) -> Progress:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.thread.join(timeout=5)
        try:
            sys.stderr.write("\r" + self._line()[:150].ljust(150) + "\n")
        except Exception:  # noqa: BLE001
            pass


def _job_config(args: argparse.Namespace, run_id: str) -> JobConfig:
    fetch = FetchConfig(
        host_concurrency=args.host_concurrency,
        host_rate=args.host_rate,
        timeout_s=args.timeout,
        retries=args.retries,
        max_repo_bytes=args.max_repo_bytes,
        allow_private=args.allow_private,
        scheme=args.scheme,
        plc_url=args.plc_url.rstrip("/"),
        shards_per_host=max(1, args.shards_per_host),
    )
    return JobConfig(db_url=args.db, run_id=run_id, fetch=fetch, write_batch=args.write_batch,
                     partitions=args.partitions)


def _selected(db_url: str, flt: AccountFilter) -> int:
    from spark.db import connect_db

    where, args = flt.where()
    with connect_db(db_url) as db:
        return int(db.fetchval(f"SELECT count(*) FROM accounts a WHERE {where}", *args) or 0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the parsed job and return its summary."""
    from pyspark.sql import SparkSession

    from spark.db import connect_db
    from spark.relaydb import latest_unfinished_run
    from spark.session import build_session

    args.db = args.db or _default_db()
    run_id = args.run_id
    if run_id is None and getattr(args, "resume", False):
        with connect_db(args.db) as db:
            run_id = latest_unfinished_run(db, args.job)
    run_id = run_id or f"{args.job}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:6]}"
    cfg = _job_config(args, run_id)
    existing = SparkSession.getActiveSession()
    extra = dict(item.split("=", 1) for item in args.conf if "=" in item)
    spark = build_session(args.master, app_name=f"relay-spark-{args.job}", conf=extra, progress_bar=False)
    url = spark.sparkContext.uiWebUrl
    print(f"relay spark {args.job}: run {run_id}" + (f", Spark UI {url}" if url else ""), file=sys.stderr)
    try:
        flt = AccountFilter(
            hosts=tuple(args.host),
            sync_states=tuple(getattr(args, "sync_state", [])),
            include_inactive=getattr(args, "include_inactive", False),
            retry_failed=getattr(args, "retry_failed", False),
        )
        total = None
        if args.job in ("resync", "export") and not args.no_progress:
            total = _selected(args.db, flt)
        progress = Progress(args.db, run_id, args.job, total) if not args.no_progress else None
        if progress:
            progress.__enter__()
        try:
            if args.job == "resync":
                from spark.resync import run_resync

                return run_resync(spark, cfg, flt)
            if args.job == "reconcile":
                from spark.reconcile import run_reconcile

                return run_reconcile(spark, cfg, args.host or None)
            from spark.export import run_export
            from spark.records_out import ParquetLayout

            layout = ParquetLayout(record_format=args.record_format, row_group_bytes=args.row_group_mb << 20)
            return run_export(spark, cfg, flt, args.out, args.collection or None, layout)
        finally:
            if progress:
                progress.__exit__(None, None, None)
    finally:
        if existing is None:
            spark.stop()


def _failed(summary: dict[str, Any]) -> bool:
    if summary.get("job") == "resync":
        return bool(summary.get("totals", {}).get("failed"))
    if summary.get("job") == "reconcile":
        return any(k.startswith("host_failed") for h in summary.get("hosts", {}).values() for k in h)
    return bool(summary.get("failed"))


def main(argv: list[str] | None = None, default_master: str | None = "local[*]") -> int:
    parser = build_parser(default_master)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.job == "package":
        print(package(args.out))
        return 0
    if args.job == "repairs":
        counts = relay_outcomes(args.db or _default_db(), args.run_id, args.wait)
        print(json.dumps(counts, indent=2, sort_keys=True) if args.json else relay_line(counts))
        return 0
    bad = [item for item in args.conf if "=" not in item]
    if bad:
        parser.error(f"--conf needs KEY=VALUE, got {bad[0]!r}")
    try:
        import pyspark  # noqa: F401
    except ImportError:
        print("relay spark: PySpark is not installed; install the extra: pip install -e '.[spark]'",
              file=sys.stderr)
        return 2
    summary = run(args)
    if args.job in ("resync", "reconcile"):  # the jobs that queue rows for the relay
        summary["relay"] = relay_outcomes(args.db, str(summary["run_id"]), args.wait_for_relay)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        _print_summary(summary)
    return 1 if _failed(summary) else 0


def _print_summary(summary: dict[str, Any]) -> None:
    job = summary.get("job")
    print(f"{job} run {summary.get('run_id')}")
    if job == "resync":
        for outcome, n in sorted(summary.get("totals", {}).items()):
            print(f"  {LABELS.get(outcome, outcome) + ':':<22} {n}")
        for key, n in sorted(summary.get("this_pass", {}).items()):
            outcome, _, reason = key.partition(":")
            print(f"    this pass {LABELS.get(outcome, outcome)}" + (f" ({reason})" if reason else "") + f": {n}")
    elif job == "reconcile":
        for host, counts in sorted(summary.get("hosts", {}).items()):
            print(f"  {host}: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    else:
        print(f"  cursor (relay seq at start): {summary.get('cursor')}")
        print(f"  records: {summary.get('records')} in {summary.get('repositories_exported')} repositories")
        for coll, n in sorted(summary.get("records_per_collection", {}).items()):
            print(f"    {coll}: {n}")
        if summary.get("failed"):
            print(f"  failed repositories: {len(summary['failed'])}")
    if "relay" in summary:
        print(f"  {relay_line(summary['relay'])}")


if __name__ == "__main__":
    sys.exit(main())
