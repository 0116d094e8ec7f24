"""A stall of the router's own event loop (a 16 MiB body parsed, a GC pause) during a quota call, against a real
redis-server: the budget is Redis's to miss, not the loop's. A call whose answer comes within the budget of the
loop's running time is answered by Redis (counted there, no outage), and one from a Redis far too slow is still
given up on about a budget after the loop runs again."""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable, Iterator

import pytest

from pdserve.security.api_keys import Tenant
from pdserve.security.redis_quotas import RedisQuotas, quota_key
from tests.redis_server import RedisServer, started

pytestmark = pytest.mark.timeout(60)
BUDGET_S = 0.2  # Redis's answer, 20 ms after the stall, is well inside it on a loaded machine
STALL_S = 0.6  # the loop blocked for three budgets
OUTAGE = "enforcing API-key limits per router"
TENANT = Tenant("t", "stalled", requests_per_second=100, tokens_per_minute=6000, max_concurrent=5)

server = pytest.fixture(scope="module")(started)


@pytest.fixture
def quotas(server: RedisServer) -> Iterator[RedisQuotas]:
    with server.client() as c:
        c.flushall()
    # A socket timeout far past the budget: the request's wait must not depend on it.
    yield RedisQuotas(server.url, budget_s=BUDGET_S, retry_s=30, write_timeout_s=30)
    server.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]  # a failed test's stopped Redis


CALLS: dict[str, Callable[[RedisQuotas], Awaitable[object]]] = {
    "request": lambda q: q.take_request(TENANT),
    "stream": lambda q: q.open_stream(TENANT),
    "tokens": lambda q: q.take_tokens(TENANT, 600),
}


def counted_in_redis(server: RedisServer, what: str) -> bool:
    with server.client() as c:
        if what == "stream":
            return c.zcard(quota_key(TENANT, "streams")) == 1
        level = c.hget(quota_key(TENANT, f"{what}s" if what == "request" else what), "level")
        return level is not None and float(level) < (100 if what == "request" else 6000)


@pytest.mark.parametrize("what", list(CALLS))
async def test_a_stall_of_the_routers_loop_is_not_taken_for_a_redis_outage(server, quotas, what: str, caplog):
    """The loop blocks for three budgets while the call awaits Redis, which answers 20 ms after the block: the
    call gets that answer (the budget was spent by the loop, not by Redis), so Redis counted it, and the router
    neither fell back to its own limits nor logged an outage. Each of a request's three calls is exposed."""
    try:
        await CALLS[what](quotas)  # as in a running router: its connection made, its scripts loaded
        with server.client() as c:
            c.flushall()
        with caplog.at_level(logging.WARNING, logger="pdserve.security.redis_quotas"):
            server.stall_the_loop(STALL_S, "after", answer_after_s=0.02)
            await CALLS[what](quotas)
        assert quotas._down_since is None
        assert counted_in_redis(server, what)
        assert not any(OUTAGE in r.getMessage() for r in caplog.records)
    finally:
        await quotas.close()


async def test_a_stall_while_redis_does_not_answer_still_falls_back(server, quotas, caplog):
    """The loop blocks just before the call is sent, and Redis answers only 3 s (15 budgets) after the block: the
    call is given up on once the loop has run about a budget again, so the router's own limits answered, not
    Redis, and the outage is logged once. (Cancelled just as its write ended, the call went on in redis-py, its
    cancel swallowed, until Redis answered or the socket timed out.)"""
    try:
        await quotas.take_request(TENANT)
        with caplog.at_level(logging.WARNING, logger="pdserve.security.redis_quotas"):
            server.stall_the_loop(STALL_S, "before", answer_after_s=3.0)
            await quotas.take_request(TENANT)
            assert quotas._down_since is not None  # the fallback answered: Redis had not
        assert sum(OUTAGE in r.getMessage() for r in caplog.records) == 1
    finally:
        await quotas.close()
