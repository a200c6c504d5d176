"""A fleet of simulated PDS hosts and one PLC directory, all on 127.0.0.1 ephemeral ports.

```python
fleet = SimFleet(SimConfig(hosts=2, accounts_per_host=10, seed=1))
await fleet.start()
await fleet.generate(100)          # 100 commits (realistic mix), emitted at once
fleet.prepare(50_000)              # pre-generate frames, held back ...
await fleet.release(rate=6000)     # ... and released at a steady rate (load generation)
fleet.ground_truth                 # what a correct relay must do with every emitted event
await fleet.stop()
```

Every emitted event is recorded as a :class:`TruthEvent`. Faults (``SimHost.set_fault``) produce
events whose ``verdict`` is not ``accept``; see :mod:`sim.faults`. The weather (slow or
failing identity services, getRepo failures, key-rotation bursts) is switched per account or
host with ``slow_did``, ``slow_handle``, ``SimHost.fail_repos``, ``rotate_keys``; see
:mod:`sim.faults` and :mod:`sim.weather`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sim.faults import EXPECTED
from sim.host import LogEntry, SimAccount, SimHost
from sim.ident import Curve, SigningKey, TidClock, did_document, plc_did
from sim.plc import SimPLC
from sim.records import WriteMix, now_iso
from sim.repo import CommitResult, SimRepo, Write, write_car
from sim.weather import Delay, HandleDomains, HandleWeather, SimDNS

OVERSIZED_BYTES = 5_300_000


def unreadable(frame: bytes) -> bytes:
    """``frame`` cut in the middle of its body: bytes that do not decode as a frame."""
    return frame[: max(1, len(frame) // 2)]


@dataclass
class SimConfig:
    """Shape of a fleet. ``accounts_per_host`` accounts are created on each of ``hosts`` hosts."""

    hosts: int = 2
    accounts_per_host: int = 10
    seed: int = 0
    #: fraction of accounts with P-256 keys (the rest K-256)
    p256_fraction: float = 0.3
    #: emit ``#identity``, ``#account`` and a first ``#commit`` for every account at start
    announce_accounts: bool = True
    #: records each account holds before the fleet starts (not emitted on the stream)
    initial_records: int = 0
    #: backfill window per host, in frames, and in frame bytes (None: no byte bound)
    log_limit: int = 500_000
    log_bytes: int | None = None
    #: delay of a ``slow`` frame and length of a ``stall``, seconds
    slow_delay: float = 0.05
    stall_seconds: float = 2.0
    #: ports: 0 = ephemeral; otherwise host i listens on ``port_base + i``
    port_base: int = 0
    plc_port: int = 0
    bind: str = "127.0.0.1"
    #: also serve the handles over DNS (``SimFleet.dns``, see ``sim.weather.SimDNS``)
    dns: bool = False


@dataclass(slots=True)
class TruthEvent:
    """What a correct relay must do with one emitted event.

    ``verdict`` is ``accept`` for valid events, else ``reject``/``desync``/``ignore`` with the
    snake_case ``reason`` from :data:`sim.faults.EXPECTED`. ``fault`` names the fault mode
    that produced or accompanied the event (connection faults keep ``valid=True``).
    """

    host: str
    upstream_seq: int
    did: str
    kind: str
    rev: str | None
    valid: bool
    reason: str | None = None
    verdict: str = "accept"
    fault: str | None = None
    commit: str | None = None
    sent_at: float = 0.0


@dataclass
class _Pending:
    host: SimHost
    entry: LogEntry | None
    truth: TruthEvent | None


class SimFleet:
    """N simulated hosts × M accounts plus a PLC directory; see the module docstring."""

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        self.rng = random.Random(self.config.seed)
        self.hosts: list[SimHost] = [
            SimHost(i, log_limit=self.config.log_limit, log_bytes=self.config.log_bytes,
                    slow_delay=self.config.slow_delay, stall_seconds=self.config.stall_seconds)
            for i in range(self.config.hosts)
        ]
        self.domains = HandleDomains(rng=random.Random(self.config.seed + 1))
        self.plc = SimPLC(self.domains, seed=self.config.seed + 2)
        self.dns: SimDNS | None = SimDNS(self.domains) if self.config.dns else None
        self.accounts: list[SimAccount] = []
        self.by_did: dict[str, SimAccount] = {}
        self.ground_truth: list[TruthEvent] = []
        self.commits_generated = 0
        self._pending: list[_Pending] = []
        self._inactive: list[SimAccount] = []
        self._wiped_hosts: dict[int, str] = {}  # host index -> the wipe fault, until its next frame
        self._restored: set[str] = set()  # accounts rolled back by a wipe_restore, until their next commit
        self._mix: WriteMix | None = None
        self._started = False
        #: (did, status) of every ``drift_status`` fault
        self.drifts: list[tuple[str, str]] = []

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def plc_url(self) -> str:
        return self.plc.url

    async def start(self) -> None:
        """Bind every host and the PLC directory, create the accounts, announce them."""
        cfg = self.config
        await self.plc.start(cfg.bind, cfg.plc_port)
        if self.dns is not None:
            await self.dns.start(cfg.bind)
        for h in self.hosts:
            await h.start(cfg.bind, cfg.port_base + h.index if cfg.port_base else 0)
        dids = [plc_did(self.rng) for _ in range(cfg.hosts * cfg.accounts_per_host)]
        self._mix = WriteMix(self.rng, other_dids=dids[:1000] or None)
        for i, did in enumerate(dids):
            await self._create_account(did, self.hosts[i % cfg.hosts])
            if i % 200 == 199:
                await asyncio.sleep(0)
        self._flush_now()
        self._started = True

    async def stop(self) -> None:
        for h in self.hosts:
            await h.stop()
        await self.plc.stop()
        if self.dns is not None:
            await self.dns.stop()

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- accounts ----------------------------------------------------------------------------
    async def _create_account(self, did: str, host: SimHost) -> SimAccount:
        curve: Curve = "p256" if self.rng.random() < self.config.p256_fraction else "k256"
        key = SigningKey.generate(curve, self.rng)
        repo = SimRepo(did, key, TidClock(clock_id=self.rng.randrange(1024)))
        acct = SimAccount(did, host, repo, key, handle=f"u{len(self.accounts)}.sim.test")
        self.accounts.append(acct)
        self.by_did[did] = acct
        host.accounts[did] = acct
        self._publish_doc(acct)
        assert self._mix is not None
        if self.config.initial_records:
            writes = [self._mix._create() for _ in range(self.config.initial_records)]
            for k in range(0, len(writes), 200):
                res = repo.apply_writes(writes[k:k + 200])
                acct.history.append(self._commit_body(acct, res))
        if self.config.announce_accounts:
            self._queue(host, "#identity", {"did": did, "time": now_iso(), "handle": acct.handle}, did)
            self._queue(host, "#account", {"did": did, "time": now_iso(), "active": True}, did)
            if repo.rev is None:
                res = repo.apply_writes([self._mix._create()])
                self._emit_commit(acct, res)
        elif repo.rev is None:
            repo.apply_writes([self._mix._create()])
        return acct

    def _publish_doc(self, acct: SimAccount) -> None:
        self.plc.docs[acct.did] = did_document(acct.did, acct.handle, acct.key, acct.host.url)
        self.plc.handles[acct.handle] = acct.did

    # -- event plumbing ----------------------------------------------------------------------
    def _queue(
        self,
        host: SimHost,
        t: str,
        body: dict[str, Any],
        did: str,
        *,
        rev: str | None = None,
        verdict: str = "accept",
        reason: str | None = None,
        fault: str | None = None,
        commit: str | None = None,
        action: str | None = None,
    ) -> LogEntry:
        entry = host.make_entry(t, body, action)
        wiped = self._wiped_hosts.pop(host.index, None)
        if wiped is not None:
            fault = fault or wiped
        truth = TruthEvent(host.hostname, entry.seq, did, t, rev, verdict == "accept", reason, verdict, fault, commit)
        self.ground_truth.append(truth)
        self._pending.append(_Pending(host, entry, truth))
        return entry

    def _flush_now(self) -> None:
        """Publish every pending entry immediately (a pending wipe takes effect in order)."""
        by_host: dict[int, list[LogEntry]] = {}
        now = time.time()
        for p in self._pending:
            if p.entry is None:  # wipe marker
                p.host.publish(by_host.pop(p.host.index, []))
                p.host.drop_log()
                continue
            by_host.setdefault(p.host.index, []).append(p.entry)
            if p.truth is not None:
                p.truth.sent_at = now
        self._pending.clear()
        for i, entries in by_host.items():
            self.hosts[i].publish(entries)

    def _commit_body(self, acct: SimAccount, res: CommitResult, car: bytes | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "rebase": False,
            "tooBig": False,
            "repo": acct.did,
            "commit": res.commit_cid,
            "rev": res.rev,
            "since": res.since,
            "blocks": res.car if car is None else car,
            "ops": [op.to_wire() for op in res.ops],
            "blobs": [],
            "time": now_iso(),
        }
        if res.prev_data is not None:
            body["prevData"] = res.prev_data
        return body

    def _emit_commit(self, acct: SimAccount, res: CommitResult, **truth: Any) -> None:
        if acct.did in self._restored and truth.get("verdict", "accept") == "accept":
            self._restored.discard(acct.did)  # the first commit after the restore does not chain
            verdict, reason = EXPECTED["wipe_restore"]
            truth = {**truth, "verdict": verdict, "reason": reason, "fault": "wipe_restore"}
        body = self._commit_body(acct, res)
        if truth.get("verdict", "accept") == "accept":
            acct.history.append(dict(body))
            if len(acct.history) > 8:
                del acct.history[0]
        host = acct.host
        action = None
        for kind in ("disconnect", "stall", "slow"):
            rate = host.faults.get(kind)
            if rate and self.rng.random() < rate:
                action = kind
                truth.setdefault("fault", kind)
                break
        self._queue(host, "#commit", body, acct.did, rev=res.rev, commit=res.commit_cid.encode(), action=action, **truth)

    async def markers(self, among: list[SimAccount] | None = None) -> list[TruthEvent]:
        """One valid commit from every active account, emitted at once, free of faults and
        connection actions: a consumer of a relay that has seen them all has seen everything each
        of those accounts sent before them (a relay keeps each account's order, not the order
        between the accounts of a host). ``among``: the accounts to use (e.g. only those the relay
        admits). Returns their truth events."""
        assert self._mix is not None
        start = len(self.ground_truth)
        for acct in among or self.accounts:
            if acct.status != "active":
                continue
            res = acct.repo.apply_writes(self._mix.next_writes(acct.repo.record_paths()))
            body = self._commit_body(acct, res)
            acct.history.append(dict(body))
            if len(acct.history) > 8:
                del acct.history[0]
            self._queue(acct.host, "#commit", body, acct.did, rev=res.rev, commit=res.commit_cid.encode())
        self._flush_now()
        await asyncio.sleep(0)
        return self.ground_truth[start:]

    # -- generation --------------------------------------------------------------------------
    def _pick_active(self, among: Sequence[SimAccount] | None = None) -> SimAccount | None:
        pool = among or self.accounts
        for _ in range(20):
            a = self.rng.choice(pool)
            if a.status == "active":
                return a
        active = [a for a in pool if a.status == "active"]
        return self.rng.choice(active) if active else None

    def _step(self, among: Sequence[SimAccount] | None = None) -> bool:
        """Produce one commit (plus whatever fault events go with it); False if nobody is active."""
        assert self._mix is not None
        rng = self.rng
        if self._inactive and rng.random() < 0.2:
            self.set_status(self._inactive[rng.randrange(len(self._inactive))], "active")
        acct = self._pick_active(among)
        if acct is None:
            return False
        faults = acct.host.faults
        if faults:
            for kind in ("deactivate", "takedown", "key_rotation", "migration", "seq_backwards", "wipe_restore"):
                rate = faults.get(kind)
                if rate and rng.random() < rate:
                    self.inject(kind, acct)
                    if kind in ("deactivate", "takedown"):
                        return True
            for kind in ("bad_signature", "missing_block", "oversized", "broken_chain", "duplicate", "replay",
                         "unreadable", "foreign_sync"):
                rate = faults.get(kind)
                if rate and rng.random() < rate:
                    self.inject(kind, acct)
                    break
        res = acct.repo.apply_writes(self._mix.next_writes(acct.repo.record_paths()))
        self._emit_commit(acct, res)
        self.commits_generated += 1
        return True

    async def generate(self, n: int) -> list[TruthEvent]:
        """Produce ``n`` commits and emit them at once; returns the truth events added."""
        start = len(self.ground_truth)
        self._produce(n)
        self._flush_now()
        await asyncio.sleep(0)
        return self.ground_truth[start:]

    def _produce(self, n: int, among: Sequence[SimAccount] | None = None) -> None:
        for _ in range(n):
            if not self._step(among):
                break

    def prepare(self, n: int, among: Sequence[SimAccount] | None = None) -> int:
        """Pre-generate ``n`` commits whose frames are held back until :meth:`release`; ``among``
        limits them to those accounts (a working set), else any account."""
        before = len(self._pending)
        self._produce(n, among)
        return len(self._pending) - before

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def release(self, rate: float | None = None, *, tick: float = 0.01) -> float:
        """Publish held-back frames at ``rate`` frames/s (all at once if None); returns seconds."""
        t0 = time.perf_counter()
        if rate is None:
            self._flush_now()
            return time.perf_counter() - t0
        pending, self._pending = self._pending, []
        i = 0
        while i < len(pending):
            due = int((time.perf_counter() - t0) * rate) + 1
            if due > i:
                chunk = pending[i:due]
                self._pending = chunk
                self._flush_now()
                i = due
            await asyncio.sleep(tick)
        return time.perf_counter() - t0

    async def run(self, rate: float, duration: float | None = None, *, tick: float = 0.05) -> int:
        """Generate and emit commits at ``rate`` commits/s for ``duration`` s (forever if None)."""
        t0 = time.perf_counter()
        made = 0
        while duration is None or time.perf_counter() - t0 < duration:
            due = int((time.perf_counter() - t0) * rate)
            if due > made:
                k = min(due - made, max(1, int(rate * tick * 2)))
                self._produce(k)
                made += k
                self._flush_now()
            await asyncio.sleep(tick / 5)
        return made

    # -- faults and account events -----------------------------------------------------------
    def set_status(self, acct: SimAccount, status: str) -> None:
        """Change an account's status on its host and emit the ``#account`` event."""
        if acct.status == "active" and status != "active":
            self._inactive.append(acct)
        elif acct.status != "active" and status == "active":
            self._inactive.remove(acct)
        acct.status = status
        body: dict[str, Any] = {"did": acct.did, "time": now_iso(), "active": status == "active"}
        if status != "active":
            body["status"] = status
        fault = None if status == "active" else ("takedown" if status == "takendown" else "deactivate")
        self._queue(acct.host, "#account", body, acct.did, fault=fault)

    def drift_status(self, acct: SimAccount, status: str) -> None:
        """The "status drift" fault: the host changes ``acct``'s status and emits no ``#account``
        (its ``listRepos``/``getRepoStatus`` answer the new status; ``deleted`` removes the account
        from its host, which then answers ``RepoNotFound``). Each drift is kept in ``drifts``."""
        if status != "deleted":
            if acct.status == "active" and status != "active":
                self._inactive.append(acct)
            elif acct.status != "active" and status == "active" and acct in self._inactive:
                self._inactive.remove(acct)
        else:
            if acct in self._inactive:
                self._inactive.remove(acct)
            acct.host.accounts.pop(acct.did, None)
        acct.status = status
        self.drifts.append((acct.did, status))

    def inject(self, kind: str, acct: SimAccount) -> None:
        """Emit one instance of fault ``kind`` for ``acct`` (frame faults leave the repo as it was)."""
        assert self._mix is not None
        repo = acct.repo
        if kind == "deactivate":
            self.set_status(acct, "deactivated")
        elif kind == "takedown":
            self.set_status(acct, "takendown")
        elif kind == "key_rotation":
            acct.key = SigningKey.generate(self.rng.choice(["k256", "p256"]), self.rng)
            repo.key = acct.key
            self._publish_doc(acct)
            self._queue(acct.host, "#identity", {"did": acct.did, "time": now_iso(), "handle": acct.handle},
                        acct.did, fault="key_rotation")
        elif kind == "migration":
            others = [h for h in self.hosts if h is not acct.host]
            if not others:
                return
            old, new = acct.host, self.rng.choice(others)
            del old.accounts[acct.did]
            acct.host = new
            new.accounts[acct.did] = acct
            self._publish_doc(acct)
            self._queue(new, "#identity", {"did": acct.did, "time": now_iso(), "handle": acct.handle},
                        acct.did, fault="migration")
            self._queue(new, "#account", {"did": acct.did, "time": now_iso(), "active": True}, acct.did,
                        fault="migration")
            res = repo.resign()
            self._queue(new, "#sync", {"did": acct.did, "blocks": repo.commit_car(), "rev": res.rev, "time": now_iso()},
                        acct.did, rev=res.rev, commit=res.commit_cid.encode(), fault="migration")
            acct.history.append(self._commit_body(acct, res))
            self._queue(old, "#account", {"did": acct.did, "time": now_iso(), "active": False, "status": "deactivated"},
                        acct.did, verdict=EXPECTED["migration"][0], reason=EXPECTED["migration"][1],
                        fault="migration")
        elif kind in ("seq_backwards", "wipe_restore"):
            host = acct.host
            if kind == "wipe_restore":
                for other in host.accounts.values():
                    if other.repo.rollback():
                        self._restored.add(other.did)
                        if other.history:
                            other.history.pop()
            host.seq = 0  # frames generated from now on restart at seq 1
            self._pending.append(_Pending(host, None, None))
            self._wiped_hosts[host.index] = kind
        elif kind in ("bad_signature", "missing_block", "oversized"):
            snap = repo.snapshot()
            verdict, reason = EXPECTED[kind]
            if kind == "oversized":
                big = {"$type": "app.bsky.feed.post", "text": "x" * OVERSIZED_BYTES, "createdAt": now_iso()}
                res = repo.apply_writes([Write("create", "app.bsky.feed.post", self._mix.rkeys.next(), big)])
            elif kind == "bad_signature":
                wrong = SigningKey.generate(acct.key.curve, self.rng)
                res = repo.apply_writes(self._mix.next_writes(repo.record_paths()), sign_with=wrong)
            else:
                res = repo.apply_writes(self._mix.next_writes(repo.record_paths()))
                root = bytes(res.data)
                res.car = write_car(res.commit_cid, [b for b in res.blocks if bytes(b[0]) != root])
            repo.restore(snap)
            self._emit_commit(acct, res, verdict=verdict, reason=reason, fault=kind)
        elif kind == "unreadable":
            snap = repo.snapshot()
            res = repo.apply_writes(self._mix.next_writes(repo.record_paths()))
            repo.restore(snap)
            verdict, reason = EXPECTED[kind]
            entry = self._queue(acct.host, "#commit", self._commit_body(acct, res), acct.did, rev=res.rev,
                                verdict=verdict, reason=reason, fault=kind, commit=res.commit_cid.encode())
            entry.frame = unreadable(entry.frame)
        elif kind == "foreign_sync":
            others = [h for h in self.hosts if h is not acct.host]
            if not others:
                raise ValueError("foreign_sync needs a second host")
            snap = repo.snapshot()
            res = repo.resign()
            car = repo.commit_car()
            repo.restore(snap)
            verdict, reason = EXPECTED[kind]
            self._queue(self.rng.choice(others), "#sync",
                        {"did": acct.did, "blocks": car, "rev": res.rev, "time": now_iso()},
                        acct.did, rev=res.rev, commit=res.commit_cid.encode(), verdict=verdict, reason=reason,
                        fault=kind)
        elif kind == "broken_chain":
            res = repo.apply_writes(self._mix.next_writes(repo.record_paths()))
            acct.history.append(self._commit_body(acct, res))  # withheld: never emitted
            res = repo.apply_writes(self._mix.next_writes(repo.record_paths()))
            verdict, reason = EXPECTED[kind]
            self._emit_commit(acct, res, verdict=verdict, reason=reason, fault=kind)
            self.commits_generated += 1
        elif kind == "duplicate":
            res = repo.apply_writes(self._mix.next_writes(repo.record_paths()))
            self._emit_commit(acct, res)
            self.commits_generated += 1
            last = self._pending[-1]
            assert last.entry is not None  # _emit_commit just queued it
            dup = LogEntry(last.entry.seq, last.entry.frame)
            verdict, reason = EXPECTED[kind]
            truth = TruthEvent(acct.host.hostname, dup.seq, acct.did, "#commit", res.rev, False, reason, verdict,
                               kind, res.commit_cid.encode())
            self.ground_truth.append(truth)
            self._pending.append(_Pending(acct.host, dup, truth))
        elif kind == "replay":
            if len(acct.history) < 2:
                return
            earlier = dict(acct.history[-2])
            earlier["time"] = now_iso()
            verdict, reason = EXPECTED[kind]
            self._queue(acct.host, "#commit", earlier, acct.did, rev=earlier["rev"], verdict=verdict,
                        reason=reason, fault=kind, commit=earlier["commit"].encode())
        else:
            raise ValueError(f"fault {kind!r} cannot be injected on demand")

    # -- weather -----------------------------------------------------------------------------
    def slow_did(self, accounts: Sequence[SimAccount], delay: Delay | float) -> None:
        """The PLC directory answers these accounts' documents after ``delay`` (seconds or a
        distribution); ``plc.delay`` sets it for every DID."""
        dist = delay if isinstance(delay, Delay) else Delay.fixed(delay)
        for acct in accounts:
            self.plc.did_delays[acct.did] = dist

    def slow_handle(self, accounts: Sequence[SimAccount], delay: Delay | float | None = None, *,
                    fail: str | None = None) -> None:
        """These accounts' handle domains answer after ``delay``, and fail with ``fail`` (see
        ``sim.weather.HANDLE_FAILURES``); ``delay=None, fail=None`` clears the weather."""
        dist = delay if isinstance(delay, Delay) or delay is None else Delay.fixed(delay)
        for acct in accounts:
            if dist is None and fail is None:
                self.domains.weather.pop(acct.handle, None)
            else:
                self.domains.weather[acct.handle] = HandleWeather(dist, fail)

    def clear_weather(self) -> None:
        """Every identity service answers at once and correctly again (getRepo failures are the
        hosts': ``SimHost.heal_repos``)."""
        self.plc.delay = None
        self.plc.failure = None
        self.plc.did_delays.clear()
        self.plc.did_failures.clear()
        self.domains.weather.clear()

    async def rotate_keys(self, accounts: Sequence[SimAccount]) -> list[TruthEvent]:
        """A burst of key rotations, emitted at once: each account gets a new signing key (its
        PLC document changes now) and its host emits ``#identity``; later commits use the new
        key, commits emitted before stay valid (``accept``)."""
        start = len(self.ground_truth)
        for acct in accounts:
            self.inject("key_rotation", acct)
        self._flush_now()
        await asyncio.sleep(0)
        return self.ground_truth[start:]

    async def announce(self, accounts: Sequence[SimAccount]) -> list[TruthEvent]:
        """``#identity`` and ``#account active`` for each of ``accounts``, emitted at once (with
        ``announce_accounts=False``: the accounts' first sight at a chosen point of the stream)."""
        start = len(self.ground_truth)
        for acct in accounts:
            self._queue(acct.host, "#identity", {"did": acct.did, "time": now_iso(), "handle": acct.handle}, acct.did)
            self._queue(acct.host, "#account", {"did": acct.did, "time": now_iso(), "active": True}, acct.did)
        self._flush_now()
        await asyncio.sleep(0)
        return self.ground_truth[start:]

    async def commit(self, accounts: Sequence[SimAccount], per_account: int = 1) -> list[TruthEvent]:
        """``per_account`` valid commits from each of ``accounts`` (no faults), emitted at once."""
        assert self._mix is not None
        start = len(self.ground_truth)
        for _ in range(per_account):
            for acct in accounts:
                res = acct.repo.apply_writes(self._mix.next_writes(acct.repo.record_paths()))
                self._emit_commit(acct, res)
                self.commits_generated += 1
        self._flush_now()
        await asyncio.sleep(0)
        return self.ground_truth[start:]

    async def emit(self, kind: str, acct: SimAccount) -> list[TruthEvent]:
        """Inject one fault ``kind`` for ``acct`` and emit it now (e.g. ``unreadable`` at a
        chosen position of a backlog); returns the truth events added."""
        start = len(self.ground_truth)
        self.inject(kind, acct)
        self._flush_now()
        await asyncio.sleep(0)
        return self.ground_truth[start:]

    # -- ground truth helpers ----------------------------------------------------------------
    def expected_state(self) -> dict[str, tuple[str | None, str]]:
        """``did -> (rev, status)`` a correct relay should hold once it has caught up."""
        return {a.did: (a.repo.rev, a.status) for a in self.accounts}
