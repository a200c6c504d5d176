"""Validation in worker processes (``firehose.pipeline.ValidationPool``): both cores, batching, and
workers that die or hang. Per-account order, in-flight chaining and the identity refresh on a bad
signature belong to the account lanes: ``tests/relay/test_lanes.py``."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from firehose.pipeline import ValidationPool
from firehose.reasons import Reason

from .commits import commit_body, frame, new_repo, posts, state_of

pytestmark = pytest.mark.timeout(120)


def interleaved_commits(n_accounts: int, per_account: int):
    repos = [new_repo(f"did:plc:pipeline{i:018d}") for i in range(n_accounts)]
    genesis = {r.did: state_of(r, r.genesis) for r in repos}
    items = []
    for k in range(per_account):
        for repo in repos:
            res = repo.apply_writes(posts(2, start=k * 2))
            items.append((repo, res, frame(commit_body(repo, res, seq=len(items) + 1))))
    return repos, genesis, items


def chained(items, genesis):
    """(frame, state it chains on, key) per item: what an account lane would pass."""
    before = dict(genesis)
    jobs = []
    for repo, res, raw in items:
        jobs.append((raw, before[repo.did], repo.key.did_key()))
        before[repo.did] = state_of(repo, res)
    return jobs


@pytest.mark.parametrize("workers", [0, 2])
async def test_concurrent_judgements_each_against_the_state_given(workers: int) -> None:
    """Many accounts' frames judged at once (batched across the workers); each verdict is exactly
    the judgement of its frame against the state passed with it (the pool keeps no state)."""
    repos, genesis, items = interleaved_commits(4, 8)
    before = dict(genesis)
    futs = []
    async with ValidationPool(workers) as p:
        for repo, res, raw in items:
            futs.append(p.judge(raw, before[repo.did], repo.key.did_key()))
            before[repo.did] = state_of(repo, res)
        verdicts = [await f for f in futs]
        # judged against a stale state, the same frame is a broken chain: nothing is cached
        stale = await p.judge(items[-1][2], genesis[items[-1][0].did], items[-1][0].key.did_key())
    assert [(v.kind, v.reason) for v in verdicts] == [("accept", "ok")] * len(items)
    for (_, res, _), v in zip(items, verdicts, strict=True):
        assert v.new_state.rev == res.rev and v.new_state.data_cid == res.data.encode()
        # the collections its ops touch come back with it (the parent does not decode them again)
        assert v.op_changes == (("app.bsky.feed.post", "create"),) * 2
    assert (stale.kind, stale.reason) == ("desync", Reason.SINCE_MISMATCH)


async def test_out_of_order_submission_is_detected_not_hidden() -> None:
    repos, genesis, items = interleaved_commits(1, 3)
    repo = repos[0]
    async with ValidationPool(0) as p:
        v2 = await p.judge(items[1][2], genesis[repo.did], repo.key.did_key())
        assert (v2.kind, v2.reason) == ("desync", Reason.SINCE_MISMATCH)


async def test_garbage_never_breaks_the_pipeline() -> None:
    async with ValidationPool(2) as p:
        futs = [p.judge(bytes([i]) * 50, None, None) for i in range(20)]
        verdicts = await asyncio.gather(*futs)
    assert all(v.kind == "reject" for v in verdicts)


async def test_poison_event_is_rejected_alone_and_its_batch_mates_pass() -> None:
    """An event that kills every worker it reaches is rejected (validator_crashed) after three
    tries; the events batched with it are validated on the replacement workers."""
    import firehose.pipeline as pipeline_module

    repos, genesis, items = interleaved_commits(3, 2)
    poison = b"\xff" * 10  # tests/firehose/faulty_worker.py dies on it
    async with ValidationPool(1) as p:
        pool = p._pool
        assert pool is not None
        pool.module = "tests.firehose.faulty_worker"  # replacements die on the poison frame
        for pid in p.worker_pids:  # the current worker too, on its next batch
            os.kill(pid, signal.SIGKILL)
        futs = [p.judge(poison, None, None)]
        futs += [p.judge(*job) for job in chained(items, genesis)]
        verdicts = await asyncio.gather(*futs)
    assert (verdicts[0].kind, verdicts[0].reason) == ("reject", Reason.VALIDATOR_CRASHED)
    assert [v.kind for v in verdicts[1:]] == ["accept"] * len(items)
    assert p.pool_restarts >= 4  # the outside kill, then three deaths on the poison frame
    assert pipeline_module.WorkerPool is type(pool)


async def test_hanging_event_is_rejected_alone_after_the_batch_timeout() -> None:
    """A frame on which validation never returns: its worker is killed after ``batch_timeout``,
    the other events pass, and the hanging one is rejected instead of stalling the stream."""
    repos, genesis, items = interleaved_commits(2, 2)
    async with ValidationPool(1, batch_timeout=0.5) as p:
        pool = p._pool
        assert pool is not None
        pool.module = "tests.firehose.faulty_worker"  # replacements hang on the slow frame
        for pid in p.worker_pids:
            os.kill(pid, signal.SIGKILL)
        futs = [p.judge(*job) for job in chained(items, genesis)]
        futs.append(p.judge(b"\xfe" * 10, None, None))  # tests/firehose/faulty_worker.py hangs
        verdicts = await asyncio.gather(*futs)
        assert pool.timeouts >= 3  # the batch (or the event alone), then every retry of the event
    assert [v.kind for v in verdicts[:-1]] == ["accept"] * len(items)
    assert (verdicts[-1].kind, verdicts[-1].reason) == ("reject", Reason.VALIDATOR_CRASHED)


async def test_killed_worker_is_replaced_and_no_event_is_lost() -> None:
    repos, genesis, items = interleaved_commits(4, 6)
    async with ValidationPool(2) as p:
        jobs = chained(items, genesis)
        futs = [p.judge(*job) for job in jobs[:12]]
        for pid in p.worker_pids:  # an outside kill (OOM killer, operator)
            os.kill(pid, signal.SIGKILL)
        first = await asyncio.gather(*futs)
        rest = [p.judge(*job) for job in jobs[12:]]
        second = await asyncio.gather(*rest)
    # an outside kill condemns no event: each of the dead workers' events is retried alone
    assert [v.kind for v in first] == ["accept"] * 12, [(v.kind, v.reason) for v in first]
    assert [v.kind for v in second] == ["accept"] * len(second)
    assert p.pool_restarts >= 2
