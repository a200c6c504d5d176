"""Train the relay's own zstd dictionary from simulated records; writes ``firehose/jetstream_zstd.dict``.

The relay compresses ``/subscribe?zstdDictionary=<its id>`` messages with this dictionary (and
serves it at ``GET /xrpc/network.bsky.jetstream.getZstdDictionary``; its zstd dictionary id is in
every compressed frame); ``compress=true`` uses Jetstream's own dictionary instead. The
samples are Jetstream messages exactly as ``firehose.jetstream`` writes them, for the simulator's
write mix (``sim.records.WriteMix``: likes, posts, follows, reposts, profiles, updates and
deletes) plus identity and account messages, with random DIDs, revs and CIDs.

    .venv/bin/python bench/train_jetstream_dict.py [--samples 30000] [--size 65536] [--out PATH]

Then compare: it prints ``RESULT`` lines with the mean message size raw, zstd without a dictionary,
with Jetstream's dictionary and with the new one, over fresh samples (another seed). Clients must use the dictionary the relay serves:
after regenerating, restart relays together with the clients that embed a copy.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import result  # noqa: E402
from firehose.jetstream import (  # noqa: E402
    DICTIONARY_PATH,
    LEGACY_DICTIONARY_PATH,
    ZSTD_LEVEL,
    _dumps,
    commit_message,
)
from mst.cbor import encode  # noqa: E402
from mst.cid import cid_for_cbor  # noqa: E402
from sim.ident import TidClock  # noqa: E402
from sim.records import WriteMix  # noqa: E402

_B32 = "abcdefghijklmnopqrstuvwxyz234567"


def random_did(rng: random.Random) -> str:
    return "did:plc:" + "".join(rng.choice(_B32) for _ in range(24))


def samples(n: int, seed: int) -> list[bytes]:
    """``n`` messages: ~96 % commits (one per op of the write mix), the rest identity/account."""
    rng = random.Random(seed)
    dids = [random_did(rng) for _ in range(500)]
    mixes = {did: WriteMix(random.Random(rng.random()), other_dids=dids) for did in dids[:200]}
    paths: dict[str, list[str]] = {did: [] for did in mixes}
    revs = TidClock(clock_id=rng.randrange(1024))
    at_us = 1_760_000_000_000_000
    out: list[bytes] = []
    while len(out) < n:
        at_us += rng.randint(50, 2000)
        did = rng.choice(list(mixes))
        roll = rng.random()
        if roll < 0.02:
            out.append(_dumps({"did": did, "time_us": at_us, "kind": "identity", "identity": {
                "did": did, "handle": f"user{rng.randrange(10**6)}.bsky.social", "seq": rng.randrange(10**9),
                "time": "2025-10-09T12:00:00.000Z"}}))
            continue
        if roll < 0.04:
            active = rng.random() < 0.7
            body: dict[str, object] = {"active": active, "did": did, "seq": rng.randrange(10**9),
                                       "time": "2025-10-09T12:00:00.000Z"}
            if not active:
                body["status"] = rng.choice(["deactivated", "takendown", "deleted"])
            out.append(_dumps({"did": did, "time_us": at_us, "kind": "account", "account": body}))
            continue
        rev = revs.next()
        for w in mixes[did].next_writes(paths[did])[:20]:
            path = f"{w.collection}/{w.rkey}"
            if w.action == "delete":
                if path in paths[did]:
                    paths[did].remove(path)
                out.append(commit_message(did, at_us, rev, "delete", w.collection, w.rkey))
                continue
            if w.action == "create":
                paths[did].append(path)
            cid = cid_for_cbor(encode(w.record)).encode()
            out.append(commit_message(did, at_us, rev, w.action, w.collection, w.rkey, w.record, cid))
    return out[:n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=30_000)
    parser.add_argument("--size", type=int, default=65_536, help="dictionary size in bytes")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--out", default=str(DICTIONARY_PATH))
    args = parser.parse_args(argv)
    train = samples(args.samples, args.seed)
    dictionary = zstandard.train_dictionary(args.size, train, level=ZSTD_LEVEL, threads=1)
    Path(args.out).write_bytes(dictionary.as_bytes())
    print(f"wrote {args.out}: {len(dictionary.as_bytes())} bytes, dict id {dictionary.dict_id()}", flush=True)
    fresh = samples(5_000, args.seed + 1)
    plain = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    with_dict = zstandard.ZstdCompressor(level=ZSTD_LEVEL, dict_data=dictionary)
    raw = sum(map(len, fresh)) / len(fresh)
    result("json_bytes_per_message", raw)
    result("zstd_nodict_bytes_per_message", sum(len(plain.compress(m)) for m in fresh) / len(fresh))
    legacy = zstandard.ZstdCompressor(level=ZSTD_LEVEL,
                                      dict_data=zstandard.ZstdCompressionDict(LEGACY_DICTIONARY_PATH.read_bytes()))
    result("zstd_jetstream_dict_bytes_per_message", sum(len(legacy.compress(m)) for m in fresh) / len(fresh))
    result("zstd_dict_bytes_per_message", sum(len(with_dict.compress(m)) for m in fresh) / len(fresh))
    return 0


if __name__ == "__main__":
    sys.exit(main())
