"""Host subscriptions: one run per followed host, from its durable cursor.

A run is a ``firehose.subscriber.HostSubscriber`` plus a window of the frames it has read and not
yet finished. Each frame is dispatched at once into its account's lane (``relay.ingest.lanes``); when the
lane has judged it, its event (if any) goes to the sequencer straight away. Frames of one account
are judged, sequenced and stored in upstream order; frames of different accounts finish in any
order, so one account waiting for slow work (a DID lookup, a handle check, a key refresh, a resync
hold) delays only itself — never another account of its host.

The host's cursor is a **watermark**: the highest upstream seq such that it and every frame read
before it are done (stored, or judged to produce nothing). Each event carries the watermark of its
moment as the host cursor of its write, and a host whose frames make no events stores it now and
then (``SKIP_PERSIST_EVERY``, and whenever the window empties). A restart reads again from the
watermark: frames done above it are skipped when the same process re-reads them (``done_above``),
and after a crash the lanes drop what was already stored (a commit or ``#sync`` whose rev is not
newer than the stored one).

Every subscriber instance carries a ``Fence`` (``firehose.state``) that all its events share. When
the sequencer could not store one of them, it revokes the fence, so none of the later ones is
stored either; the run then restarts a subscriber from its watermark, with a new fence, and
re-reads everything that was not done. Nothing is lost and nothing is judged against a state the
store does not hold.

Memory: a run's outstanding frames are bounded in count and bytes per host, and in bytes across
all hosts; a run at its bound stops reading its socket until its own frames finish
(backpressure, never reading and discarding): the frame it waits to admit is all it holds
outside the budgets (``Upstreams.waiting_bytes``), as its connection reads no message ahead. While the store is unavailable nothing finishes,
the windows fill, and every subscriber stops reading.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from backfill.errors import BackfillError
from backfill.sequencer import Sequencer
from backfill.store import Store
from backfill.types import HostState
from firehose.backoff import Backoff
from firehose.reasons import Reason
from firehose.state import Fence, PendingEvent, SequencedEvent
from firehose.subscriber import HostSubscriber, SubscriberConfig, UpstreamFrame
from mst.syntax import is_valid_did
from relay.config import RelayConfig
from relay.hosts import HostBoard, HostPolicy, host_base_url
from relay.ingest.admission import Admission
from relay.ingest.budget import ByteBudget
from relay.ingest.lanes import FRAME_HOST, AccountLanes, Count, Work
from relay.jsonlog import fields
from relay.metrics import RelayMetrics
from relay.ssrf import AddressGuard, split_host_port

log = logging.getLogger("relay.ingest.hostruns")

UNTRUSTED_RATE_LIMITS = [(500.0, 1.0), (500_000.0, 3600.0), (5_000_000.0, 86400.0)]
KINDS = ("#commit", "#sync", "#identity", "#account")
#: Frames that produce no event persist the cursor only every this many upstream seqs.
SKIP_PERSIST_EVERY = 100


def host_time(stamp: str | None) -> float | None:
    """A frame's ``time`` (RFC 3339) as epoch seconds, or None when absent or unreadable."""
    if not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def frame_cost(uf: UpstreamFrame) -> int:
    """The memory an upstream frame holds until it is done, as the in-flight budgets count it: its
    bytes twice (the raw frame, and its decoded body or the event encoded from it) plus 2 KiB, an
    allowance for the objects around it (work item, futures, event, account state)."""
    return 2 * len(uf.raw) + 2048


def did_of(kind: str, body: dict[str, object]) -> str | None:
    """The account a frame is about (``repo`` of a ``#commit``, else ``did``), if a valid DID."""
    did = body.get("repo") if kind == "#commit" else body.get("did")
    return did if isinstance(did, str) and is_valid_did(did) else None


@dataclasses.dataclass(slots=True, eq=False)
class _Slot:
    """One frame of a host run's window: its upstream seq, host ``time``, size and whether it is done
    (judged to produce nothing, or its event stored)."""

    seq: int
    stamp: object
    nbytes: int
    done: bool = False


