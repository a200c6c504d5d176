"""A realistic write mix for simulated accounts.

Mostly one-op creates (likes, posts, follows, reposts), some updates (profile, posts), deletes
of existing records and multi-op commits (``applyWrites`` batches) of 2–200 ops. Record sizes run
from ~150 bytes (likes) to tens of KB (rare long posts with big embeds).
"""

from __future__ import annotations

import random
import time
from datetime import UTC, datetime
from typing import Any

from sim.ident import TidClock
from sim.repo import Write

_WORDS = (
    "the relay verifies every commit and every signature before it sequences the event so "
    "consumers can trust what they read from the firehose across many hosts today"
).split()
_CORPUS = " ".join(random.Random(7).choice(_WORDS) for _ in range(16_000))
_CORPUS_LEN = len(_CORPUS) // 2

#: Probabilities of each commit shape; the rest are one-op creates.
P_UPDATE = 0.06
P_DELETE = 0.06
P_MULTI = 0.04
MAX_OPS = 200


_iso_cache: list[int | str] = [-1, ""]  # [second, its ISO text]


def now_iso() -> str:
    """Current time as an atproto datetime with millisecond precision and ``Z``."""
    now = time.time()
    sec = int(now)
    if sec != _iso_cache[0]:
        _iso_cache[0] = sec
        _iso_cache[1] = datetime.fromtimestamp(sec, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{_iso_cache[1]}.{int((now - sec) * 1000):03d}Z"


class WriteMix:
    """Draws the next list of writes for an account, given its current record paths."""

    def __init__(self, rng: random.Random, other_dids: list[str] | None = None) -> None:
        self.rng = rng
        self.other_dids = other_dids or ["did:plc:ewvi7nxzyoun6zhxrhs64oiz"]
        self.rkeys = TidClock(clock_id=rng.randrange(1024))

    def text(self, approx: int) -> str:
        """About ``approx`` characters of prose (a random window of a fixed corpus)."""
        start = self.rng.randrange(_CORPUS_LEN)
        return _CORPUS[start:start + approx]

    def record(self, collection: str) -> dict[str, Any]:
        """A record of ``collection`` with a realistic size distribution."""
        rng = self.rng
        created = now_iso()
        if collection == "app.bsky.feed.like" or collection == "app.bsky.feed.repost":
            did = rng.choice(self.other_dids)
            return {
                "$type": collection,
                "subject": {
                    "uri": f"at://{did}/app.bsky.feed.post/{self.rkeys.next()}",
                    "cid": "bafyreie5cvv4h45feadgeuwhbcutmh6t2ceseocckahdoe6uat64zmz454",
                },
                "createdAt": created,
            }
        if collection == "app.bsky.graph.follow":
            return {"$type": collection, "subject": rng.choice(self.other_dids), "createdAt": created}
        if collection == "app.bsky.actor.profile":
            return {
                "$type": collection,
                "displayName": self.text(20)[:64],
                "description": self.text(rng.randint(50, 250)),
            }
        # posts: mostly short, sometimes long with an embed, rarely tens of KB
        roll = rng.random()
        size = rng.randint(20, 300) if roll < 0.9 else rng.randint(1000, 3000) if roll < 0.99 else rng.randint(10_000, 40_000)
        rec: dict[str, Any] = {"$type": "app.bsky.feed.post", "text": self.text(size), "createdAt": created}
        if rng.random() < 0.3:
            rec["langs"] = ["en"]
        if size > 1000:
            rec["embed"] = {
                "$type": "app.bsky.embed.external",
                "external": {"uri": "https://example.com/a", "title": self.text(40), "description": self.text(size // 4)},
            }
        return rec

    def _create(self) -> Write:
        roll = self.rng.random()
        coll = (
            "app.bsky.feed.like" if roll < 0.45
            else "app.bsky.feed.post" if roll < 0.75
            else "app.bsky.graph.follow" if roll < 0.9
            else "app.bsky.feed.repost"
        )
        return Write("create", coll, self.rkeys.next(), self.record(coll))

    def next_writes(self, paths: list[str]) -> list[Write]:
        """Writes for one commit on a repo currently holding ``paths``."""
        rng = self.rng
        roll = rng.random()
        if roll < P_UPDATE:
            if "app.bsky.actor.profile/self" not in paths:
                return [Write("create", "app.bsky.actor.profile", "self", self.record("app.bsky.actor.profile"))]
            posts = [p for p in paths if p.startswith("app.bsky.feed.post/")]
            if posts and rng.random() < 0.5:
                coll, rkey = rng.choice(posts).split("/", 1)
                return [Write("update", coll, rkey, self.record(coll))]
            return [Write("update", "app.bsky.actor.profile", "self", self.record("app.bsky.actor.profile"))]
        if roll < P_UPDATE + P_DELETE and paths:
            coll, rkey = rng.choice(paths).split("/", 1)
            return [Write("delete", coll, rkey)]
        if roll < P_UPDATE + P_DELETE + P_MULTI:
            n = rng.randint(2, 10) if rng.random() < 0.9 else rng.randint(11, MAX_OPS)
            writes = [self._create() for _ in range(n)]
            if paths and rng.random() < 0.5:
                victims = rng.sample(paths, min(len(paths), max(1, n // 5)))
                for p in victims:
                    coll, rkey = p.split("/", 1)
                    writes.append(Write("delete", coll, rkey))
                writes = writes[:MAX_OPS]
            return writes
        return [self._create()]
