"""What the fault suite observes: a recording ``subscribeRepos`` consumer, a poller of the relay's
``/_ready`` and ``/_health`` endpoints, and the comparison of what a consumer saw with the
simulator's ground truth.

Contracts:

* :class:`RecordingConsumer` keeps one connection open at a time and reconnects after *any*
  disconnect, error frame or failed connection attempt (every 0.1 s), with ``cursor = last seq``
  (cursors are exclusive: the stream resumes after it), or its initial cursor if it has seen
  nothing yet. It records every event frame as a :class:`Seen` in arrival order, never
  deduplicating: duplicates are what it is there to find. A ``FutureCursor`` answer (a cursor
  beyond the relay's latest seq: never expected) is
  retried with the same cursor.
* :class:`Poller` asks each endpoint every ``interval`` seconds and records every answer
  (status code, or ``None`` for no answer) with its ``time.monotonic()``.
* :func:`compare` is pure: ground truth + what one consumer saw -> a :class:`Tally`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
from websockets.asyncio.client import connect

from firehose.frames import decode_frame
from sim.fleet import TruthEvent

RECONNECT_DELAY = 0.1


@dataclass(frozen=True, slots=True)
class Seen:
    """One event frame as a consumer received it (``at`` = ``time.monotonic()`` on arrival)."""

    seq: int
    kind: str
    did: str
    rev: str | None
    at: float


class Background:
    """Owns one background task: ``_launch`` starts it, ``stop()`` cancels it and waits for it."""

    _task: asyncio.Task[Any] | None = None

    def _launch(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        self._task = asyncio.create_task(coro, name=name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


class RecordingConsumer(Background):
    """A ``subscribeRepos`` consumer that records everything and never gives up (see module doc).

    ``await start()``; ``await stop()``; ``frames`` is the record, ``last_rev`` the newest
    ``#commit``/``#sync`` rev per account, ``connections``/``errors`` count what happened.
    """

    def __init__(self, ws_url: str, *, cursor: int = 0, name: str = "consumer") -> None:
        self.ws_url = ws_url
        self.initial_cursor = cursor
        self.name = name
        self.frames: list[Seen] = []
        self.last_rev: dict[str, str] = {}
        self.max_seq = 0
        self.connections = 0
        self.errors: Counter[str] = Counter()

    @property
    def cursor(self) -> int:
        """Where the next connection starts: after the newest seq seen."""
        return self.max_seq if self.frames else self.initial_cursor

    async def start(self) -> None:
        self._launch(self._run(), f"consumer {self.name}")

    def first_after(self, seq: int, since: float, dids: set[str] | None = None) -> float | None:
        """Arrival time of the first frame with seq > ``seq`` that arrived at or after ``since``
        (and, given ``dids``, concerns one of those accounts)."""
        for f in self.frames:
            if f.at >= since and f.seq > seq and (dids is None or f.did in dids):
                return f.at
        return None

    def max_seq_before(self, t: float) -> int:
        """The highest seq received before ``t`` (0 if none)."""
        return max((f.seq for f in self.frames if f.at < t), default=0)

    async def _run(self) -> None:
        while True:
            try:
                async with connect(f"{self.ws_url}?cursor={self.cursor}", max_size=None, open_timeout=5,
                                   close_timeout=1, compression=None) as ws:
                    self.connections += 1
                    async for raw in ws:
                        if isinstance(raw, bytes):
                            self._record(raw)
                    self.errors["closed"] += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: reconnect from where we are
                self.errors[type(exc).__name__] += 1
            await asyncio.sleep(RECONNECT_DELAY)

    def _record(self, raw: bytes) -> None:
        frame = decode_frame(raw, strict=False)
        if frame.is_error:
            self.errors[f"error:{frame.error}"] += 1
            return
        body = frame.body
        seq = body.get("seq")
        if frame.t == "#info" or not isinstance(seq, int):
            self.errors[f"info:{body.get('name')}"] += 1
            return
        kind = str(frame.t)
        did = str(body.get("repo") if kind == "#commit" else body.get("did"))
        rev = body.get("rev") if kind in ("#commit", "#sync") else None
        self.frames.append(Seen(seq, kind, did, rev, time.monotonic()))
        self.max_seq = max(self.max_seq, seq)
        if rev is not None and rev > self.last_rev.get(did, ""):
            self.last_rev[did] = rev


@dataclass(frozen=True, slots=True)
class Answer:
    """One probe answer: ``status`` is the HTTP status, ``None`` when nothing answered; ``sent``
    and ``at`` are when the request was sent and answered."""

    sent: float
    at: float
    status: int | None
    seq: int | None = None


class Poller(Background):
    """Polls ``GET url`` every ``interval`` s in the background, recording every :class:`Answer`
    (``seq`` is the ``seq`` field of a JSON body, when there is one)."""

    def __init__(self, url: str, *, interval: float = 0.25, timeout: float = 5.0) -> None:
        self.url = url
        self.interval = interval
        self.timeout = timeout
        self.answers: list[Answer] = []

    async def start(self) -> None:
        self._launch(self._run(), f"poll {self.url}")

    async def ask(self, http: httpx.AsyncClient) -> Answer:
        """One request now (also recorded)."""
        seq: int | None = None
        sent = time.monotonic()
        try:
            r = await http.get(self.url)
            status: int | None = r.status_code
            with contextlib.suppress(ValueError, AttributeError):
                value = r.json().get("seq")
                seq = value if isinstance(value, int) else None
        except httpx.HTTPError:
            status = None
        answer = Answer(sent, time.monotonic(), status, seq)
        self.answers.append(answer)
        return answer

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=self.timeout) as http:
            while True:
                t0 = time.monotonic()
                await self.ask(http)
                await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - t0)))

    def between(self, start: float, end: float) -> list[Answer]:
        """Answers to requests sent at or after ``start`` and answered by ``end``."""
        return [a for a in self.answers if a.sent >= start and a.at <= end]

    def max_seq_before(self, t: float) -> int:
        return max((a.seq for a in self.answers if a.at < t and a.seq is not None), default=0)


async def wait_until(predicate: Callable[[], bool], timeout: float, *, interval: float = 0.1,
                     give_up: Callable[[], bool] | None = None) -> bool:
    """Wait until ``predicate()`` holds; False after ``timeout`` s or as soon as ``give_up()``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or (give_up is not None and give_up()):
            return False
        await asyncio.sleep(interval)
    return True