@dataclasses.dataclass(slots=True, eq=False)
class _HostRun:
    hostname: str
    subscriber: HostSubscriber
    fence: Fence
    task: asyncio.Task[None] | None = None
    last_frame: float = 0.0
    restart: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    stopping: asyncio.Task[None] | None = None  # the subscriber's stop, when a restart asked for it
    restarts: int = 0
    #: frames received and not yet finished (judged and, if they became an event, stored or lost)
    outstanding: int = 0
    #: bytes of those frames
    outstanding_bytes: int = 0
    #: set whenever a frame finishes (the reader waits on it for room in the window)
    room: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    #: set while nothing is outstanding
    idle: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    #: the current subscriber's frames in upstream order, from the first one not done
    window: deque[_Slot] = dataclasses.field(default_factory=deque)
    #: upstream seqs above the watermark that are done: skipped when read again after a restart
    done_above: set[int] = dataclasses.field(default_factory=set)
    #: the highest upstream seq such that it and every frame before it are done (None: none yet)
    watermark: int | None = None
    #: the highest watermark known to be stored as the host's cursor
    persisted: int = 0
    persisting: asyncio.Task[None] | None = None
    #: host ``time`` of the latest frame such that it and every frame before it are done
    done_time: str | None = None
    followed_since: float = 0.0  # when the relay began following the host (HostState.created_at)
    lenient: bool = False  # judge sync 1.0 commits leniently (the host's setting, else the relay's)
    relay: bool = False  # the host is another relay (see relay.ingest.admission)
    last_read: int | None = None  # upstream seq of the last frame read

    def __post_init__(self) -> None:
        self.idle.set()

    def advance(self) -> bool:
        """Move the watermark over the done prefix of the window; True when it moved."""
        window = self.window
        moved = False
        while window and window[0].done:
            slot = window.popleft()
            self.done_above.discard(slot.seq)
            self.watermark = slot.seq
            if isinstance(slot.stamp, str):
                self.done_time = slot.stamp
            moved = True
        return moved

    def forget_stream(self) -> None:
        """The host's stream restarted (reset): nothing of the old one is pending or done."""
        self.window.clear()
        self.done_above.clear()
        self.watermark = None
        self.persisted = 0


