"""One simulated PDS host: its event log, its ``subscribeRepos`` stream and its sync XRPC endpoints.

The log holds fully encoded frames ``(seq, frame, action)``; ``action`` marks a connection fault
(``slow``/``stall``/``disconnect``) that fires only for subscribers receiving that frame live, so a
reconnecting client replaying it from its cursor is not disconnected again in a loop.

Cursor rules as the TypeScript PDS and Bluesky's relay apply them (the cursor is the last seq the
client processed): no cursor → live only; cursor above the current seq → ``FutureCursor`` error
frame and close; otherwise every frame with ``seq > cursor``; a cursor older than the window (the
frames after it were trimmed; never for 0) → ``#info OutdatedCursor`` first, then the whole window.
"""

from __future__ import annotations

import asyncio
import math
import time
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import cbrrr
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from sim.faults import check_kind
from sim.http import is_upgrade, json_response, response, split_request, xrpc_error

if TYPE_CHECKING:
    from sim.ident import SigningKey
    from sim.repo import SimRepo

SUBSCRIBE_PATH = "/xrpc/com.atproto.sync.subscribeRepos"
GET_REPO_PATH = "/xrpc/com.atproto.sync.getRepo"
#: how ``SimHost.fail_repos`` makes getRepo fail
REPO_FAILURES = ("500", "404", "timeout")


def encode_frame(t: str, body: dict[str, Any]) -> bytes:
    """Message frame: header ``{op: 1, t}`` then body (same bytes as ``firehose.frames``)."""
    return cbrrr.encode_dag_cbor({"op": 1, "t": t}) + cbrrr.encode_dag_cbor(body)


def encode_error_frame(error: str, message: str) -> bytes:
    """Error frame: header ``{op: -1}`` then ``{error, message}``."""
    return cbrrr.encode_dag_cbor({"op": -1}) + cbrrr.encode_dag_cbor({"error": error, "message": message})


@dataclass(slots=True)
class LogEntry:
    seq: int
    frame: bytes
    action: str | None = None
    sent_at: float = 0.0


@dataclass
class StreamLog:
    """Bounded in-memory backfill window; ``base`` is the absolute index of ``entries[0]``.

    At most ``limit`` frames and, when ``byte_limit`` is set, at most that many frame bytes are
    kept (either bound is overshot by a quarter before the oldest frames go, so trims are rare);
    ``size`` is the frame bytes held now."""

    limit: int = 500_000
    byte_limit: int | None = None
    entries: list[LogEntry] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    base: int = 0
    size: int = 0

    @property
    def end(self) -> int:
        return self.base + len(self.entries)

    def append(self, entry: LogEntry) -> None:
        self.entries.append(entry)
        self.seqs.append(entry.seq)
        self.size += len(entry.frame)
        cut = 0
        if len(self.entries) > self.limit + self.limit // 4:
            cut = len(self.entries) - self.limit
        byte_limit = self.byte_limit
        if byte_limit is not None and self.size > byte_limit + byte_limit // 4:
            size, by_bytes = self.size, 0
            for old in self.entries[:-1]:  # the newest frame stays, however large
                if size <= byte_limit:
                    break
                size -= len(old.frame)
                by_bytes += 1
            cut = max(cut, by_bytes)
        if cut:
            self.size -= sum(len(old.frame) for old in self.entries[:cut])
            del self.entries[:cut], self.seqs[:cut]
            self.base += cut

    def index_from(self, cursor: int) -> int:
        """Absolute index of the first entry with ``seq >= cursor``."""
        return self.base + bisect_left(self.seqs, cursor)

    def get(self, index: int) -> LogEntry:
        return self.entries[index - self.base]

    def clear(self) -> None:
        self.base = self.end
        self.entries.clear()
        self.seqs.clear()
        self.size = 0


@dataclass
class SimAccount:
    """A simulated account. ``host`` is the :class:`SimHost` currently serving it (kept here, beside
    ``SimHost``, because each refers to the other)."""

    did: str
    host: SimHost
    repo: SimRepo
    key: SigningKey
    status: str = "active"
    handle: str = ""
    history: list[dict[str, Any]] = field(default_factory=list, repr=False)


