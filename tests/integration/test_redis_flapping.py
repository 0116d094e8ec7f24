"""The router's view of the workers through a Redis that misses refreshes now and then (a slow one, one held by a
large command), against a real redis-server: each outage's grace is for the workers Redis listed before it."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.protocol.roles import Role
from pdserve.registry.base import WorkerState
from pdserve.registry.redis import RedisRegistry
from tests.redis_server import emptied, started

pytestmark = pytest.mark.timeout(120)
server = pytest.fixture(scope="module")(started)
url = pytest.fixture(emptied)


async def test_a_worker_gone_before_an_outage_gets_no_grace_after_it(url, server):
    """A dead worker left its one TTL of grace after the first outage, not after every one: carried into each
    recovery's grace, it stayed placed on for as long as Redis missed a refresh at least once per TTL."""
    worker = RedisRegistry(url, ttl_s=0.3)
    worker.publish(WorkerState("d0", Role.DECODE, "d0:1"))  # its last beat: it dies now
    router = RedisRegistry(url, ttl_s=1.0, refresh_s=3600.0, timeout_s=0.1, max_view_age_s=60.0)
    await router.start()  # refreshed by hand below, its background task never does
    try:
        assert [w.worker_id for w in router.workers()] == ["d0"]
        for outage in range(4):  # each within a TTL of the last: the grace of the first ends among them
            with server.stopped():
                assert not await router.refresh()
                await asyncio.sleep(0.3)  # d0's key expires meanwhile (the first time) or is long gone
            assert await router.refresh()
            if outage == 0:  # its key expired while Redis stood still: one TTL to heartbeat again
                assert [w.worker_id for w in router.workers()] == ["d0"]
        assert await router.refresh()
        assert router.workers() == []  # Redis has not listed it since before the first outage
    finally:
        await router.close()


async def test_a_worker_retired_after_an_outage_leaves_its_grace_at_once(url, server):
    """A worker whose key expired while Redis stood still is kept one TTL after the recovery, in case it beats
    again; retired meanwhile (scaled down, by another router or the fleet) it will not: the next refresh drops it,
    not the end of its grace, so no router goes on placing on a worker that is draining away or gone."""
    worker = RedisRegistry(url, ttl_s=0.3)
    worker.publish(WorkerState("d0", Role.DECODE, "d0:1"))
    router = RedisRegistry(url, ttl_s=60.0, refresh_s=3600.0, timeout_s=0.1, max_view_age_s=120.0)
    await router.start()
    try:
        with server.stopped():
            assert not await router.refresh()
            await asyncio.sleep(0.4)  # d0's key expires meanwhile
        assert await router.refresh()
        assert [w.worker_id for w in router.workers()] == ["d0"]  # its grace: a minute to beat again
        worker.retire("d0")
        assert await router.refresh()
        assert router.workers() == []
    finally:
        await router.close()