class Upstreams:
    """The host runs (see the module docstring)."""

    def __init__(self, *, store: Store, sequencer: Sequencer, lanes: AccountLanes, admission: Admission,
                 policy: HostPolicy, guard: AddressGuard, metrics: RelayMetrics, config: RelayConfig, count: Count,
                 max_in_flight_per_host: int = 512, max_in_flight_bytes_per_host: int = 16 * 1024 * 1024,
                 max_in_flight_bytes: int = 128 * 1024 * 1024, backoff_base: float = 1.0,
                 board: HostBoard) -> None:
        """``admission`` is told whenever a host starts or stops (its cached host settings).
        Frames read and not yet finished are bounded per host (``max_in_flight_per_host`` frames,
        ``max_in_flight_bytes_per_host`` bytes) and across all hosts (``max_in_flight_bytes``,
        granted in arrival order: ``relay.ingest.budget``): a run over its own bounds stops
        reading its socket until its own frames finish (a run with nothing outstanding may always
        take one frame, however large); a run that does not fit the shared budget waits its turn.
        While a run's frame waits for either, the run's connection is not read (the frame in hand,
        counted in :attr:`waiting_bytes`, is all the run holds outside the budgets, with at most
        the rest of one socket read).
        ``board``: the host rows' statuses in memory (``relay.hosts.HostBoard``), shared with the
        host manager; host statuses change through it."""
        self.store = store
        self.board = board
        self.sequencer = sequencer
        self.lanes = lanes
        self.admission = admission
        self.policy = policy
        self.guard = guard
        self.metrics = metrics
        self.config = config
        self.count = count
        self.max_in_flight_per_host = max_in_flight_per_host
        self.max_in_flight_bytes_per_host = max_in_flight_bytes_per_host
        #: bytes of every run's outstanding frames, taken in arrival order across hosts
        self.budget = ByteBudget(max_in_flight_bytes)
        #: bytes (as ``frame_cost`` counts them) of frames read and waiting for admission to the
        #: budgets: at most one per host, whose reads are held meanwhile (``HostSubscriber.hold_reads``)
        self.waiting_bytes = 0
        #: first reconnect delay (seconds); doubles per failure up to 30 s
        self.backoff_base = backoff_base
        self._runs: dict[str, _HostRun] = {}
        self._closed = False

    # -- runs ----------------------------------------------------------------------------------
    def subscriber_config(self, host: HostState) -> SubscriberConfig:
        """Rate limits (backpressure, never drops): none for trusted hosts, nor for loopback hosts
        in insecure (local testing) mode; else the host's own limits or the untrusted defaults."""
        name, _ = split_host_port(host.hostname)
        local = self.config.allow_insecure_hosts and (name in ("localhost", "::1") or name.startswith("127."))
        if self.policy.is_trusted(host) or local:
            limits: list[tuple[float, float]] = []
        else:
            limits = list(UNTRUSTED_RATE_LIMITS)
            for i, (value, window) in enumerate(((host.rate_limit_per_second, 1.0),
                                                 (host.rate_limit_per_hour, 3600.0),
                                                 (host.rate_limit_per_day, 86400.0))):
                if value:
                    limits[i] = (float(value), window)
        return SubscriberConfig(rate_limits=limits, backoff_base=self.backoff_base, backoff_max=30.0)

    def _subscriber(self, hostname: str, url: str, cursor: int | None,
                    config: SubscriberConfig) -> tuple[HostSubscriber, Fence]:
        """A subscriber and the fence all its events share."""
        fence = Fence()
        subscriber = HostSubscriber(url, self._on_frame(hostname, fence), cursor=cursor, config=config,
                                    on_count=lambda reason: self.count("host", reason),
                                    on_cursor_reset=self._on_reset(hostname), resolve=self.guard.connect_address)
        return subscriber, fence

    async def start_host(self, host: HostState) -> None:
        """Start following ``host`` from its durable cursor (no-op when already running)."""
        self.admission.host_changed()
        if self._closed or host.status == "banned":
            return
        run = self._runs.get(host.hostname)
        if run is not None and run.task is not None and not run.task.done():
            return
        cursor = await self.store.host_cursor(host.hostname)
        done_above = set(await self.store.upstream_done_above(host.hostname, cursor or 0))
        url = host_base_url(host.hostname, insecure=self.config.allow_insecure_hosts, websocket=True)
        # A new host is read from the start of its backfill window (cursor 0), so nothing it
        # emitted before it was added is missed; later runs resume from the durable cursor.
        subscriber, fence = self._subscriber(host.hostname, url, cursor or 0, self.subscriber_config(host))
        run = _HostRun(host.hostname, subscriber, fence,
                       lenient=self.config.lenient_sync_validation if host.lenient is None else host.lenient,
                       relay=host.relay, persisted=cursor or 0, done_above=done_above,
                       followed_since=host.created_at)
        self._runs[host.hostname] = run
        run.task = asyncio.create_task(self._run_host(run), name=f"host:{host.hostname}")
        self.board.stored(host)
        if host.status not in ("active", "throttled"):
            await self.board.set_status(host.hostname, "active")
        log.info("subscribing", extra=fields(host=host.hostname, cursor=cursor, relay=run.relay,
                                             lenient=run.lenient))

    async def _run_host(self, run: _HostRun) -> None:
        """Run the host's subscriber; when it must be restarted (a frame was not stored, or it
        failed unexpectedly) start a new one, with a new fence, from the acknowledged cursor."""
        FRAME_HOST.set(run.hostname)  # this task's own context: its counts are the host's
        backoff = Backoff(1.0, 30.0)
        while not self._closed and self._runs.get(run.hostname) is run:
            subscriber = run.subscriber
            try:
                await subscriber.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.count("host", Reason.SUBSCRIBER_ERROR)
                log.exception("subscriber failed; restarting from the durable cursor", extra=fields(host=run.hostname))
            else:
                if not run.restart.is_set():
                    return  # stopped
            if run.fence.reason == "store_unavailable" or self.sequencer.state == "retrying":
                await self._store_back()  # resume as soon as the store answers, not after a backoff
            else:
                await asyncio.sleep(backoff.next())
            if self._closed or self._runs.get(run.hostname) is not run:
                return
            run.restart.clear()
            run.restarts += 1
            # The old subscriber's frames that are not done will be read again (from the watermark,
            # which is the acknowledged cursor); those above it that are done are skipped then.
            run.window.clear()
            run.subscriber, run.fence = self._subscriber(run.hostname, subscriber.host, subscriber.cursor,
                                                         subscriber.config)
            log.info("subscription restarted", extra=fields(host=run.hostname, cursor=subscriber.cursor))

    async def _store_back(self, poll: float = 0.25) -> None:
        """Wait until the store answers a read and the sequencer is writing again."""
        while not self._closed:
            try:
                await asyncio.wait_for(self.store.latest_seq(), 2.0)
                if self.sequencer.state != "retrying":
                    return
            except Exception:  # still down (or failing otherwise): keep polling, never give up
                pass
            await asyncio.sleep(poll)

    def _restart(self, run: _HostRun, fence: Fence) -> None:
        """A frame of the subscriber holding ``fence`` was not stored: re-read from the acked cursor."""
        if run.fence is not fence or run.restart.is_set() or self._closed:
            return
        run.restart.set()
        log.warning("a frame was not stored; re-reading from the acknowledged cursor",
                    extra=fields(host=run.hostname, reason=fence.reason, cursor=run.subscriber.cursor))
        run.stopping = asyncio.get_running_loop().create_task(run.subscriber.stop())

    async def stop_host(self, hostname: str) -> None:
        self.admission.host_changed()
        run = self._runs.pop(hostname, None)
        if run is None:
            return
        run.fence.revoke("host_stopped")
        try:  # a polite close; a host that does not answer the close handshake is cut off
            await asyncio.wait_for(run.subscriber.stop(), 1.0)
        except (TimeoutError, Exception):
            pass
        tasks = [t for t in (run.task, run.persisting) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)

    async def start_all(self) -> None:
        """Resume every non-banned host from its persisted cursor."""
        after: str | None = None
        while True:
            page = await self.store.list_hosts(after=after, limit=500)
            for host in page:
                if host.status != "banned":
                    await self.start_host(host)
            if len(page) < 500:
                return
            after = page[-1].hostname

    async def close(self) -> None:
        self._closed = True
        await asyncio.gather(*(self.stop_host(h) for h in list(self._runs)), return_exceptions=True)

    async def watch_hosts(self, *, idle_after: float = 1800.0, offline_after: int = 5) -> None:
        """Derive idle/offline/active host statuses from the subscribers (call periodically).
        Compares with the board (``HostBoard``): the store is written only for a host whose status
        changes, never read."""
        now = time.monotonic()
        await self.board.ensure_loaded()
        for hostname, run in list(self._runs.items()):
            current = self.board.status(hostname)
            if current is None or current in ("banned", "throttled"):
                continue
            sub = run.subscriber
            if sub.connected.is_set():
                status = "idle" if run.last_frame and now - run.last_frame > idle_after else "active"
            elif sub.counters.get("connection_failed", 0) >= offline_after:
                status = "offline"
            else:
                continue
            if status != current:
                await self.board.set_status(hostname, status)
                log.info("host status", extra=fields(host=hostname, status=status))

    def connected(self, hostname: str) -> bool:
        """Is the relay connected to ``hostname``'s stream right now?"""
        run = self._runs.get(hostname)
        return run is not None and run.subscriber.connected.is_set()

    def connections(self, hostname: str) -> int:
        """How many times the relay has connected to ``hostname``'s stream (its current run)."""
        run = self._runs.get(hostname)
        return 0 if run is None else run.subscriber.connections

    def caught_up(self, hostname: str | None, observed_at: float, settle: float) -> bool:
        """Has the relay read and finished everything ``hostname`` sent before ``observed_at``
        (wall-clock seconds)? True when the relay does not follow the host; else when a finished
        frame is stamped at least ``settle`` seconds after ``observed_at`` (the margin absorbs the
        host's clock skew), or when the run is connected, has nothing outstanding and has received
        nothing for ``settle`` seconds, with ``observed_at`` at least ``settle`` seconds ago (an
        idle host: what it sent before is all here). A disconnected host is never caught up."""
        run = self._runs.get(hostname) if hostname else None
        if run is None:
            return True
        done = host_time(run.done_time)
        if done is not None and done >= observed_at + settle:
            return True
        sub = run.subscriber
        if not sub.connected.is_set() or run.outstanding or run.window:
            return False
        quiet = time.monotonic() - max(run.last_frame, sub.connected_at)
        return quiet >= settle and time.time() - settle >= observed_at

    # -- frames in -----------------------------------------------------------------------------
    def _on_frame(self, hostname: str, fence: Fence) -> Callable[[UpstreamFrame], Awaitable[None] | None]:
        def on_frame(uf: UpstreamFrame) -> Awaitable[None] | None:
            """Take the frame at once when its host is under its share and the shared budget has
            room with nobody in line (the common case: no coroutine, returns None); else return
            the coroutine that waits for room (``_on_frame_waiting``)."""
            run = self._runs.get(hostname)
            if run is None or run.fence is not fence:  # a replaced subscriber: its frames are read again
                return None
            run.last_frame = time.monotonic()
            run.last_read = uf.seq
            if uf.seq in run.done_above:  # read again after a restart, and done before it
                self.count("ignore", Reason.DUPLICATE_EVENT)
                run.window.append(_Slot(uf.seq, uf.frame.body.get("time"), 0, done=True))
                self._advanced(run)
                return None
            size = frame_cost(uf)
            if (run.outstanding and self._full(run, size)) or not self.budget.take_now(size):
                return self._on_frame_waiting(run, uf, size, fence)
            self._take(run, uf, size, fence)
            return None

        return on_frame

    async def _on_frame_waiting(self, run: _HostRun, uf: UpstreamFrame, size: int, fence: Fence) -> None:
        """``on_frame`` of a frame that must wait: for its own host's frames to finish
        (backpressure: over its own share, a host waits for itself), then in line with the other
        hosts for the shared budget. Meanwhile the frame is the one frame of this host outside the
        budgets (counted in :attr:`waiting_bytes`), and nothing more is read from the host (its
        connection's reads are held; it keeps no whole message ahead)."""
        hostname = run.hostname
        sub = run.subscriber
        sub.hold_reads()
        self.waiting_bytes += size
        try:
            while run.outstanding and self._full(run, size):
                run.room.clear()
                await run.room.wait()
                if self._runs.get(hostname) is not run or run.fence is not fence:
                    return
            await self.budget.take(size)
        finally:
            self.waiting_bytes -= size
            sub.release_reads()
        if self._runs.get(hostname) is not run or run.fence is not fence:
            self.budget.give(size)
            return
        self._take(run, uf, size, fence)

    def _take(self, run: _HostRun, uf: UpstreamFrame, size: int, fence: Fence) -> None:
        """The frame holds its ``size`` of the budget: it takes its slot and goes to its lane."""
        slot = _Slot(uf.seq, uf.frame.body.get("time"), size)
        run.window.append(slot)
        run.outstanding += 1
        run.outstanding_bytes += size
        run.idle.clear()
        work = self.dispatch(run.hostname, uf, fence)
        work.judged.add_done_callback(lambda judged: self._judged(run, work, slot, judged))

    def _full(self, run: _HostRun, size: int) -> bool:
        return (run.outstanding >= self.max_in_flight_per_host
                or run.outstanding_bytes + size > self.max_in_flight_bytes_per_host)

    def _on_reset(self, hostname: str) -> Callable[[int | None, str], Awaitable[None]]:
        async def on_reset(old: int | None, reason: str) -> None:
            """The host's stream went backwards or it answered ``FutureCursor`` (wiped or restored):
            once every frame already read from the old stream is settled (stored or not — so no
            late write or ack moves the cursor past the reset), its durable cursor restarts at 0.
            Its accounts keep their stored state: a restored repository's next commit does not
            chain to it and is resynchronised."""
            await self.settle_read(hostname)  # (the subscriber counted it: on_count)
            self.metrics.host_series.count_reset(hostname, reason)
            await self.store.set_host_cursor(hostname, 0)
            run = self._runs.get(hostname)
            if run is not None:
                run.forget_stream()
            log.warning("upstream cursor reset: the host's stream restarted (wiped or restored?); "
                        "reading it again from the start", extra=fields(host=hostname, old_cursor=old, reason=reason))

        return on_reset

    def last_read(self, hostname: str) -> int | None:
        """The upstream seq of the last frame read from ``hostname`` (None: none yet, or not followed)."""
        run = self._runs.get(hostname)
        return None if run is None else run.last_read

    def connection(self, hostname: str) -> dict[str, Any] | None:
        """``hostname``'s upstream connection for the operator console (None: not followed):
        ``connected``, ``lastError`` (``{at, message}`` or None), ``lastRead`` (upstream seq),
        ``watermark``, ``outstanding`` frames, ``restarts``, and the subscriber's counted reasons."""
        run = self._runs.get(hostname)
        if run is None:
            return None
        sub = run.subscriber
        error = sub.last_error
        return {"connected": sub.connected.is_set(), "lastRead": run.last_read, "watermark": run.watermark,
                "outstanding": run.outstanding, "restarts": run.restarts, "counters": dict(sub.counters),
                "lastError": None if error is None else {"at": error[0], "message": error[1]}}

    def watermark(self, hostname: str) -> int | None:
        """``hostname``'s watermark: the highest upstream seq such that it and every frame read
        before it are done (None: none yet, or not followed)."""
        run = self._runs.get(hostname)
        return None if run is None else run.watermark

    async def settle_read(self, hostname: str) -> None:
        """Wait until every frame read from ``hostname`` so far is finished (judged and, if it
        made an event, that event stored or lost) and no cursor write of the run is in flight:
        then nothing read so far is still on its way (stored, ignored or re-read)."""
        run = self._runs.get(hostname)
        if run is None:
            return
        await run.idle.wait()
        while run.persisting is not None and not run.persisting.done():
            await asyncio.wait([run.persisting])

    def dispatch(self, hostname: str, uf: UpstreamFrame, fence: Fence) -> Work:
        """Start judging one upstream frame in its account's lane; never raises for bad input
        (a frame with no valid DID or of an unknown type is counted and produces no event)."""
        kind = uf.frame.t or ""
        self.metrics.host_series.count_in(hostname, kind)
        did = did_of(kind, uf.frame.body)
        judged: asyncio.Future[PendingEvent | None] = asyncio.get_running_loop().create_future()
        run = self._runs.get(hostname)
        work = Work(hostname, uf, kind, did or "", time.monotonic(), fence, judged,
                    lenient=run is not None and run.lenient, relay=run is not None and run.relay,
                    followed_since=run.followed_since if run is not None else 0.0)
        if did is None:
            self.count("reject", Reason.BAD_DID)
            judged.set_result(None)
        elif kind not in KINDS:
            self.count("ignore", Reason.UNKNOWN_TYPE)
            judged.set_result(None)
        else:
            self.lanes.submit(work)
        return work

    # -- events out ----------------------------------------------------------------------------
    # Each frame finishes on its own: an account's lane judges its frames in order and resolves
    # each one's ``judged`` in that order, and this done-callback hands the event to the sequencer
    # at once (synchronously, so an account's events reach the sequencer in the lane's order). No
    # frame waits for a frame of another account: only the watermark does.

    def _judged(self, run: _HostRun, work: Work, slot: _Slot, judged: asyncio.Future[PendingEvent | None]) -> None:
        if judged.cancelled():  # its lane was cancelled (shutdown): not judged, so not done
            self._finished(run, work, slot, ok=False)
            return
        event = judged.result()
        if event is None:
            self._finished(run, work, slot, ok=True)
            return
        if not work.fence.valid:  # its subscriber is being replaced: it will be read again
            self.lanes.dropped(event)
            self._finished(run, work, slot, ok=False)
            return
        event.host = run.hostname
        # The cursor stored with the event: every frame up to it is done once the event is stored.
        # That is the watermark, or this frame itself when it heads the window (every frame before
        # it is done, and it is done exactly when its event is durable): a host whose frames come
        # one at a time (most of a thousand hosts) then needs no cursor write of its own per frame.
        if run.fence is not work.fence:
            event.upstream_seq = None
        elif run.window and run.window[0] is slot:
            event.upstream_seq = slot.seq
        else:
            event.upstream_seq = run.watermark
        event.frame_seq = work.uf.seq
        event.fence = work.fence
        try:
            future = self.sequencer.enqueue_nowait(event)
        except BackfillError as exc:
            log.info("frame not sequenced", extra=fields(host=run.hostname, reason=exc.reason))
            work.fence.revoke(exc.reason)
            self.lanes.dropped(event)
            self._finished(run, work, slot, ok=False)
            return
        future.add_done_callback(lambda f: self._settled(run, work, slot, event, f))

    def _settled(self, run: _HostRun, work: Work, slot: _Slot, event: PendingEvent,
                 future: asyncio.Future[SequencedEvent | None]) -> None:
        """Done-callback of a sequencer future: the lane learns the outcome; the frame is done once
        its event is durable; a lost one restarts the run."""
        self.lanes.settled(event, future)
        if future.cancelled() or future.exception() is not None:
            if not future.cancelled():
                log.warning("sequencing failed", extra=fields(host=run.hostname, did=event.did,
                                                              error=str(future.exception())[:300]))
            self._finished(run, work, slot, ok=False)
            return
        if event.upstream_seq is not None and run.fence is work.fence:
            run.persisted = max(run.persisted, event.upstream_seq)
        self._finished(run, work, slot, ok=True)
        result = future.result()
        if result is None:
            return
        self.metrics.current_seq.set(result.seq)  # (relay_events_sequenced_total: RelayService.sequencer_publish)
        self.metrics.lag.observe(time.monotonic() - work.received)

    def _finished(self, run: _HostRun, work: Work, slot: _Slot, *, ok: bool) -> None:
        """``slot``'s frame is finished: done (``ok``), or lost (its run re-reads it)."""
        run.outstanding -= 1
        run.outstanding_bytes -= slot.nbytes
        self.budget.give(slot.nbytes)
        run.room.set()
        if not run.outstanding:
            run.idle.set()
        if not ok:
            self._restart(run, work.fence)
            return
        if run.fence is not work.fence:  # a replaced subscriber's frame: the new one re-reads it
            return
        slot.done = True
        if run.window and run.window[0] is not slot:
            run.done_above.add(slot.seq)
        self._advanced(run)

    def _advanced(self, run: _HostRun) -> None:
        """After a frame is done: move the watermark, acknowledge it as the reconnect cursor, and
        store it as the host cursor now and then (events carry it too, so a busy host stores it
        with its events; frames that make none, or a host gone quiet, need this)."""
        if not run.advance() or run.watermark is None:
            return
        run.subscriber.ack(run.watermark)
        self._persist_later(run)

    def _persist_later(self, run: _HostRun) -> None:
        mark = run.watermark
        if mark is None or mark <= run.persisted or (run.persisting is not None and not run.persisting.done()):
            return
        if run.window and mark - run.persisted < SKIP_PERSIST_EVERY:
            return
        run.persisting = asyncio.get_running_loop().create_task(self._persist(run, mark, run.fence),
                                                                name=f"cursor:{run.hostname}")

    async def _persist(self, run: _HostRun, mark: int, fence: Fence) -> None:
        try:
            await self.sequencer.advance_cursor(run.hostname, mark, fence=fence)
        except BackfillError as exc:  # e.g. fenced off: the run is being restarted
            log.info("cursor not persisted", extra=fields(host=run.hostname, reason=exc.reason))
            return
        if run.fence is fence:
            run.persisted = max(run.persisted, mark)
            run.persisting = None
            self._persist_later(run)
