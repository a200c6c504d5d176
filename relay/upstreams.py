"""Host subscriptions: one run per followed host, from its durable cursor, in upstream order.

A run is a ``firehose.subscriber.HostSubscriber`` plus an ordered queue. Each frame it reads is
dispatched at once into its account's lane (``relay.lanes``) and queued here; the run's drainer
takes the frames strictly in upstream order, waits for each one's judgement and hands the accepted
events to the sequencer (so a host's events are stored in the order the host sent them, and the
stored host cursor never passes a frame that is not yet stored). The upstream cursor advances only
when the sequencer has made a frame's effects durable.

Every subscriber instance carries a ``Fence`` (``firehose.state``) that all its events share. When
the sequencer could not store one of them, it revokes the fence, so none of the later ones is
stored either; the run then restarts a subscriber from its last acknowledged cursor, with a new
fence, and re-reads everything that was not stored (re-deliveries of what was stored are ignored
by the lanes). Nothing is lost and nothing is judged against a state the store does not hold.

While the store is unavailable the sequencer holds its batches and stops taking new ones once its
queue is full; then the drainer waits, the run's queue fills, and the subscriber stops reading its
socket: backpressure, never reading and discarding.
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
from relay.admission import Admission
from relay.config import RelayConfig
from relay.hosts import HostPolicy, host_base_url
from relay.jsonlog import fields
from relay.lanes import AccountLanes, Count, Work
from relay.metrics import RelayMetrics
from relay.ssrf import AddressGuard, split_host_port

log = logging.getLogger("relay.upstreams")

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


def did_of(kind: str, body: dict[str, object]) -> str | None:
    """The account a frame is about (``repo`` of a ``#commit``, else ``did``), if a valid DID."""
    did = body.get("repo") if kind == "#commit" else body.get("did")
    return did if isinstance(did, str) and is_valid_did(did) else None


@dataclasses.dataclass(slots=True, eq=False)
class _HostRun:
    hostname: str
    subscriber: HostSubscriber
    fence: Fence
    queue: asyncio.Queue[Work]
    task: asyncio.Task[None] | None = None
    drainer: asyncio.Task[None] | None = None
    last_frame: float = 0.0
    restart: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    stopping: asyncio.Task[None] | None = None  # the subscriber's stop, when a restart asked for it
    restarts: int = 0
    #: frames received and not yet done (judged and, if they became an event, stored or dropped)
    outstanding: int = 0
    #: one ``[host time, done]`` per frame of the current subscriber, in upstream order, until done
    marks: deque[list[Any]] = dataclasses.field(default_factory=deque)
    #: host ``time`` of the latest frame such that it and every frame before it are done
    done_time: str | None = None
    lenient: bool = False  # judge sync 1.0 commits leniently (the host's setting, else the relay's)
    relay: bool = False  # the host is another relay (see relay.admission)
    #: the sequencer future of the last event submitted (futures resolve in submission order)
    last_submitted: asyncio.Future[SequencedEvent | None] | None = None
    last_read: int | None = None  # upstream seq of the last frame read

    def mark(self, work: Work) -> list[Any]:
        entry = [work.uf.frame.body.get("time"), False]
        self.marks.append(entry)
        return entry

    def finish(self, entry: list[Any]) -> None:
        """``entry``'s frame is done: advance ``done_time`` over the done prefix."""
        entry[1] = True
        marks = self.marks
        while marks and marks[0][1]:
            stamp = marks.popleft()[0]
            if isinstance(stamp, str):
                self.done_time = stamp


class Upstreams:
    """The host runs (see the module docstring)."""

    def __init__(self, *, store: Store, sequencer: Sequencer, lanes: AccountLanes, admission: Admission,
                 policy: HostPolicy, guard: AddressGuard, metrics: RelayMetrics, config: RelayConfig, count: Count,
                 max_in_flight_per_host: int = 512, backoff_base: float = 1.0) -> None:
        """``admission`` is told whenever a host starts or stops (its cached host settings)."""
        self.store = store
        self.sequencer = sequencer
        self.lanes = lanes
        self.admission = admission
        self.policy = policy
        self.guard = guard
        self.metrics = metrics
        self.config = config
        self.count = count
        self.max_in_flight_per_host = max_in_flight_per_host
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
        url = host_base_url(host.hostname, insecure=self.config.allow_insecure_hosts, websocket=True)
        # A new host is read from the start of its backfill window (cursor 0), so nothing it
        # emitted before it was added is missed; later runs resume from the durable cursor.
        subscriber, fence = self._subscriber(host.hostname, url, cursor or 0, self.subscriber_config(host))
        run = _HostRun(host.hostname, subscriber, fence, asyncio.Queue(self.max_in_flight_per_host),
                       lenient=self.config.lenient_sync_validation if host.lenient is None else host.lenient,
                       relay=host.relay)
        self._runs[host.hostname] = run
        run.drainer = asyncio.create_task(self._drain(run), name=f"drain:{host.hostname}")
        run.task = asyncio.create_task(self._run_host(run), name=f"host:{host.hostname}")
        if host.status not in ("active", "throttled"):
            await self.store.set_host_status(host.hostname, "active")
        log.info("subscribing", extra=fields(host=host.hostname, cursor=cursor, relay=run.relay,
                                             lenient=run.lenient))

    async def _run_host(self, run: _HostRun) -> None:
        """Run the host's subscriber; when it must be restarted (a frame was not stored, or it
        failed unexpectedly) start a new one, with a new fence, from the acknowledged cursor."""
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
            run.marks.clear()  # the old subscriber's frames that are not done will be read again
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
        for task in (run.task, run.drainer):
            if task is not None:
                task.cancel()
        await asyncio.wait([t for t in (run.task, run.drainer) if t is not None], timeout=1.0)

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
        """Derive idle/offline/active host statuses from the subscribers (call periodically)."""
        now = time.monotonic()
        for hostname, run in list(self._runs.items()):
            host = await self.store.get_host(hostname)
            if host is None or host.status in ("banned", "throttled"):
                continue
            sub = run.subscriber
            if sub.connected.is_set():
                status = "idle" if run.last_frame and now - run.last_frame > idle_after else "active"
            elif sub.counters.get("connection_failed", 0) >= offline_after:
                status = "offline"
            else:
                continue
            if status != host.status:
                await self.store.set_host_status(hostname, status)
                log.info("host status", extra=fields(host=hostname, status=status))

    def connected(self, hostname: str) -> bool:
        """Is the relay connected to ``hostname``'s stream right now?"""
        run = self._runs.get(hostname)
        return run is not None and run.subscriber.connected.is_set()

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
        if not sub.connected.is_set() or run.outstanding or run.marks:
            return False
        quiet = time.monotonic() - max(run.last_frame, sub.connected_at)
        return quiet >= settle and time.time() - settle >= observed_at

    # -- frames in -----------------------------------------------------------------------------
    def _on_frame(self, hostname: str, fence: Fence) -> Callable[[UpstreamFrame], Awaitable[None]]:
        async def on_frame(uf: UpstreamFrame) -> None:
            run = self._runs.get(hostname)
            if run is None:
                return
            run.last_frame = time.monotonic()
            run.outstanding += 1
            run.last_read = uf.seq
            await run.queue.put(self.dispatch(hostname, uf, fence))

        return on_frame

    def _on_reset(self, hostname: str) -> Callable[[int | None, str], Awaitable[None]]:
        async def on_reset(old: int | None, reason: str) -> None:
            """The host's stream went backwards or it answered ``FutureCursor`` (wiped or restored),
            or it keeps replaying an unreadable frame: once every frame already read from the old
            stream is settled (stored or not — so no late write or ack moves the cursor past the
            reset), its durable cursor restarts at 0. Its accounts keep their stored state: a
            restored repository's next commit does not chain to it and is resynchronised."""
            await self.settle_read(hostname)
            self.count("host", reason)
            self.metrics.host_resets.labels(host=hostname, reason=reason).inc()
            await self.store.set_host_cursor(hostname, 0)
            if reason in (Reason.FUTURE_CURSOR, Reason.SEQ_WENT_BACKWARDS):
                log.warning("upstream cursor reset: the host's stream restarted (wiped or restored?); "
                            "reading it again from the start", extra=fields(host=hostname, old_cursor=old, reason=reason))
            else:
                log.warning("upstream cursor reset: the host keeps sending a frame that cannot be read; "
                            "following it live", extra=fields(host=hostname, old_cursor=old, reason=reason))

        return on_reset

    def last_read(self, hostname: str) -> int | None:
        """The upstream seq of the last frame read from ``hostname`` (None: none yet, or not followed)."""
        run = self._runs.get(hostname)
        return None if run is None else run.last_read

    async def settle_read(self, hostname: str) -> None:
        """Wait until every frame read from ``hostname`` so far is through the drainer and, if it
        made an event, that event's sequencer future is resolved (the sequencer resolves them in
        order): then nothing read so far is still on its way (stored, ignored or re-read)."""
        run = self._runs.get(hostname)
        if run is None:
            return
        await run.queue.join()
        last = run.last_submitted
        if last is not None and not last.done():
            await asyncio.wait([last])

    def dispatch(self, hostname: str, uf: UpstreamFrame, fence: Fence) -> Work:
        """Start judging one upstream frame in its account's lane; never raises for bad input
        (a frame with no valid DID or of an unknown type is counted and produces no event)."""
        kind = uf.frame.t or ""
        self.metrics.child(self.metrics.events_in, hostname, kind).inc()
        did = did_of(kind, uf.frame.body)
        judged: asyncio.Future[PendingEvent | None] = asyncio.get_running_loop().create_future()
        run = self._runs.get(hostname)
        work = Work(hostname, uf, kind, did or "", time.monotonic(), fence, judged,
                    lenient=run is not None and run.lenient, relay=run is not None and run.relay)
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
    async def _drain(self, run: _HostRun) -> None:
        queue = run.queue
        while True:
            work = await queue.get()
            submitted = False
            try:
                event = await work.judged
                if not work.fence.valid:  # its subscriber is being replaced: it will be re-read
                    if event is not None:
                        self.lanes.dropped(event)
                elif event is None:
                    entry = run.mark(work)
                    await self._skip(run, work)
                    run.finish(entry)
                else:
                    await self._submit(run, work, event, run.mark(work))
                    submitted = True
            except asyncio.CancelledError:
                if work.judged.cancelled() and not self._closed:
                    continue  # its lane was cancelled, not this drainer
                raise
            except BackfillError as exc:  # e.g. fenced off while persisting a skip cursor
                log.info("frame not persisted", extra=fields(host=run.hostname, reason=exc.reason))
            except Exception:
                log.exception("ingest drain failed", extra=fields(host=run.hostname))
            finally:
                if not submitted:
                    run.outstanding -= 1
                queue.task_done()

    async def _skip(self, run: _HostRun, work: Work) -> None:
        """A frame that produced no event: persist the cursor now and then (not every time)."""
        seq = work.uf.seq
        sub = run.subscriber
        acked = sub.cursor
        if acked is None or seq - acked >= SKIP_PERSIST_EVERY:
            await self.sequencer.advance_cursor(run.hostname, seq, fence=work.fence)
            if run.fence is work.fence:
                sub.ack(seq)

    async def _submit(self, run: _HostRun, work: Work, event: PendingEvent, entry: list[Any]) -> None:
        event.host = run.hostname
        event.upstream_seq = work.uf.seq
        event.fence = work.fence
        future = await self.sequencer.enqueue(event)
        run.last_submitted = future
        future.add_done_callback(lambda f: self._settled(run, work, event, entry, f))

    def _settled(self, run: _HostRun, work: Work, event: PendingEvent, entry: list[Any],
                 future: asyncio.Future[SequencedEvent | None]) -> None:
        """Done-callback of a sequencer future: the lane learns the outcome; the upstream cursor
        advances once the event is durable; a lost one restarts the run."""
        run.outstanding -= 1
        self.lanes.settled(event, future)
        if future.cancelled() or future.exception() is not None:
            if not future.cancelled():
                log.warning("sequencing failed", extra=fields(host=run.hostname, did=event.did,
                                                              error=str(future.exception())[:300]))
            self._restart(run, work.fence)
            return
        if run.fence is work.fence:
            run.subscriber.ack(work.uf.seq)
            run.finish(entry)
        result = future.result()
        if result is None:
            return
        self.metrics.current_seq.set(result.seq)  # (relay_events_sequenced_total: RelayService._publish)
        self.metrics.lag.observe(time.monotonic() - work.received)
