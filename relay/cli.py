"""`relay` command line: dispatches each subcommand to the package that owns it.

Each subcommand module exposes ``main(argv: list[str]) -> int`` with its own ``--help``.
Imports are lazy so that ``relay inspect`` does not pay for Starlette and ``relay serve``
does not pay for PySpark.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("relay.serve", "run the relay (embedded SQLite by default)"),
    "ingest": ("relay.serve", "run only the ingest side (scale-out: one active instance)"),
    "fanout": ("relay.serve", "run only the fan-out side (scale-out: stateless replicas)"),
    "migrate": ("backfill.cli", "apply database migrations"),
    "admin": ("relay.admin_cli", "call the running relay's admin API"),
    "inspect": ("mst.inspect", "inspect a repository CAR file or a raw firehose frame"),
    "simulate": ("sim.cli", "run a fleet of simulated PDS hosts on 127.0.0.1"),
    "spark": ("spark.cli", "run a Spark batch job: resync | reconcile | export"),
    "bootstrap": ("relay.bootstrap_cli", "fold an export and the live stream into a SQLite index, exactly once"),
    "native": ("mst.native", "status: which build of the verification modules runs (compiled at install, or Python)"),
}


def _usage() -> str:
    lines = ["usage: relay <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run 'relay <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"relay: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    if name in ("ingest", "fanout"):
        rest = ["--role", name, *rest]
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
