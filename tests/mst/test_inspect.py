"""``relay inspect car|frame`` on real files (through the project's CLI dispatcher)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from mst import cbor
from mst.crypto import PrivateKey
from mst.inspect import main
from mst.repo import Repo, Write
from relay.cli import main as relay_main
from tests.mst.conftest import load_json


@pytest.fixture()
def repo() -> Repo:
    r = Repo.create("did:plc:inspectinspectinspectins", PrivateKey.generate_k256())
    r.apply_writes([Write("create", "app.bsky.feed.post", f"r{i}", {"i": i}) for i in range(25)])
    return r


def test_inspect_car_full_export(tmp_path: Path, repo: Repo, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "repo.car"
    f.write_bytes(repo.export_car())
    assert relay_main(["inspect", "car", str(f), "--did-key", repo.key.did_key(), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["commit"]["did"] == repo.did
    assert out["commit"]["rev"] == repo.rev
    assert out["commit"]["data"] == repo.data_root.encode()
    assert out["records"] == 25 and out["tree"] == "complete"
    assert out["signature_valid"] is True
    # wrong key: exit status 1 and the text output says so
    assert main(["car", str(f), "--did-key", PrivateKey.generate_p256().did_key()]) == 1
    assert "signature_valid: False" in capsys.readouterr().out


def test_inspect_car_slice_and_garbage(
    tmp_path: Path, repo: Repo, capsys: pytest.CaptureFixture[str]
) -> None:
    res = repo.apply_writes([Write("delete", "app.bsky.feed.post", "r3")])
    f = tmp_path / "slice.car"
    f.write_bytes(res.car)
    assert main(["car", str(f), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tree"] == "partial" and out["tree_error"] == "missing_block"
    bad = tmp_path / "bad.car"
    bad.write_bytes(b"\x05garbage")
    assert main(["car", str(bad)]) == 1
    assert "invalid input" in capsys.readouterr().err
    assert main(["car", str(tmp_path / "absent.car")]) == 2


def test_inspect_frame(tmp_path: Path, fixtures_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = load_json(fixtures_dir / "indigo-relay-scenarios" / "post_lifecycle.json")
    msg = scenario["messages"][0]["frame"]
    body = dict(msg["body"])
    raw = body.pop("blocks")["$bytes"]
    from mst.datamodel import json_to_data

    data = json_to_data(body)
    data["blocks"] = base64.b64decode(raw + "=" * (-len(raw) % 4))
    frame = cbor.encode(msg["header"]) + cbor.encode(data)
    f = tmp_path / "frame.bin"
    f.write_bytes(frame)
    assert main(["frame", str(f), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["header"] == {"op": 1, "t": "#commit"}
    assert out["body"]["repo"] == body["repo"]
    assert out["body"]["ops"][0]["path"] == body["ops"][0]["path"]
    assert out["body"]["blocks"]["roots"] == [body["commit"]["$link"]]
    assert main(["frame", str(f)]) == 0
    assert "header.t: #commit" in capsys.readouterr().out
    f.write_bytes(frame + b"\x00")
    assert main(["frame", str(f)]) == 1
