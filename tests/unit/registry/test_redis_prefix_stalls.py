"""A stall of the router's own event loop (a 16 MiB body parsed, a GC pause) during a prefix match, against a real
redis-server: the budget is Redis's to miss, not the loop's. A match whose answers come within the budget of the
loop's running time gets Redis's hits (no skip, no outage logged), and one against a Redis far too slow is still
given up on about a budget after the loop runs again, its connection given back."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Iterator

import pytest
import redis

from pdserve.engine.cache_journal import PrefixCacheChanges
from pdserve.registry import redis as registry_redis
from pdserve.registry.redis_prefix import FIRST_PROBE_BLOCKS, RedisPrefixIndex, apply_changes
from tests.redis_server import RedisServer, started

pytestmark = pytest.mark.timeout(60)
BUDGET_S = 0.2  # Redis's answers, 20 ms after the stall, are well inside it on a loaded machine
STALL_S = 0.6  # the loop blocked for three budgets
OUTAGE = "placing without prefix hits"
WORKER = "w/1"
CACHED = [i.to_bytes(16, "big") for i in range(FIRST_PROBE_BLOCKS + 36)]  # a match of two rounds: 64, then 36

server = pytest.fixture(scope="module")(started)


@pytest.fixture
def cached(server: RedisServer) -> Iterator[None]:
    """WORKER's entry holds CACHED."""
    with server.client() as c:
        c.flushall()
    with redis.Redis.from_url(server.url) as c:
        apply_changes(c, WORKER, PrefixCacheChanges(CACHED, [], whole=True))
    yield
    server.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]  # a failed test's stopped Redis


@pytest.fixture
def index(server: RedisServer, cached: None) -> RedisPrefixIndex:
    # A socket timeout far past the budget: the match's wait must not depend on it.
    return RedisPrefixIndex(server.url, match_budget_s=BUDGET_S, record_timeout_s=30, retry_s=30)


async def test_a_stall_of_the_routers_loop_is_not_taken_for_a_redis_outage(server, index, caplog):
    """The loop blocks for three budgets while the match awaits its first probe, which Redis answers 20 ms after
    the block: the match gets both rounds' answers (the budget was spent by the loop, not by Redis), so the
    request is placed with its prefix hits, Redis is not skipped, and no outage is logged."""
    try:
        assert await index.match([WORKER], CACHED) == {WORKER: len(CACHED)}  # as in a running router: connected
        with caplog.at_level(logging.WARNING, logger="pdserve.registry.redis_prefix"):
            server.stall_the_loop(STALL_S, "after", answer_after_s=0.02)
            assert await index.match([WORKER], CACHED) == {WORKER: len(CACHED)}
        assert index._skip_until < time.monotonic()
        assert not [r.getMessage() for r in caplog.records]
    finally:
        await index.close()


async def test_a_stall_while_redis_does_not_answer_still_skips_it(server, index, caplog):
    """The loop blocks just before the match's first probe is sent, and Redis answers only 3 s (15 budgets) after
    the block: the match is given up on once the loop has run about a budget again, so the request is placed
    without prefix hits, Redis is skipped for `retry_s`, and the outage is logged once."""
    try:
        await index.match([WORKER], CACHED)
        with caplog.at_level(logging.WARNING, logger="pdserve.registry.redis_prefix"):
            server.stall_the_loop(STALL_S, "before", answer_after_s=3.0)
            assert await index.match([WORKER], CACHED) == {WORKER: 0}
            assert index._skip_until > time.monotonic()  # skipped: Redis had not answered
        assert sum(OUTAGE in r.getMessage() for r in caplog.records) == 1
    finally:
        await index.close()


async def test_matches_given_up_on_give_their_connections_back(server, cached, monkeypatch, caplog):
    """Matches given up on, more of them than the index's pool has connections, each against a Redis busy past the
    budget (DEBUG SLEEP: a slow Redis, a loaded machine's, one paused or failing over), each after a match it answered
    in time (which leaves a connected connection in the pool, as a busy router's are): every match Redis answers in
    time gets its hits, and placements are recorded. Before, a match given up on while its pipeline asked Redis
    whether its script was loaded (its first round trip) kept that connection from the pool for good: once the pool's
    connections were all kept so, every match found none (no prefix hit) and every record failed, for the router's
    life."""
    monkeypatch.setattr(registry_redis, "ASYNC_CONNECTIONS", 4)  # the pool's size: 32 in a router
    index = RedisPrefixIndex(server.url, match_budget_s=BUDGET_S, record_timeout_s=1.0, retry_s=0.0)
    try:
        for _ in range(4 + 1):
            assert await index.match([WORKER], CACHED) == {WORKER: len(CACHED)}
            busy = asyncio.create_task(asyncio.to_thread(sleep_redis, server, 2.5 * BUDGET_S))
            await asyncio.sleep(BUDGET_S / 4)  # asleep: the match's first command waits behind it
            assert await index.match([WORKER], CACHED) == {WORKER: 0}
            await busy
        with caplog.at_level(logging.WARNING, logger="pdserve.registry.redis_prefix"):
            caplog.clear()
            index.record("w/2", CACHED[:3])
            await index.flush()
        assert not [r.getMessage() for r in caplog.records]  # the record found a connection too
    finally:
        await index.close()


def sleep_redis(server: RedisServer, seconds: float) -> None:
    with server.client() as c:
        c.execute_command("DEBUG", "SLEEP", str(seconds))
