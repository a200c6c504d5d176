"""Benchmarks of the repository core (``mst``): one core, pure Python + C extensions.

Run: ``.venv/bin/python bench/core.py [--records 10000] [--seconds 3]``

Rates are per CPU-second of this single-threaded process (best of 3 windows).

Prints ``RESULT <name>=<value>`` lines:

* ``core_decode_per_s``      — decode a #commit frame (header + body, DAG-CBOR) and parse its CAR
  slice with every block hash verified;
* ``core_inversions_per_s``  — invert a 1–3 op commit on its (already parsed) CAR slice;
* ``core_k256_verify_per_s`` / ``core_p256_verify_per_s`` — compact low-S signature checks;
* ``core_commit_verify_per_s`` — full verification of a 1–3 op #commit frame against a
  10,000-record repo: frame decode, CAR parse + hashes, commit decode, DID/rev checks, K-256
  signature, inversion, ``prevData`` comparison (the issue's target: >= 3,000/s). The 300
  frames are cycled, so the key-height cache is warm (as for an active repo);
* ``core_commit_verify_cold_per_s`` — the same with the key-height cache emptied before every
  frame (worst case: no key seen before);
* ``core_worker_commits_per_s`` — what a validation worker does per ``#commit`` of such a batch
  (``firehose.pipeline.validate_batch``: the relay's full judgement ``validate_frame``, with its
  record, rev and chain checks, slice pruning and the outgoing body's encoding; account state
  known, as for an active repo); no IPC;
* ``core_producer_commits_per_s`` — ``Repo.apply_writes`` of 1–3 writes (simulator speed).

With ``--stages`` it also prints (as ``#`` comment lines) the CPU microseconds per frame of each
stage of ``verify_frame`` measured separately: frame decode, CAR parse, commit decode,
signature, op list, inversion (the profile summary in BENCHMARKS.md comes from this).
"""

from __future__ import annotations

import argparse
import importlib
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mst import cbor  # noqa: E402
from mst.car import read_car  # noqa: E402
from mst.commit import decode_commit, verify_commit_sig  # noqa: E402
from mst.crypto import PrivateKey, parse_did_key  # noqa: E402
from mst.invert import invert_ops  # noqa: E402
from mst.ops import RepoOp  # noqa: E402
from mst.repo import CommitResult, Repo, Write  # noqa: E402
from mst.tid import TidClock  # noqa: E402

DID = "did:plc:benchbenchbenchbenchbenc"


def rate(fn: Callable[[int], None], items: int, seconds: float, rounds: int = 3) -> float:
    """Calls per CPU-second of ``fn(i)``, i cycling over ``items``: the best of ``rounds``
    windows of ~``seconds / rounds`` of this process's CPU time (the machine is shared, so
    CPU time, not wall time, is the per-core figure; best-of damps interference)."""
    best = 0.0
    for _ in range(rounds):
        n = 0
        start = time.process_time()
        deadline = start + seconds / rounds
        while True:
            for i in range(items):
                fn(i)
            n += items
            now = time.process_time()
            if now >= deadline:
                break
        best = max(best, n / (now - start))
    return best


def post(rng: random.Random) -> dict:
    return {
        "$type": "app.bsky.feed.post",
        "text": "benchmark post " + rng.randbytes(24).hex(),
        "createdAt": "2026-11-22T01:00:00.000Z",
        "langs": ["en"],
    }


def fixed_clock(rng: random.Random) -> Callable[[], int]:
    """A deterministic microsecond clock (from 2026-11-22T00:00Z, 1 ms–10 s steps), so record
    keys, hence the tree's shape and the slices, are the same in every run."""
    now = 1_795_305_600_000_000

    def tick() -> int:
        nonlocal now
        now += rng.randint(1_000, 10_000_000)
        return now

    return tick


def build_repo(records: int, rng: random.Random) -> Repo:
    clock = TidClock(clock_id=3, now_micros=fixed_clock(random.Random(rng.random())))
    repo = Repo.create(DID, PrivateKey.generate_k256(), clock)
    made = 0
    while made < records:
        batch = min(200, records - made)
        repo.apply_writes(
            [Write("create", "app.bsky.feed.post", repo.clock.next(), post(rng)) for _ in range(batch)]
        )
        made += batch
    return repo


