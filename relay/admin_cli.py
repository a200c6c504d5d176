"""``relay admin …``: call a running relay's admin API.

    relay admin [--url URL] [--token TOKEN] hosts
    relay admin add-host HOSTNAME [--account-limit N] [--trusted] [--relay]
    relay admin block HOSTNAME | unblock HOSTNAME
    relay admin limits HOSTNAME [--account-limit N] [--per-second N] [--per-hour N] [--per-day N]
                                [--trusted | --untrusted]
    relay admin reset-cursor HOSTNAME [--cursor N]
    relay admin validation HOSTNAME lenient|strict|default
    relay admin bans | ban DOMAIN | unban DOMAIN
    relay admin takedown DID | reverse-takedown DID | account DID
    relay admin consumers
    relay admin crawling [on|off]
    relay admin audit

``--url`` defaults to ``http://$RELAY_BIND`` (127.0.0.1:2470), ``--token`` to ``$RELAY_ADMIN_TOKEN``;
both may stand anywhere on the command line (before or after the subcommand).
Prints the JSON answer, with the timestamps (``time``, ``lastSeen``, ``createdAt``,
``connectedAt``; epoch seconds in the API) as ISO 8601 UTC; exit status 0 on success, 1 on an
error answer, 2 on usage errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import httpx

#: Fields of admin API answers that hold epoch seconds.
TIME_FIELDS = frozenset({"time", "lastSeen", "createdAt", "connectedAt"})


def _connection_options(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument("--url", default=default, help="relay base URL [default http://$RELAY_BIND]")
    parser.add_argument("--token", default=default, help="admin token [env RELAY_ADMIN_TOKEN]")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relay admin", description="Call a running relay's admin API.")
    _connection_options(p, None)
    # the same options after the subcommand; SUPPRESS: a subcommand without them keeps the top-level value
    common = argparse.ArgumentParser(add_help=False)
    _connection_options(common, argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=help_)

    command("hosts", "list hosts")
    a = command("add-host", "add (and subscribe to) a host")
    a.add_argument("hostname")
    a.add_argument("--account-limit", type=int, default=None)
    a.add_argument("--trusted", action="store_true")
    a.add_argument("--relay", action="store_true", help="the host is another relay (follow it as an upstream)")
    for name in ("block", "unblock"):
        command(name, f"{name} a host").add_argument("hostname")
    limits = command("limits", "change a host's account limit / trust")
    limits.add_argument("hostname")
    limits.add_argument("--account-limit", type=int, default=None)
    for window in ("second", "hour", "day"):
        limits.add_argument(f"--per-{window}", type=int, default=None, help=f"events per {window}")
    trust = limits.add_mutually_exclusive_group()
    trust.add_argument("--trusted", dest="trusted", action="store_const", const=True, default=None)
    trust.add_argument("--untrusted", dest="trusted", action="store_const", const=False)
    reset = command("reset-cursor", "resubscribe to a host from a given upstream seq")
    reset.add_argument("hostname")
    reset.add_argument("--cursor", type=int, default=0)
    val = command("validation", "judge a host's sync 1.0 commits leniently or strictly")
    val.add_argument("hostname")
    val.add_argument("mode", choices=["lenient", "strict", "default"],
                     help="default: as RELAY_LENIENT_SYNC_VALIDATION says")
    command("bans", "list domain bans")
    command("ban", "ban a domain (and every host under it)").add_argument("domain")
    command("unban", "lift a domain ban").add_argument("domain")
    for name, help_ in (("takedown", "take an account down (emits #account)"),
                        ("reverse-takedown", "reverse an account's takedown"),
                        ("account", "show an account's stored state")):
        command(name, help_).add_argument("did")
    command("consumers", "list connected consumers")
    crawl = command("crawling", "show or switch public requestCrawl")
    crawl.add_argument("state", nargs="?", choices=["on", "off"])
    command("audit", "recent admin actions (stored in the database)")
    return p


def request_for(ns: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    """(method, path, json body) for the parsed command."""
    c = ns.command
    host = quote(getattr(ns, "hostname", "") or "", safe="")
    if c == "hosts":
        return "GET", "/admin/hosts", None
    if c == "add-host":
        return "POST", "/admin/hosts", {"hostname": ns.hostname, "account_limit": ns.account_limit,
                                        "trusted": ns.trusted, "relay": ns.relay}
    if c in ("block", "unblock"):
        return "POST", f"/admin/hosts/{host}/{c}", None
    if c == "limits":
        body = {"account_limit": ns.account_limit, "trusted": ns.trusted}
        for window in ("second", "hour", "day"):
            if getattr(ns, f"per_{window}") is not None:
                body[f"rate_limit_per_{window}"] = getattr(ns, f"per_{window}")
        return "POST", f"/admin/hosts/{host}/limits", body
    if c == "reset-cursor":
        return "POST", f"/admin/hosts/{host}/reset-cursor", {"cursor": ns.cursor}
    if c == "validation":
        return "POST", f"/admin/hosts/{host}/validation", {"lenient": {"lenient": True, "strict": False}.get(ns.mode)}
    if c == "bans":
        return "GET", "/admin/domain-bans", None
    if c == "ban":
        return "POST", "/admin/domain-bans", {"domain": ns.domain}
    if c == "unban":
        return "DELETE", f"/admin/domain-bans/{quote(ns.domain, safe='')}", None
    if c in ("takedown", "reverse-takedown"):
        return "POST", f"/admin/accounts/{quote(ns.did, safe=':')}/{c}", None
    if c == "account":
        return "GET", f"/admin/accounts/{quote(ns.did, safe=':')}", None
    if c == "consumers":
        return "GET", "/admin/consumers", None
    if c == "crawling":
        if ns.state is None:
            return "GET", "/admin/crawling", None
        return "POST", "/admin/crawling", {"enabled": ns.state == "on"}
    if c == "audit":
        return "GET", "/admin/audit", None
    raise ValueError(c)


def readable(value: Any) -> Any:
    """``value`` with every ``TIME_FIELDS`` number as ISO 8601 UTC (``2026-01-02T03:04:05Z``)."""
    if isinstance(value, dict):
        return {k: _iso(v) if k in TIME_FIELDS and isinstance(v, int | float) and not isinstance(v, bool)
                else readable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [readable(v) for v in value]
    return value


def _iso(seconds: float) -> str:
    text = datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z").replace(".000Z", "Z")


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    url = (ns.url or "http://" + os.environ.get("RELAY_BIND", "127.0.0.1:2470")).rstrip("/")
    token = ns.token if ns.token is not None else os.environ.get("RELAY_ADMIN_TOKEN", "")
    method, path, body = request_for(ns)
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        print(f"relay admin: cannot reach {url}: {exc}", file=sys.stderr)
        return 1
    try:
        print(json.dumps(readable(resp.json()), indent=2))
    except ValueError:
        print(resp.text)
    return 0 if resp.status_code < 400 else 1


if __name__ == "__main__":
    sys.exit(main())
