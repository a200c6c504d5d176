"""Fault injection: the relay keeps its promise — every verified event, exactly once, in order —
across failures of PostgreSQL, Redis, itself and its upstream hosts (see ``scenarios``).

Each test runs one scenario against private servers (never the machine's shared PostgreSQL or
Redis) and fails with the scenario's full report when any promise is broken: commits lost,
duplicates, accounts turned into ``#sync``, rev order, accounts out of sync with their host, a
dead relay, ingest not resumed within 5 s of the dependency's return, ``/_ready`` not 503 while
the dependency is down or not 200 after.
"""

from __future__ import annotations

from tests.faults.scenarios import run_named


async def _check(name: str) -> None:
    result = await run_named(name)
    print(result.render())
    assert not result.violations(), result.render()


async def test_postgres_kill9_restarted_after_10s() -> None:
    await _check("pg_kill")


async def test_postgres_fast_restart() -> None:
    await _check("pg_fast_restart")


async def test_postgres_down_30s() -> None:
    await _check("pg_down")


async def test_redis_kill9_restart_in_scale_out() -> None:
    await _check("redis_kill")


async def test_relay_sigkill_and_restart() -> None:
    await _check("relay_kill")


async def test_upstream_disconnect_storm() -> None:
    await _check("upstream_storm")


async def test_ingest_killed_between_commit_and_publish() -> None:
    await _check("ingest_kill_unpublished")


async def test_spark_resync_and_reconcile_while_the_relay_is_behind() -> None:
    await _check("spark_behind")
