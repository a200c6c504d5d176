"""Who may speak for an account, and which accounts a host may bring: host binding and admission.

* Host binding: an event about an account counts only when it comes from the account's PDS per
  its DID document (``identity_for_host``: cached resolution, re-resolved once fresh on a
  mismatch, which also follows account migrations).
* Relay upstreams (a host an operator marked as a relay): the relay is a transport, not a PDS. It
  may speak for an account whose DID document names a PDS that this relay does not follow directly
  (no known non-relay host of that name, whatever its status — so a direct subscription's binding,
  or a ban of the PDS, is never overridden through a relay) and that no domain ban covers
  (``relay_may_speak``). The account is bound to the relay it first came through and stays bound
  while other relays carry it too (failover between relays does not rebind it); an event from the
  PDS itself rebinds it to the PDS, after which relays may no longer speak for it.
* Admission: a host has an account limit (``relay.hosts.HostPolicy``); an account first seen on
  a host over its limit is *held* (``admit`` returns it with ``sync_state="throttled"``; its lane
  stores it so, and nothing of it is redistributed) and resynchronised when the limit is raised.
  An account that moved here (its DID document says so) is rebound to this host.

Per-host account counts: the count stored for the host (loaded once; the sequencer keeps the
stored one), plus the accounts stored since through their lanes (``stored``), plus the first-seen
accounts admitted whose first event is still on its way (reserved once per DID, whatever number of
frames it sends; ``released`` when the frame came to nothing). So a frame that is rejected never
counts, and an account is never counted twice. Checked and reserved with no ``await`` in between,
since lanes admit accounts concurrently. Host settings and domain bans
used by the relay rule are cached for ``host_ttl`` seconds; ``relay.ingest.hostruns`` calls
``host_changed`` whenever a host is started or stopped (added, blocked, changed), so operator
changes to known hosts apply at once (a new domain ban on a host never seen: within ``host_ttl``).
Host rows (limit, trust, status) are also what a burst of never-seen accounts reads: one query per
host per ``host_ttl``, and at once again after ``forget_host`` (the host manager raised
the limit, or this module throttled the host); a limit lowered elsewhere applies within ``host_ttl``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from backfill.store import Store
from backfill.types import HostState
from firehose.lru import BoundedLRU
from firehose.state import AccountState
from relay.hosts import HostBoard, HostPolicy, matches_domain
from relay.identity import Identity, IdentityResolver
from relay.jsonlog import fields

log = logging.getLogger("relay.ingest.admission")

#: seconds a host row read for admission is reused
HOST_TTL = 1.0

T = TypeVar("T")


async def shared_read(reads: dict[str, asyncio.Future[T]], key: str, read: Callable[[], Awaitable[T]]) -> T:
    """``read()``, or the answer of the read of ``key`` already under way (``reads`` holds them):
    concurrent callers share one read and its failure; when the reader is cancelled, a waiter
    reads itself."""
    pending = reads.get(key)
    if pending is not None:
        await asyncio.wait([pending])
        if not pending.cancelled():
            return pending.result()
    future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    reads[key] = future
    try:
        value = await read()
    except BaseException as exc:
        if isinstance(exc, Exception):
            future.set_exception(exc)
            future.exception()  # retrieved: the waiters (if any) get it too
        else:  # cancelled: the waiters read again themselves
            future.cancel()
        raise
    finally:
        reads.pop(key, None)
    future.set_result(value)
    return value


class Admission:
    """Host binding and account limits (see the module docstring)."""

    def __init__(self, *, store: Store, identity: IdentityResolver, policy: HostPolicy,
                 default_account_limit: int | None, host_ttl: float = HOST_TTL,
                 clock: Callable[[], float] = time.monotonic, board: HostBoard) -> None:
        """``board``: the host rows' statuses in memory, shared with the host manager; a host
        throttled here changes status through it."""
        self.store = store
        self.board = board
        self.identity = identity
        self.policy = policy
        self.default_account_limit = default_account_limit
        self.host_ttl = host_ttl
        self.clock = clock
        self._host_counts: dict[str, int] = {}
        self._count_reads: dict[str, asyncio.Future[int]] = {}
        #: hostname → first-seen accounts admitted whose first event is not stored yet
        self._reserved: dict[str, set[str]] = {}
        self._hosts: BoundedLRU[str, tuple[float, HostState | None]] = BoundedLRU(50_000)
        self._host_reads: dict[str, asyncio.Future[HostState | None]] = {}
        self._bans: tuple[float, list[str]] | None = None

    def host_changed(self) -> None:
        """A host was started, stopped or changed: forget the cached host settings and bans."""
        self._hosts.clear()
        self._bans = None

    async def _host(self, hostname: str) -> HostState | None:
        """The host's row, read at most once per ``host_ttl``; concurrent misses share one read
        (a burst of first-seen accounts of one host made a read each)."""
        now = self.clock()
        cached = self._hosts.get(hostname)
        if cached is not None and now - cached[0] < self.host_ttl:
            return cached[1]
        host = await shared_read(self._host_reads, hostname, lambda: self.store.get_host(hostname))
        self._hosts.put(hostname, (now, host))
        return host

    async def relay_may_speak(self, pds_hostname: str | None) -> bool:
        """The relay rule (module docstring): a relay upstream may carry the accounts of
        ``pds_hostname`` — a PDS named by a DID document, not followed directly, not banned."""
        if not pds_hostname:
            return False
        host = await self._host(pds_hostname)
        if host is not None and not host.relay:
            return False
        now = self.clock()
        if self._bans is None or now - self._bans[0] >= self.host_ttl:
            self._bans = (now, await self.store.list_domain_bans())
        return not matches_domain(pds_hostname, self._bans[1])

    def forget_host(self, hostname: str) -> None:
        """Read ``hostname``'s row again at its next admission (its limit or status changed)."""
        self._hosts.pop(hostname, None)

    async def identity_for_host(self, did: str, hostname: str, *, fresh: bool = False,
                                max_age: float | None = None, relay: bool = False) -> Identity | None:
        """The account's identity if ``hostname`` may speak for it — it is the account's PDS, or
        (``relay``) a relay upstream allowed by ``relay_may_speak`` — after one fresh
        re-resolution when the cached document says otherwise; else None. ``fresh`` resolves
        fresh at once (``max_age``: a fresh answer this recent is fresh enough). Raises
        ``IdentityError``."""
        if fresh:
            ident = await self.identity.resolve(did, fresh=True, max_age=max_age or 0.0)
            return ident if await self._speaks(ident, hostname, relay) else None
        ident = await self.identity.resolve(did)
        if await self._speaks(ident, hostname, relay):
            return ident
        ident = await self.identity.resolve(did, fresh=True)
        return ident if await self._speaks(ident, hostname, relay) else None

    def identity_cached(self, did: str, hostname: str) -> Identity | None:
        """The account's identity when the in-process cache holds a current one naming
        ``hostname`` as its PDS (``IdentityResolver.cached``), without awaiting; else None, and
        :meth:`identity_for_host` decides (a relay upstream, a miss, another PDS)."""
        ident = self.identity.cached(did)
        return ident if ident is not None and ident.pds_hostname == hostname else None

    async def _speaks(self, ident: Identity, hostname: str, relay: bool) -> bool:
        if relay:
            return await self.relay_may_speak(ident.pds_hostname)
        return ident.pds_hostname == hostname

    async def admit(self, hostname: str, did: str, state: AccountState | None) -> AccountState | None:
        """The state to judge an account's event against, now that ``hostname`` speaks for it;
        None when the account is held (throttled) — its held state is then already stored. The
        returned state's ``host`` is the account's binding (see the module docstring)."""
        if state is not None and state.host == hostname:
            return state
        if state is not None and state.host is not None:
            bound = await self._host(state.host)
            here = await self._host(hostname)
            if bound is not None and bound.relay and here is not None and here.relay:
                return state  # carried by another relay as well: keep the binding
        if state is not None:  # migrated here (the DID document says so): rebind
            return dataclasses.replace(state, host=hostname)
        host = await self._host(hostname)
        limit = self.policy.account_limit(host) if host is not None else self.default_account_limit
        if hostname not in self._host_counts:  # one read shared by a burst of first-seen accounts
            loaded = await shared_read(self._count_reads, hostname, lambda: self.store.count_accounts(hostname))
            self._host_counts.setdefault(hostname, loaded)
        # check and reserve with no await in between: accounts are admitted concurrently
        reserved = self._reserved.setdefault(hostname, set())
        if did not in reserved:
            if limit is not None and self._host_counts[hostname] + len(reserved) >= limit:
                if host is not None and host.status == "active":
                    await self.board.set_status(hostname, "throttled")
                    self.forget_host(hostname)
                    log.info("host throttled", extra=fields(host=hostname, limit=limit))
                self._host_counts[hostname] += 1  # the held account is stored on the host too
                return AccountState(did=did, host=hostname, sync_state="throttled", updated_at=time.time())
            reserved.add(did)
        return AccountState(did=did, host=hostname)

    def stored(self, hostname: str, did: str) -> None:
        """A first-seen account admitted on ``hostname`` is stored now (its first event)."""
        reserved = self._reserved.get(hostname)
        if reserved is not None and did in reserved:
            reserved.discard(did)
            self._host_counts[hostname] = self._host_counts.get(hostname, 0) + 1

    def moved(self, old_host: str | None, new_host: str | None) -> None:
        """An account stored on ``old_host`` is stored on ``new_host`` now."""
        if old_host in self._host_counts:
            self._host_counts[old_host] -= 1
        if new_host in self._host_counts:
            self._host_counts[new_host] += 1

    def released(self, hostname: str, did: str) -> None:
        """A first-seen account admitted on ``hostname`` came to nothing (its frame was rejected)."""
        reserved = self._reserved.get(hostname)
        if reserved is not None:
            reserved.discard(did)

    def reserved(self, hostname: str) -> int:
        """First-seen accounts of ``hostname`` admitted and not yet stored (or released)."""
        return len(self._reserved.get(hostname, ()))
