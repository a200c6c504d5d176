"""A test leaves nothing in the test Redis database: a relay with Redis caches every identity it
resolves there (``relay:identity:<did>``, pointing at the simulated host's port, dead once the
test ends) and keeps its event stream there; ``tests.redis_keys.keys_removed`` (the ``redis_url``
fixture) deletes them when the test ends."""

from __future__ import annotations

import uuid
from typing import Any

from sim import SimConfig, SimFleet
from tests.redis_keys import current_keys, keys_removed
from tests.relay.e2e import Consumer, commits_of, crawl


async def test_what_a_relay_writes_to_redis_is_removed_after_the_test(relay_factory: Any, redis_url: str) -> None:
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=1, seed=31))
    await fleet.start()
    stream = f"test:relay:{uuid.uuid4().hex[:12]}"
    (account,) = fleet.accounts
    identity_key = f"relay:identity:{account.did}".encode()
    try:
        before = current_keys(redis_url)
        with keys_removed(redis_url):
            settings = {"allow_insecure_hosts": True, "plc_url": fleet.plc_url, "validation_workers": 0,
                        "redis_url": redis_url, "redis_stream": stream}
            async with relay_factory(**settings) as relay, Consumer(relay.ws_url, cursor=0) as consumer:
                await crawl(relay.url, account.host.hostname)
                await fleet.generate(2)
                await consumer.wait_for(lambda evs: account.repo.rev in commits_of(consumer, account.did))
            written = current_keys(redis_url) - before
            assert {identity_key, stream.encode()} <= written  # what the relay keeps in Redis
        assert current_keys(redis_url) - before == set()
    finally:
        await fleet.stop()
