"""The CLI surface: help for every relay-owned command, admin CLI against a live relay, Helm values."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from relay import admin_cli, cli, serve
from relay.config import SETTINGS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", ["serve", "ingest", "fanout", "admin"])
def test_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert f"relay {command}" in out
    if command != "admin":
        for s in SETTINGS:
            assert s.flag in out and s.env in out


def test_bad_setting_exits_with_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve.main(["--bind", "nowhere"]) == 2
    assert "RELAY_BIND" in capsys.readouterr().err


def test_admin_cli_talks_to_a_running_relay(relay_factory, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    async def run() -> tuple[int, int, int, int]:
        async with relay_factory(admin_token="tok") as relay:
            loop = asyncio.get_running_loop()

            def call(*args: str) -> int:
                return admin_cli.main(["--url", relay.url, "--token", "tok", *args])

            ok = await loop.run_in_executor(None, call, "crawling", "off")
            wrong = await loop.run_in_executor(
                None, lambda: admin_cli.main(["--url", relay.url, "--token", "nope", "hosts"]))
            ban = await loop.run_in_executor(None, call, "ban", "spam.example")
            assert relay.service.hosts is not None and relay.service.hosts.crawling_enabled is False
            assert await relay.service.store.list_domain_bans() == ["spam.example"]
            capsys.readouterr()
            audit = await loop.run_in_executor(None, call, "audit")
            return ok, wrong, ban, audit

    ok, wrong, ban, audit = asyncio.new_event_loop().run_until_complete(run())
    assert (ok, wrong, ban, audit) == (0, 1, 0, 0)
    actions = json.loads(capsys.readouterr().out)["actions"]
    assert [(a["action"], a["target"]) for a in actions] == [("set_crawling", "relay"), ("ban_domain", "spam.example")]
    for action in actions:  # ISO 8601 UTC, not epoch floats
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{3})?Z", action["time"]), action


@pytest.mark.parametrize("argv", [["--token", "t", "--url", "http://r", "limits", "h", "--per-second", "3"],
                                  ["limits", "h", "--token", "t", "--per-second", "3", "--url", "http://r"],
                                  ["--url", "http://r", "limits", "--token", "t", "h", "--per-second", "3"]])
def test_admin_cli_options_anywhere(argv: list[str]) -> None:
    ns = admin_cli.build_parser().parse_args(argv)
    assert (ns.token, ns.url, ns.command, ns.hostname, ns.per_second) == ("t", "http://r", "limits", "h", 3)


def test_admin_cli_prints_iso_timestamps() -> None:
    answer = {"hosts": [{"hostname": "h", "seq": 1700000000, "lastSeen": 1700000000.25, "createdAt": 1700000000}],
              "consumers": [{"connectedAt": 1700000000.5, "framesSent": 3}], "time": None}
    assert admin_cli.readable(answer) == {
        "hosts": [{"hostname": "h", "seq": 1700000000, "lastSeen": "2023-11-14T22:13:20.250Z",
                   "createdAt": "2023-11-14T22:13:20Z"}],
        "consumers": [{"connectedAt": "2023-11-14T22:13:20.500Z", "framesSent": 3}], "time": None}
    assert "account an account" not in admin_cli.build_parser().format_help()


def test_admin_cli_requests() -> None:
    parser = admin_cli.build_parser()
    assert admin_cli.request_for(parser.parse_args(["limits", "h.example", "--account-limit", "5"])) == \
        ("POST", "/admin/hosts/h.example/limits", {"account_limit": 5, "trusted": None})
    assert admin_cli.request_for(parser.parse_args(["takedown", "did:plc:abc"])) == \
        ("POST", "/admin/accounts/did:plc:abc/takedown", None)
    assert admin_cli.request_for(parser.parse_args(["unban", "x.example"])) == \
        ("DELETE", "/admin/domain-bans/x.example", None)
    assert admin_cli.request_for(parser.parse_args(["add-host", "r.example", "--relay"])) == \
        ("POST", "/admin/hosts", {"hostname": "r.example", "account_limit": None, "trusted": False, "relay": True})
    for mode, lenient in (("lenient", True), ("strict", False), ("default", None)):
        assert admin_cli.request_for(parser.parse_args(["validation", "h.example", mode])) == \
            ("POST", "/admin/hosts/h.example/validation", {"lenient": lenient})


def test_helm_values_use_real_settings_and_commands() -> None:
    chart = ROOT / "helm" / "relay"
    values = (chart / "values.yaml").read_text()
    known = {s.env for s in SETTINGS}
    used = set(re.findall(r"\b(RELAY_[A-Z_]+):", values))
    assert used and used <= known, used - known
    templates = "\n".join(p.read_text() for p in (chart / "templates").iterdir())
    for command in re.findall(r'args: \["(\w+)"', templates):
        assert command in cli.SUBCOMMANDS, command
    assert "path: /_health" in templates and "path: /metrics" in templates
