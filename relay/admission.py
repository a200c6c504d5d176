"""Who may speak for an account, and which accounts a host may bring: host binding and admission.

* Host binding: an event about an account counts only when it comes from the account's PDS per
  its DID document (``identity_for_host``: cached resolution, re-resolved once fresh on a
  mismatch, which also follows account migrations).
* Admission: a host has an account limit (``relay.hosts.HostPolicy``); an account first seen on
  a host over its limit is *held* (stored ``sync_state="throttled"``, nothing redistributed) and
  resynchronised when the limit is raised. An account that moved here (its DID document says so)
  is rebound to this host.

Per-host account counts are loaded once from the store and then kept here (check and count with
no ``await`` in between, since lanes admit accounts concurrently). Host rows (limit, trust, status)
are re-read at most every ``HOST_TTL`` seconds — a burst of never-seen accounts costs one query per
host, not one per account (issue 18) — and at once after ``forget_host`` (the host manager raised
the limit, or this module throttled the host); a limit lowered elsewhere applies within ``HOST_TTL``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from backfill.store import Store
from backfill.types import HostState
from firehose.lru import BoundedLRU
from firehose.state import AccountState
from relay.hosts import HostPolicy
from relay.identity import Identity, IdentityResolver
from relay.jsonlog import fields

log = logging.getLogger("relay.admission")

#: seconds a host row read for admission is reused
HOST_TTL = 1.0


class Admission:
    """Host binding and account limits (see the module docstring)."""

    def __init__(self, *, store: Store, identity: IdentityResolver, policy: HostPolicy,
                 default_account_limit: int | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.identity = identity
        self.policy = policy
        self.default_account_limit = default_account_limit
        self.clock = clock
        self._host_counts: dict[str, int] = {}
        self._hosts: BoundedLRU[str, tuple[float, HostState | None]] = BoundedLRU(10_000)

    async def _host(self, hostname: str) -> HostState | None:
        now = self.clock()
        cached = self._hosts.get(hostname)
        if cached is not None and now - cached[0] < HOST_TTL:
            return cached[1]
        host = await self.store.get_host(hostname)
        self._hosts.put(hostname, (now, host))
        return host

    def forget_host(self, hostname: str) -> None:
        """Read ``hostname``'s row again at its next admission (its limit or status changed)."""
        self._hosts.pop(hostname, None)

    async def identity_for_host(self, did: str, hostname: str, *, fresh: bool = False,
                                max_age: float | None = None) -> Identity | None:
        """The account's identity if ``hostname`` is its PDS (after one fresh re-resolution when
        the cached document names another host), else None. ``fresh`` resolves fresh at once
        (``max_age``: a fresh answer this recent is fresh enough). Raises ``IdentityError``."""
        if fresh:
            ident = await self.identity.resolve(did, fresh=True, max_age=max_age or 0.0)
            return ident if ident.pds_hostname == hostname else None
        ident = await self.identity.resolve(did)
        if ident.pds_hostname == hostname:
            return ident
        ident = await self.identity.resolve(did, fresh=True)
        return ident if ident.pds_hostname == hostname else None

    async def admit(self, hostname: str, did: str, state: AccountState | None) -> AccountState | None:
        """The state to judge an account's event against, now that ``hostname`` speaks for it;
        None when the account is held (throttled) — its held state is then already stored."""
        if state is not None and state.host == hostname:
            return state
        if state is not None:  # migrated here (the DID document says so): rebind
            return dataclasses.replace(state, host=hostname)
        host = await self._host(hostname)
        limit = self.policy.account_limit(host) if host is not None else self.default_account_limit
        if hostname not in self._host_counts:
            loaded = await self.store.count_accounts(hostname)
            self._host_counts.setdefault(hostname, loaded)
        # check and count with no await in between: accounts are admitted concurrently
        count = self._host_counts[hostname]
        self._host_counts[hostname] = count + 1
        if limit is not None and count >= limit:
            held = AccountState(did=did, host=hostname, sync_state="throttled", updated_at=time.time())
            await self.store.upsert_account(held)
            if host is not None and host.status == "active":
                await self.store.set_host_status(hostname, "throttled")
                self.forget_host(hostname)
                log.info("host throttled", extra=fields(host=hostname, limit=limit))
            return None
        return AccountState(did=did, host=hostname)
