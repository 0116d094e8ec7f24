"""A stall of the router's own event loop (a 16 MiB body parsed, a GC pause) during a prefix match, against a real
redis-server: the budget is Redis's to miss, not the loop's. A match whose answers come within the budget of the
loop's running time gets Redis's hits (no skip, no outage logged), and one against a Redis far too slow is still
given up on about a budget after the loop runs again."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator

import pytest
import redis

from pdserve.engine.cache_journal import PrefixCacheChanges
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
def index(server: RedisServer) -> Iterator[RedisPrefixIndex]:
    with server.client() as c:
        c.flushall()
    with redis.Redis.from_url(server.url) as c:
        apply_changes(c, WORKER, PrefixCacheChanges(CACHED, [], whole=True))
    # A socket timeout far past the budget: the match's wait must not depend on it.
    yield RedisPrefixIndex(server.url, match_budget_s=BUDGET_S, record_timeout_s=30, retry_s=30)
    server.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]  # a failed test's stopped Redis


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
