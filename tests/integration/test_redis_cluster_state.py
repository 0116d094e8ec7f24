"""What the cluster's processes share in Redis beside the workers, against a real redis-server: the desired worker
counts (and the flags' counts beside them) and every router's admitted and finished totals, through outages."""

from __future__ import annotations

import time

import pytest
import redis
import redis.asyncio as aredis

from pdserve.protocol.admitted import AdmittedTotals
from pdserve.protocol.roles import Role
from pdserve.registry.base import RETIRED_KEEP_S, WorkerState
from pdserve.registry.redis import (
    ADMITTED_KEY,
    DESIRED_COUNTS_KEY,
    FLAG_COUNTS_KEY,
    RETIRED_KEY,
    WORKERS_KEY,
    RedisRegistry,
    worker_key,
)
from services.router.admitted import ClusterAdmitted
from tests.redis_server import emptied, started

pytestmark = pytest.mark.timeout(120)
server = pytest.fixture(scope="module")(started)
url = pytest.fixture(emptied)


def test_desired_counts_are_one_hash_shared_by_every_registry_and_replaced_whole(url):
    fleet, router = RedisRegistry(url), RedisRegistry(url)
    assert router.desired_counts() == {}
    fleet.set_desired_counts({Role.PREFILL: 1, Role.DECODE: 1})
    router.set_desired_counts({Role.PREFILL: 2, Role.DECODE: 3})
    assert fleet.desired_counts() == {Role.PREFILL: 2, Role.DECODE: 3}
    with redis.Redis.from_url(url) as c:
        assert c.hgetall(DESIRED_COUNTS_KEY) == {b"prefill": b"2", b"decode": b"3"}
        assert c.ttl(DESIRED_COUNTS_KEY) == -1  # the cluster's shape does not expire
        c.hset(DESIRED_COUNTS_KEY, mapping={"gpu": "1", "decode": "many"})  # anyone with access may write
    assert fleet.desired_counts() == {Role.PREFILL: 2}  # what does not parse is skipped, not raised
    fleet.set_desired_counts({Role.COLOCATED: 4})
    assert router.desired_counts() == {Role.COLOCATED: 4}
    fleet.set_desired_counts({Role.PREFILL: 1, Role.DECODE: 2}, from_flags=True)  # one transaction, both hashes
    router.set_desired_counts({Role.PREFILL: 5, Role.DECODE: 2})  # a live scale leaves the flags' counts
    assert (fleet.desired_counts(), router.flag_counts()) == (
        {Role.PREFILL: 5, Role.DECODE: 2},
        {Role.PREFILL: 1, Role.DECODE: 2},
    )
    other_router = RedisRegistry(url)
    assert router.merge_desired_counts({Role.PREFILL: 3})  # two routers scale different roles: both hold
    assert other_router.merge_desired_counts({Role.DECODE: 4})
    assert fleet.desired_counts() == {Role.PREFILL: 3, Role.DECODE: 4}


def test_a_merge_onto_counts_gone_since_they_were_read_writes_nothing(url):
    """A scale of one role read the counts, then Redis restarted empty: merged, the hash would hold that role alone,
    which the fleet (writing its counts back only where there are none) never mends, and every later scale of one
    role would be refused for the other's missing count. Nothing is written: the scale is asked again."""
    router = RedisRegistry(url)
    assert not router.merge_desired_counts({Role.PREFILL: 3})
    assert router.desired_counts() == {}


async def test_every_routers_admitted_requests_add_up_in_one_hash_and_a_failed_flush_is_kept(url, server):
    """Two routers' counters through one Redis: the status of either shows both; what a flush could not add while
    Redis was down is added by the next one, once."""
    with redis.Redis.from_url(url) as c:
        c.delete(ADMITTED_KEY)
    local_a, local_b = AdmittedTotals(), AdmittedTotals()
    a, b = ClusterAdmitted(RedisRegistry(url), local_a), ClusterAdmitted(RedisRegistry(url), local_b)
    local_a.add(100, 10)
    local_b.add(50, 5)
    local_b.add(50, 5)
    assert await b.totals() == (AdmittedTotals(2, 100, 10), True)  # b's own, flushed before the read
    assert await a.totals() == (AdmittedTotals(3, 200, 20), True)
    local_a.finish(9)  # finished since the last flush, nothing admitted: added all the same
    await a.flush()
    assert await b.totals() == (AdmittedTotals(3, 200, 20, finished=1, completion_tokens=9), True)
    server.stop()
    try:
        local_a.add(7, 1)
        with pytest.raises(redis.RedisError):
            await a.flush()
        own = await a.totals()
        assert own == (AdmittedTotals(2, 107, 11, 1, 9), False)  # the cluster's unknown: this router's own, said so
    finally:
        server.start()  # an empty Redis (these tests' servers keep nothing on disk)
    assert await b.totals() == (AdmittedTotals(), True)  # b had nothing new; a's request is still a's to add
    assert await a.totals() == (AdmittedTotals(1, 7, 1), True)  # added once, after the outage
    assert await b.totals() == (AdmittedTotals(1, 7, 1), True)


