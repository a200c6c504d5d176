"""What the HTTP handlers and the console may read of a running relay: ``ServiceView``.

``relay.service.RelayService`` satisfies it (structurally: it is never named there). The handlers
(``relay.app``, ``relay.admin``, ``relay.console``, ``relay.routes``, ``relay.gate``) are typed
against this view, not against the service, because the service builds the console's parts
(``HostIndex``, ``ReplicaReporter``) itself: typing those against the service would close a circle
of imports (service → console → service). Every member is read-only here; the parts that belong
to a role this process does not run are ``None``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from backfill.sequencer import Sequencer
    from backfill.store import Store
    from backfill.types import HostState
    from firehose.broadcast import Broadcaster
    from firehose.state import AccountState
    from relay.config import RelayConfig
    from relay.console.ledger import HostLedger
    from relay.consumers import ConsumerRegistry
    from relay.hosts import HostManager
    from relay.identity import IdentityResolver
    from relay.ingest.hostruns import Upstreams
    from relay.ingest.lanes import AccountLanes
    from relay.ingest.resync import ResyncManager
    from relay.jetstream_server import JetstreamServer
    from relay.metrics import RelayMetrics
    from relay.repo_proxy import RepoProxy
    from relay.siblings import SiblingForwarder
    from relay.wiring import Core


class Reports(Protocol):
    """This process's console report and the deployment's (``relay.console.reports.ReplicaReporter``)."""

    @property
    def id(self) -> str: ...
    @property
    def redis_error(self) -> str | None: ...
    async def local(self) -> dict[str, Any]: ...
    async def deployment(self) -> list[dict[str, Any]]: ...


class HostRows(Protocol):
    """The console's host table (``relay.console.api.HostIndex``)."""

    async def rows(self) -> list[tuple[HostState, int]]: ...
    def invalidate(self) -> None: ...


class ServiceView(Protocol):
    """The running relay as its handlers see it (``relay.service.RelayService``)."""

    @property
    def config(self) -> RelayConfig: ...
    @property
    def role(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def phase(self) -> str: ...
    @property
    def lease_holder(self) -> str | None: ...
    @property
    def metrics(self) -> RelayMetrics: ...
    @property
    def consumers(self) -> ConsumerRegistry: ...
    @property
    def app(self) -> Starlette | None: ...
    @property
    def core(self) -> Core | None: ...
    @property
    def store(self) -> Store: ...
    @property
    def broadcaster(self) -> Broadcaster: ...
    @property
    def identity(self) -> IdentityResolver: ...
    @property
    def jetstream(self) -> JetstreamServer | None: ...
    @property
    def repo_proxy(self) -> RepoProxy | None: ...
    @property
    def sequencer(self) -> Sequencer | None: ...
    @property
    def lanes(self) -> AccountLanes | None: ...
    @property
    def upstreams(self) -> Upstreams | None: ...
    @property
    def resync(self) -> ResyncManager | None: ...
    @property
    def hosts(self) -> HostManager | None: ...
    @property
    def siblings(self) -> SiblingForwarder | None: ...
    @property
    def host_ledger(self) -> HostLedger: ...
    @property
    def reporter(self) -> Reports: ...
    @property
    def console_hosts(self) -> HostRows: ...

    async def readiness(self) -> list[str]: ...
    async def refresh_gauges(self) -> None: ...
    async def set_local_status(self, did: str, local_status: str) -> AccountState: ...
