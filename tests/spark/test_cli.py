"""``relay spark …`` through the project's dispatcher, on the test session."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import pytest

from relay.cli import main as relay_main
from spark.db import connect_db
from tests.spark.helpers import FleetThread, seed_relay


def test_cli_resync_reports_and_exits_by_outcome(spark_session: Any, fleet: FleetThread, relay_db: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    seed_relay(relay_db, fleet)
    common = ["--db", relay_db, "--allow-private", "--scheme", "http", "--plc-url", fleet.fleet.plc_url,
              "--master", "local[2]", "--partitions", "2", "--retries", "0"]
    code = relay_main(["spark", "resync", *common, "--run-id", "cli-run", "--json"])
    out, err = capsys.readouterr()
    assert code == 0
    summary = json.loads(out)
    assert summary["run_id"] == "cli-run" and summary["totals"] == {"ok": 20}
    assert "resync: [##############################] 20/20" in err  # the progress line's last redraw
    assert spark_session.sparkContext._jsc is not None  # the CLI left the caller's session running

    # a host that disappeared makes the job fail its repositories, and the exit code says so
    fleet.run(fleet.fleet.hosts[0].stop())
    code = relay_main(["spark", "resync", *common, "--no-progress", "--timeout", "2"])
    out, _ = capsys.readouterr()
    assert code == 1
    assert "failed" in out
    with connect_db(relay_db) as db:
        reasons = {r["reason"] for r in db.fetch(
            "SELECT reason FROM spark_job_results WHERE outcome = 'failed' AND run_id <> 'cli-run'")}
    assert reasons == {"connect_error"}


def test_cli_package_zips_the_project_packages(tmp_path: Path) -> None:
    target = tmp_path / "relay-spark.zip"
    assert relay_main(["spark", "package", "--out", str(target)]) == 0
    names = set(zipfile.ZipFile(target).namelist())
    assert {"spark/cli.py", "spark/resync.py", "mst/verify.py", "backfill/types.py", "relay/identity.py"} <= names


def test_cli_export_summary_and_plc_from_environment(spark_session: Any, fleet: FleetThread, relay_db: str,
                                                     tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """No --plc-url: the PLC directory comes from RELAY_PLC_URL, as for the relay itself (with
    the public default every identity lookup would fail). The text summary names its job."""
    seed_relay(relay_db, fleet)
    monkeypatch.setenv("RELAY_PLC_URL", fleet.fleet.plc_url)
    out_dir = tmp_path / "export"
    code = relay_main(["spark", "export", "--db", relay_db, "--allow-private", "--scheme", "http",
                       "--master", "local[2]", "--partitions", "2", "--retries", "0", "--no-progress",
                       "--run-id", "cli-export", "--record-format", "dag-cbor", "--out", str(out_dir)])
    out, _ = capsys.readouterr()
    assert code == 0, out
    assert out.splitlines()[0] == "export run cli-export"
    assert "records: " in out and "in 20 repositories" in out
    assert sorted(p.name for p in out_dir.iterdir()) == ["manifest.json", "records"]  # no staging left
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["record_format"] == "dag-cbor"  # --record-format reached the job
    frame = spark_session.read.parquet(str(out_dir / "records"))
    assert dict(frame.dtypes)["record"] == "binary"