def test_an_add_whose_reply_was_lost_counts_once_when_it_is_sent_again(url, server):
    """What a router sends again after a timeout may have been applied already (Redis answered too late): the
    registry skips an add numbered no higher than the writer's last."""
    with redis.Redis.from_url(url) as c:
        c.delete(ADMITTED_KEY)
    registry = RedisRegistry(url)
    registry.add_admitted(AdmittedTotals(2, 100, 10), "router-a", 1)
    registry.add_admitted(AdmittedTotals(2, 100, 10), "router-a", 1)  # the retry
    registry.add_admitted(AdmittedTotals(1, 50, 5), "router-b", 1)  # another router's first add
    registry.add_admitted(AdmittedTotals(1, 7, 1), "router-a", 2)
    assert registry.admitted() == AdmittedTotals(4, 157, 16)


async def test_a_worker_that_heartbeats_while_expired_ones_are_dropped_stays_listed(url, server):
    """The view read a worker's key as gone, then the worker published: dropping the expired ids keeps it."""
    registry = RedisRegistry(url)
    with redis.Redis.from_url(url) as c:
        c.sadd(WORKERS_KEY, "gone-0", "back-0")
        c.delete(worker_key("gone-0"))
        c.set(worker_key("back-0"), b"{}")  # its heartbeat landed after the read
        client = aredis.Redis.from_url(url)
        try:
            await registry._forget_expired(client, ["gone-0", "back-0"])
        finally:
            await client.aclose()
        assert c.smembers(WORKERS_KEY) == {b"back-0"}


async def test_a_retired_id_reaches_every_router_with_its_removal_and_leaves_when_the_id_publishes_again(url):
    """What lets routers stop offering a worker scaled away, where one merely gone may be restarting
    (services/router/offered_workers.py); old entries go as others retire."""
    controller, router = RedisRegistry(url), RedisRegistry(url, refresh_s=60)
    await router.start()
    try:
        for worker_id in ("d0", "d1"):
            controller.publish(WorkerState(worker_id, Role.DECODE, f"{worker_id}:1"))
        with redis.Redis.from_url(url) as c:
            c.zadd(RETIRED_KEY, {"d-long-ago": time.time() - RETIRED_KEEP_S - 1})
        controller.retire("d1")
        assert await router.refresh()
        assert [w.worker_id for w in router.workers()] == ["d0"] and router.retired() == {"d1"}
        controller.publish(WorkerState("d1", Role.DECODE, "d1:1"))  # the id handed out anew
        assert await router.refresh()
        assert router.retired() == set()
        assert sorted(w.worker_id for w in router.workers()) == ["d0", "d1"]
    finally:
        await router.close()


def test_desired_counts_of_an_unreachable_redis_raise_within_the_timeout(url, server):
    registry = RedisRegistry(url)
    server.stop()
    try:
        start = time.monotonic()
        with pytest.raises(redis.RedisError):
            registry.desired_counts()
        with pytest.raises(redis.RedisError):
            registry.set_desired_counts({Role.PREFILL: 1, Role.DECODE: 1})
        assert time.monotonic() - start < 30  # bounded by the client's timeouts, not a hang
    finally:
        server.start()


def test_desired_counts_are_restored_only_where_redis_has_none(url, server):
    registry = RedisRegistry(url)
    with redis.Redis.from_url(url) as c:
        c.delete(DESIRED_COUNTS_KEY, FLAG_COUNTS_KEY)
    registry.restore_desired_counts({Role.PREFILL: 2, Role.DECODE: 3}, {Role.PREFILL: 1, Role.DECODE: 1})  # empty
    assert registry.desired_counts() == {Role.PREFILL: 2, Role.DECODE: 3}
    assert registry.flag_counts() == {Role.PREFILL: 1, Role.DECODE: 1}
    registry.restore_desired_counts({Role.PREFILL: 9, Role.DECODE: 9}, {Role.DECODE: 9})  # set meanwhile: kept
    assert registry.desired_counts() == {Role.PREFILL: 2, Role.DECODE: 3}
    assert registry.flag_counts() == {Role.PREFILL: 1, Role.DECODE: 1}
