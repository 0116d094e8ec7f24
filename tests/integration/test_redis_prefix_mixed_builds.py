"""A rollout of the holders index, against a real redis-server: routers and workers of the build before it (its own
prefix index, `earlier_prefix_index.py`) and of this one share Redis. No match fails or logs an unreadable entry;
each build's routers see what workers and routers of their own build wrote, so a worker of the other build is priced
by the placements routers of the router's build made there only (uncached at worst); neither build's writes touch
the other's keys; and what the build before wrote expires within its hour, a worker of this build replacing one of
that build drops its predecessor's entry at once."""

from __future__ import annotations

import logging

import pytest
import redis

from pdserve.engine.cache_journal import PrefixCacheChanges
from pdserve.registry.base import PREFIX_TTL_S
from pdserve.registry.prefix_holders import BLOCKS_KEY, NAMESPACE
from pdserve.registry.redis import PREFIX
from pdserve.registry.redis_prefix import RedisPrefixIndex, apply_changes
from tests.integration import earlier_prefix_index as earlier
from tests.redis_server import emptied, started

pytestmark = pytest.mark.timeout(120)
server = pytest.fixture(scope="module")(started)
url = pytest.fixture(emptied)
A = [bytes([1, i]) * 8 for i in range(40)]  # what each worker's own cache holds
B = [bytes([2, i]) * 8 for i in range(40)]  # a prompt the routers place


async def test_both_builds_routers_and_workers_share_redis_without_a_failure_or_a_wrong_hit(url, caplog):
    caplog.set_level(logging.WARNING)
    new_router = RedisPrefixIndex(url, match_budget_s=5.0)
    old_router = earlier.RedisPrefixIndex(url, match_budget_s=5.0)
    try:
        with redis.Redis.from_url(url) as client:
            assert earlier.apply_changes(client, "old/1", PrefixCacheChanges(A, [], whole=True), first=True)
            assert apply_changes(client, "new/1", PrefixCacheChanges(A, [], whole=True), first=True)
            bitmaps = client.hgetall(BLOCKS_KEY)
            new_router.record("old/1", B[:3])
            old_router.record("new/1", B[:5])
            await new_router.flush()
            await old_router.flush()
            for _ in range(3):  # their next beats
                assert earlier.apply_changes(client, "old/1", PrefixCacheChanges(A[:1], []))
                assert apply_changes(client, "new/1", PrefixCacheChanges(A[:1], []))
            workers = ["old/1", "new/1"]
            assert await new_router.match(workers, A) == {"old/1": 0, "new/1": 40}  # its own build's journal only
            assert await new_router.match(workers, B) == {"old/1": 3, "new/1": 0}  # its own build's placements
            assert await old_router.match(workers, A) == {"old/1": 40, "new/1": 0}
            assert await old_router.match(workers, B) == {"old/1": 0, "new/1": 5}
            assert client.hgetall(BLOCKS_KEY) == {**bitmaps, B[0]: b"\x02", B[1]: b"\x02", B[2]: b"\x02"}
            earlier_keys = list(client.scan_iter(match=f"{PREFIX}:prefix:*"))
            assert sorted(earlier_keys) == [f"{PREFIX}:prefix:{w}".encode() for w in ("new/1", "old/1")]
            assert all(0 < client.ttl(k) <= PREFIX_TTL_S for k in earlier_keys)  # gone within the hour
            assert not [k for k in client.scan_iter(match=f"{NAMESPACE}:*") if client.ttl(k) < 0]

            assert apply_changes(client, "old/2", PrefixCacheChanges(A[:2], [], whole=True), first=True)
            assert not client.exists(f"{PREFIX}:prefix:old/1")  # replaced by a process of this build: dropped
    finally:
        await new_router.close()
        await old_router.close()
    assert not [r.getMessage() for r in caplog.records], "a match or a write failed"