class SimHost:
    """A PDS-like server on 127.0.0.1: ``subscribeRepos`` plus the sync endpoints a relay uses."""

    def __init__(self, index: int, *, log_limit: int = 500_000, log_bytes: int | None = None,
                 slow_delay: float = 0.05, stall_seconds: float = 2.0) -> None:
        self.index = index
        self.url = ""
        self.hostname = ""
        self.accounts: dict[str, SimAccount] = {}
        self.log = StreamLog(limit=log_limit, byte_limit=log_bytes)
        self.seq = 0
        self.published_seq = 0
        self.faults: dict[str, float] = {}
        self.slow_delay = slow_delay
        self.stall_seconds = stall_seconds
        self.frames_sent = 0
        self.connections_total = 0
        self.connections_dropped = 0
        self._subscribers: set[ServerConnection] = set()
        self._server: Server | None = None
        #: XRPC requests served, by path; the query of every getRepo
        self.requests: Counter[str] = Counter()
        self.repo_requests: list[dict[str, str]] = []
        #: getRepo answers wait for this event while it is set (``hold_repos``/``release_repos``)
        self._repo_gate: asyncio.Event | None = None
        #: accounts whose getRepo answer is tampered with (a record block's last byte flipped)
        self.tampered_repos: set[str] = set()
        #: getRepo failure (``fail_repos``): mode, the accounts it hits (None: all), until when
        #: (monotonic) and how many more failed answers; ``repo_failures_served`` counts them
        self.repo_failure: str | None = None
        self.repo_failure_dids: set[str] | None = None
        self.repo_failure_until = math.inf
        self.repo_failures_left: int | None = None
        self.repo_failures_served = 0
        self.repo_hang_seconds = 60.0
        self._repo_healed: asyncio.Event | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = await serve(
            self._subscribe, host, port, process_request=self._http, compression=None,
            max_size=2**16, ping_interval=None, write_limit=2**20,
        )
        sock_port = self._server.sockets[0].getsockname()[1]
        self.hostname = f"{host}:{sock_port}"
        self.url = f"http://{self.hostname}"

    async def stop(self) -> None:
        server, self._server = self._server, None
        for ws in list(self._subscribers):
            ws.transport.abort()
        self._wake()
        if server is not None:
            server.close()
            await server.wait_closed()

    # -- faults ------------------------------------------------------------------------------
    def set_fault(self, kind: str, rate: float) -> None:
        """Switch a fault mode on (``rate`` > 0, a probability) or off (``rate`` = 0)."""
        check_kind(kind)
        if not 0.0 <= rate <= 1.0:
            raise ValueError("rate must be within [0, 1]")
        if rate == 0:
            self.faults.pop(kind, None)
        else:
            self.faults[kind] = rate

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def wipe(self) -> None:
        """Simulate a wiped host now: seq restarts at 1, log emptied, every subscriber dropped."""
        self.seq = 0
        self.drop_log()

    def drop_log(self) -> None:
        """Empty the published log and drop every subscriber (second half of a wipe)."""
        self.log.clear()
        self.published_seq = 0
        self.drop_connections()

    def drop_connections(self) -> int:
        """Abort every ``subscribeRepos`` connection now (TCP abort, possibly mid-frame), keeping
        the log: a subscriber that reconnects with its cursor gets every frame it missed. Returns
        how many connections were dropped (``connections_dropped`` counts them all)."""
        dropped = 0
        for ws in list(self._subscribers):
            ws.transport.abort()
            dropped += 1
        self.connections_dropped += dropped
        return dropped

    def hold_repos(self) -> None:
        """Hold every getRepo answer (the repository as it is when asked) until :meth:`release_repos`
        (a slow PDS under a resync storm)."""
        if self._repo_gate is None:
            self._repo_gate = asyncio.Event()

    def release_repos(self) -> None:
        gate, self._repo_gate = self._repo_gate, None
        if gate is not None:
            gate.set()

    def fail_repos(self, mode: str, *, dids: set[str] | None = None, seconds: float | None = None,
                   requests: int | None = None) -> None:
        """Answer getRepo with a failure (``mode`` in :data:`REPO_FAILURES`: ``500``, ``404``
        (RepoNotFound), ``timeout``: no answer until healed or ``repo_hang_seconds``, then 504)
        for ``dids`` (None: every account), for ``seconds`` and/or the next ``requests`` getRepo
        requests that hit it (None: until :meth:`heal_repos`); then getRepo works again."""
        if mode not in REPO_FAILURES:
            raise ValueError(f"unknown getRepo failure {mode!r}; known: {', '.join(REPO_FAILURES)}")
        self.repo_failure = mode
        self.repo_failure_dids = set(dids) if dids is not None else None
        self.repo_failure_until = time.monotonic() + seconds if seconds is not None else math.inf
        self.repo_failures_left = requests
        if self._repo_healed is None or self._repo_healed.is_set():
            self._repo_healed = asyncio.Event()

    def heal_repos(self) -> None:
        """getRepo works again now (a hanging request is answered with its failure at once)."""
        self.repo_failure = None
        if self._repo_healed is not None:
            self._repo_healed.set()

    def _repo_failing(self, did: str) -> str | None:
        """The failure this getRepo of ``did`` gets (counted), or None."""
        mode = self.repo_failure
        if mode is None or (self.repo_failure_dids is not None and did not in self.repo_failure_dids):
            return None
        if time.monotonic() >= self.repo_failure_until or self.repo_failures_left == 0:
            self.heal_repos()
            return None
        if self.repo_failures_left is not None:
            self.repo_failures_left -= 1
        self.repo_failures_served += 1
        return mode

    async def _failed_repo(self, mode: str) -> Response:
        if mode == "500":
            return xrpc_error(500, "InternalServerError", "simulated getRepo failure")
        if mode == "404":
            return xrpc_error(404, "RepoNotFound", "simulated getRepo failure")
        healed = self._repo_healed
        if healed is not None:
            try:
                await asyncio.wait_for(healed.wait(), self.repo_hang_seconds)
            except TimeoutError:
                pass
        return xrpc_error(504, "UpstreamTimeout", "simulated getRepo timeout")

    # -- emitting ----------------------------------------------------------------------------
    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def make_entry(self, t: str, body: dict[str, Any], action: str | None = None) -> LogEntry:
        """Assign the next seq and encode the frame (not yet visible to subscribers)."""
        seq = self.next_seq()
        body["seq"] = seq
        return LogEntry(seq, encode_frame(t, body), action)

    def publish(self, entries: list[LogEntry]) -> None:
        """Make entries visible to subscribers, stamping their send time."""
        now = time.time()
        for e in entries:
            e.sent_at = now
            self.log.append(e)
        if entries:
            self.published_seq = entries[-1].seq
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        self._waiter = None
        if w is not None and not w.done():
            w.set_result(None)

    def _wait(self) -> asyncio.Future[None]:
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    # -- subscribeRepos ----------------------------------------------------------------------
    async def _subscribe(self, ws: ServerConnection) -> None:
        assert ws.request is not None  # the handler runs after the opening handshake
        _, params = split_request(ws.request)
        self.connections_total += 1
        log = self.log
        try:
            cursor = int(params["cursor"]) if "cursor" in params else None
        except ValueError:
            await ws.send(encode_error_frame("InvalidRequest", "cursor must be an integer"))
            await ws.close()
            return
        if cursor is not None and cursor > self.published_seq:
            await ws.send(encode_error_frame("FutureCursor", "Cursor in the future."))
            await ws.close(1000)
            return
        if cursor is None:
            idx = log.end
        else:
            first = log.seqs[0] if log.seqs else self.published_seq + 1
            if cursor != 0 and cursor < first - 1:
                await ws.send(encode_frame("#info", {"name": "OutdatedCursor", "message": "cursor older than backfill window"}))
            idx = log.index_from(cursor + 1)
        live_from = log.end
        self._subscribers.add(ws)
        closed = asyncio.ensure_future(ws.wait_closed())
        try:
            while True:
                if self._server is None:
                    return
                if log is not self.log:
                    return
                if idx < log.base:
                    idx = log.base
                while idx < log.end:
                    entry = log.get(idx)
                    action = entry.action if idx >= live_from else None
                    if action == "slow":
                        await asyncio.sleep(self.slow_delay)
                    elif action == "stall":
                        await asyncio.sleep(self.stall_seconds)
                    await ws.send(entry.frame)
                    self.frames_sent += 1
                    idx += 1
                    if action == "disconnect":
                        ws.transport.abort()
                        return
                    if idx < log.base:
                        idx = log.base
                if closed.done():
                    return
                await asyncio.wait((self._wait(), closed), return_when=asyncio.FIRST_COMPLETED)
        except ConnectionClosed:
            return
        finally:
            closed.cancel()
            self._subscribers.discard(ws)

    # -- XRPC --------------------------------------------------------------------------------
    async def _http(self, connection: ServerConnection, request: Request) -> Response | None:
        path, params = split_request(request)
        if path == SUBSCRIBE_PATH and is_upgrade(request):
            return None
        self.requests[path] += 1
        if path == GET_REPO_PATH:
            self.repo_requests.append(dict(params))
            failing = self._repo_failing(params.get("did", ""))
            if failing is not None:
                return await self._failed_repo(failing)
            gate = self._repo_gate
            if gate is not None:  # answered with the repository as it was when asked
                response = self._answer(path, params)
                await gate.wait()
                return response
        return self._answer(path, params)

    def _answer(self, path: str, params: dict[str, str]) -> Response:
        try:
            return self._route(path, params)
        except Exception as exc:  # never let a handler bug kill the host
            return xrpc_error(500, "InternalServerError", type(exc).__name__)

    def _account(self, params: dict[str, str]) -> tuple[SimAccount | None, Response | None]:
        did = params.get("did")
        if not did:
            return None, xrpc_error(400, "InvalidRequest", "did is required")
        acct = self.accounts.get(did)
        if acct is None:
            return None, xrpc_error(400, "RepoNotFound", f"Could not find repo for DID: {did}")
        return acct, None

    def _route(self, path: str, params: dict[str, str]) -> Response:
        if path == "/xrpc/_health":
            return json_response({"version": "relay-sim"})
        if path == "/xrpc/com.atproto.server.describeServer":
            return json_response({
                "did": f"did:web:{self.hostname.split(':')[0]}",
                "availableUserDomains": [".sim.test"],
                "inviteCodeRequired": False,
            })
        if path == "/xrpc/com.atproto.sync.listRepos":
            limit = max(1, min(1000, int(params.get("limit", "500"))))
            after = params.get("cursor", "")
            dids = sorted(d for d in self.accounts if d > after)[:limit]
            repos = []
            for did in dids:
                a = self.accounts[did]
                assert a.repo.head is not None  # a hosted account has its genesis commit
                item: dict[str, Any] = {"did": did, "head": a.repo.head.encode(), "rev": a.repo.rev, "active": a.status == "active"}
                if a.status != "active":
                    item["status"] = a.status
                repos.append(item)
            out: dict[str, Any] = {"repos": repos}
            if len(dids) == limit:
                out["cursor"] = dids[-1]
            return json_response(out)
        if path == "/xrpc/com.atproto.sync.getRepoStatus":
            acct, err = self._account(params)
            if err is not None:
                return err
            assert acct is not None
            status: dict[str, Any] = {"did": acct.did, "active": acct.status == "active", "rev": acct.repo.rev}
            if acct.status != "active":
                status["status"] = acct.status
            return json_response(status)
        if path == "/xrpc/com.atproto.sync.getLatestCommit":
            acct, err = self._account(params)
            if err is not None:
                return err
            assert acct is not None
            if acct.status != "active":
                return xrpc_error(400, _status_error(acct.status), f"Repo is {acct.status}")
            assert acct.repo.head is not None  # a hosted account has its genesis commit
            return json_response({"cid": acct.repo.head.encode(), "rev": acct.repo.rev})
        if path == GET_REPO_PATH:
            acct, err = self._account(params)
            if err is not None:
                return err
            assert acct is not None
            if acct.status != "active":
                return xrpc_error(400, _status_error(acct.status), f"Repo is {acct.status}")
            car = acct.repo.export_car()
            if acct.did in self.tampered_repos:
                car = car[:-1] + bytes([car[-1] ^ 0xFF])  # the last block's content: its hash no longer matches
            return response(200, car, "application/vnd.ipld.car")
        return xrpc_error(404, "MethodNotImplemented", f"no such method {path}")


def _status_error(status: str) -> str:
    return {"takendown": "RepoTakendown", "suspended": "RepoSuspended", "deactivated": "RepoDeactivated"}.get(
        status, "RepoDeactivated"
    )