def random_writes(repo: Repo, paths: list[str], rng: random.Random) -> list[Write]:
    writes = []
    used: set[str] = set()
    for _ in range(rng.randint(1, 3)):
        roll = rng.random()
        if roll < 0.6:
            writes.append(Write("create", "app.bsky.feed.like", repo.clock.next(), post(rng)))
            continue
        path = rng.choice(paths)
        if path in used:
            continue
        used.add(path)
        coll, rkey = path.split("/")
        if roll < 0.8:
            writes.append(Write("update", coll, rkey, post(rng)))
        else:
            writes.append(Write("delete", coll, rkey))
            paths.remove(path)
    return writes


def frame_for(res: CommitResult, seq: int) -> bytes:
    """A ``#commit`` event frame as a PDS would send it (header + body, sync 1.1 fields)."""
    ops = [
        {"action": o.action, "path": o.path, "cid": o.cid, **({"prev": o.prev} if o.prev else {})}
        for o in res.ops
    ]
    body = {
        "seq": seq,
        "rebase": False,
        "tooBig": False,
        "repo": DID,
        "commit": res.commit_cid,
        "rev": res.rev,
        "since": res.since,
        "blocks": res.car,
        "ops": ops,
        "blobs": [],
        "prevData": res.prev_data,
        "time": "2026-11-22T01:00:00.000Z",
    }
    return cbor.encode({"op": 1, "t": "#commit"}) + cbor.encode(body)


def verify_frame(frame: bytes, did_key: str) -> bool:
    """The whole per-commit check a relay does, from raw frame bytes."""
    header, n = cbor.decode_prefix(frame)
    body = cbor.decode(frame[n:])
    car = read_car(body["blocks"], max_blocks=10_000, max_total_bytes=2_000_000)
    commit_cid = body["commit"]
    if car.roots[0] != commit_cid:
        return False
    commit = decode_commit(car.blocks[commit_cid])
    if commit.did != body["repo"] or commit.rev != body["rev"]:
        return False
    if not verify_commit_sig(commit, parse_did_key(did_key)):
        return False
    ops = [RepoOp(o["action"], o["path"], o["cid"], o.get("prev")) for o in body["ops"]]
    return invert_ops(car.blocks, commit.data, ops) == body["prevData"]


def stage_cost(fn: Callable[[int], object], n: int, rounds: int = 5) -> float:
    """CPU microseconds per call of ``fn(i)`` over ``i in range(n)`` (best of ``rounds``)."""
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for i in range(n):
            fn(i)
        best = min(best, time.process_time() - start)
    return best / n * 1e6


