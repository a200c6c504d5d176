"""Job settings shipped from the driver to every executor (a plain, picklable dataclass)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class FetchConfig:
    """How executors talk to hosts and identity services.

    Per-host limits are global targets; a host's accounts are spread over ``shards_per_host``
    tasks and each task gets ``1/shards_per_host`` of the rate and concurrency.
    """

    host_concurrency: int = 4
    host_rate: float = 20.0  # requests per second per host (all tasks together)
    timeout_s: float = 30.0
    retries: int = 3
    backoff_s: float = 0.5
    max_repo_bytes: int = 256 * 1024 * 1024
    allow_private: bool = False  # allow loopback/private addresses (tests, private clusters)
    scheme: str = "https"  # scheme used for bare host names from the relay's tables
    plc_url: str = "https://plc.directory"
    user_agent: str = "atproto-relay-spark/0.1"
    shards_per_host: int = 1


@dataclass(frozen=True, slots=True)
class JobConfig:
    """Settings common to resync, reconcile and export."""

    db_url: str
    run_id: str
    fetch: FetchConfig = field(default_factory=FetchConfig)
    write_batch: int = 200  # rows per idempotent write-back transaction
    partitions: int = 0  # 0 → the session's default parallelism
