"""A router's Redis clients against a real redis-server: the registry view kept through a long outage, and a burst
of calls held to a bounded number of connections."""

from __future__ import annotations

import asyncio
import logging
import math

import pytest

from pdserve.registry.redis import ASYNC_CONNECTIONS, RedisRegistry, connect_async
from tests.integration.test_redis_registry import ids, router_view, state, wait_for
from tests.redis_server import emptied, started

pytestmark = pytest.mark.timeout(120)

server = pytest.fixture(scope="module")(started)
url = pytest.fixture(emptied)


async def test_without_a_view_age_limit_the_last_view_serves_through_a_long_outage(url, server, caplog):
    """The routers' default: an outage many TTLs long (Redis rescheduled, say) keeps the workers placed on."""
    publisher = RedisRegistry(url, ttl_s=0.3)
    publisher.publish(state("p0"))
    caplog.set_level(logging.WARNING, logger="pdserve.registry.redis")
    async with router_view(url, ttl_s=0.3, refresh_s=0.05, timeout_s=0.1, max_view_age_s=math.inf) as router:
        with server.stopped():
            await asyncio.sleep(2.0)  # past 3 TTLs, the limit a registry is given by default
            assert not router.view_current() and ids(router.workers()) == ["p0"]
        publisher.publish(state("p0"))
        await wait_for(router.view_current, 5, "the view to be current again")
        assert ids(router.workers()) == ["p0"]
    messages = [r.getMessage() for r in caplog.records]
    assert any("serving the last view of 1 workers until it answers" in m for m in messages)
    assert not any("past its limit" in m for m in messages)


async def test_a_burst_of_calls_holds_a_bounded_number_of_connections(url, server):
    """Each call in flight took a connection of its own, kept for good: a router's clients held their busiest
    burst's worth for life. They wait for one of ASYNC_CONNECTIONS instead, and all are answered."""
    # What is bounded is connections, not time: a CI's contention once held a connect past the default 1 s.
    client = connect_async(url, timeout_s=10)
    try:
        answers = await asyncio.gather(*(client.eval("return redis.call('ping')", 0) for _ in range(300)))
        assert answers == [b"PONG"] * 300
        with server.client() as c:
            connected = len(c.client_list()) - 1  # less this one
        assert 1 <= connected <= ASYNC_CONNECTIONS
    finally:
        await client.aclose()