def print_stages(frames: list[bytes], did_key: str) -> None:
    """Cost of each step of :func:`verify_frame`, each measured on its own inputs."""
    n = len(frames)
    key = parse_did_key(did_key)
    bodies = [cbor.decode(f[cbor.decode_prefix(f)[1] :]) for f in frames]
    cars = [read_car(b["blocks"]) for b in bodies]
    commits = [decode_commit(c.blocks[b["commit"]]) for c, b in zip(cars, bodies, strict=True)]
    ops = [[RepoOp(o["action"], o["path"], o["cid"], o.get("prev")) for o in b["ops"]] for b in bodies]
    stages = {
        "frame_decode": lambda i: cbor.decode(frames[i][cbor.decode_prefix(frames[i])[1] :]),
        "car_parse": lambda i: read_car(bodies[i]["blocks"]),
        "commit_decode": lambda i: decode_commit(cars[i].blocks[bodies[i]["commit"]]),
        "signature": lambda i: verify_commit_sig(commits[i], key),
        "op_list": lambda i: [
            RepoOp(o["action"], o["path"], o["cid"], o.get("prev")) for o in bodies[i]["ops"]
        ],
        "inversion": lambda i: invert_ops(cars[i].blocks, commits[i].data, ops[i]),
    }
    total = 0.0
    for name, fn in stages.items():
        us = stage_cost(fn, n)
        total += us
        print(f"# stage {name:14s} {us:7.1f} us/frame", file=sys.stderr)
    print(f"# stages total         {total:7.1f} us/frame (= {1e6 / total:.0f}/s)", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=10_000)
    ap.add_argument("--commits", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--stages", action="store_true", help="also print per-stage CPU costs")
    args = ap.parse_args()
    rng = random.Random(1)
    from mst import native

    # which build of mst.node/invert/car ran (``RELAY_PURE_PYTHON=1`` measures the Python sources)
    print(f"# mst: {native.STATUS}", file=sys.stderr)
    print(f"RESULT core_compiled={int(native.active())}")

    t0 = time.perf_counter()
    repo = build_repo(args.records, rng)
    print(f"# built {len(repo)}-record repo in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    paths = list(repo.records())
    did_key = repo.key.did_key()

    results: list[CommitResult] = []
    t0 = time.process_time()
    for _ in range(args.commits):
        results.append(repo.apply_writes(random_writes(repo, paths, rng)))
    producer = args.commits / (time.process_time() - t0)
    frames = [frame_for(r, i) for i, r in enumerate(results)]
    assert all(verify_frame(f, did_key) for f in frames)
    n = len(frames)

    def decode_one(i: int) -> None:
        f = frames[i]
        _, k = cbor.decode_prefix(f)
        read_car(cbor.decode(f[k:])["blocks"])

    parsed = [(read_car(r.car).blocks, r.data, r.ops) for r in results]
    # the key-height cache of the build in use (a private global of mst/_node.py)
    heights = importlib.import_module("mst._native_node" if native.active() else "mst._node")._HEIGHTS

    def cold_verify(i: int) -> None:
        heights.clear()  # no key-height cache hits: every key of every node is hashed again
        verify_frame(frames[i], did_key)

    def invert_one(i: int) -> None:
        blocks, data, ops = parsed[i]
        invert_ops(blocks, data, ops)

    from firehose.validate import judge_frame

    judged = [frame_for(r, i + 1) for i, r in enumerate(results)]  # seq 0 is rejected (bad_seq)
    now = time.time()
    assert all(judge_frame(f, None, did_key, now)[0].kind == "accept" for f in judged)

    k256 = PrivateKey.generate_k256()
    p256 = PrivateKey.generate_p256()
    msgs = [rng.randbytes(120) for _ in range(64)]
    ksigs = [(k256.public_key, m, k256.sign(m)) for m in msgs]
    psigs = [(p256.public_key, m, p256.sign(m)) for m in msgs]

    from firehose.pipeline import validate_batch
    from firehose.state import AccountState, account_row

    # each frame judged against the account state just before it (the chain checks pass)
    states = [AccountState(did=DID, rev=r.since, data_cid=r.prev_data.encode() if r.prev_data else None)
              for r in results]
    now = 1_900_000_000.0  # after every rev (the simulated clock runs ahead of the real one)
    jobs = [(frame_for(r, i + 1), account_row(s), did_key, now, False)
            for i, (r, s) in enumerate(zip(results, states, strict=True))]
    verdicts, _ = validate_batch(jobs)
    assert all(v[0] == "accept" for v in verdicts), {v[1] for v in verdicts}

    def worker_batch(i: int) -> None:
        validate_batch(jobs[i * 30 : i * 30 + 30])

    figures = {
        "core_decode_per_s": rate(decode_one, n, args.seconds),
        "core_inversions_per_s": rate(invert_one, n, args.seconds),
        "core_k256_verify_per_s": rate(
            lambda i: ksigs[i][0].verify(ksigs[i][1], ksigs[i][2]), 64, args.seconds
        ),
        "core_p256_verify_per_s": rate(
            lambda i: psigs[i][0].verify(psigs[i][1], psigs[i][2]), 64, args.seconds
        ),
        "core_commit_verify_per_s": rate(lambda i: verify_frame(frames[i], did_key), n, args.seconds),
        "core_commit_verify_cold_per_s": rate(cold_verify, n, args.seconds),
        # what a validation worker runs per frame (the checks above, the records' hashes, pruning)
        "core_relay_judge_per_s": rate(lambda i: judge_frame(judged[i], None, did_key, now), n, args.seconds),
        "core_worker_commits_per_s": 30 * rate(worker_batch, n // 30, args.seconds),
        "core_producer_commits_per_s": producer,
    }
    if args.stages:
        print_stages(frames, did_key)
    avg_frame = sum(len(f) for f in frames) / n
    avg_blocks = sum(len(p[0]) for p in parsed) / n
    print(f"# {n} commits, avg frame {avg_frame:.0f} B, avg {avg_blocks:.1f} blocks", file=sys.stderr)
    for name, value in figures.items():
        print(f"RESULT {name}={value:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