def final_revs(truth: Iterable[TruthEvent]) -> dict[str, str]:
    """The newest accepted ``#commit``/``#sync`` rev per account in the ground truth."""
    out: dict[str, str] = {}
    for t in truth:
        if t.verdict == "accept" and t.kind in ("#commit", "#sync") and t.rev is not None:
            if t.rev > out.get(t.did, ""):
                out[t.did] = t.rev
    return out


def caught_up(consumer: RecordingConsumer, finals: dict[str, str]) -> bool:
    """The consumer has seen every account reach its final rev (as ``#commit`` or ``#sync``)."""
    last = consumer.last_rev
    return all(last.get(did, "") >= rev for did, rev in finals.items())


@dataclass
class Tally:
    """One consumer's stream judged against the ground truth.

    * ``lost`` – accepted ``#commit`` events (did, rev) of the ground truth never received as ``#commit``;
    * ``duplicate_seqs`` – frames whose seq had already been received;
    * ``out_of_order`` – frames whose seq is below one received before (not counting duplicates);
    * ``duplicate_commits`` – extra copies of a (did, rev) ``#commit`` under different seqs;
    * ``unexpected_commits`` – ``#commit`` (did, rev) the ground truth does not have as accepted;
    * ``converted_to_sync`` – accounts that received a ``#sync`` the hosts never sent: the trace of a
      repair, i.e. the relay broke the account's chain and resynchronised it instead of delivering
      its commits;
    * ``rev_order`` – ``#commit``/``#sync`` frames whose rev is not above the account's previous one;
    * ``stale_accounts`` – accounts whose newest received rev is not the host's final rev.
    """

    frames: int = 0
    expected_commits: int = 0
    lost: int = 0
    duplicate_seqs: int = 0
    out_of_order: int = 0
    duplicate_commits: int = 0
    unexpected_commits: int = 0
    converted_to_sync: int = 0
    rev_order: int = 0
    stale_accounts: int = 0
    lost_sample: list[str] = field(default_factory=list)


def compare(truth: Iterable[TruthEvent], seen: list[Seen], host_revs: dict[str, str | None]) -> Tally:
    """Judge what one consumer ``seen`` against the ground truth and the hosts' final revs."""
    truth = list(truth)
    expected = {(t.did, t.rev) for t in truth if t.kind == "#commit" and t.verdict == "accept"}
    truth_syncs = {t.did for t in truth if t.kind == "#sync" and t.verdict == "accept"}
    tally = Tally(frames=len(seen), expected_commits=len(expected))
    seqs: set[int] = set()
    top = 0
    commits: Counter[tuple[str, str | None]] = Counter()
    synced: set[str] = set()
    last_rev: dict[str, str] = {}
    for f in seen:
        if f.seq in seqs:
            tally.duplicate_seqs += 1
            continue
        seqs.add(f.seq)
        if f.seq < top:
            tally.out_of_order += 1
        top = max(top, f.seq)
        if f.kind == "#commit":
            commits[(f.did, f.rev)] += 1
        elif f.kind == "#sync":
            synced.add(f.did)
        if f.kind in ("#commit", "#sync") and f.rev is not None:
            if f.rev <= last_rev.get(f.did, ""):
                tally.rev_order += 1
            else:
                last_rev[f.did] = f.rev
    missing = sorted(expected - set(commits))
    tally.lost = len(missing)
    tally.lost_sample = [f"{did[-8:]}@{rev}" for did, rev in missing[:5]]
    tally.duplicate_commits = sum(n - 1 for n in commits.values())
    tally.unexpected_commits = sum(1 for key in commits if key not in expected)
    tally.converted_to_sync = len(synced - truth_syncs)
    tally.stale_accounts = sum(1 for did, rev in host_revs.items() if last_rev.get(did) != rev)
    return tally
