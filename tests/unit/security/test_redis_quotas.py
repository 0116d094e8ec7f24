"""API-key limits shared through a real redis-server: two RedisQuotas objects are two routers of one cluster.
A burst split between them gets no more than the key's rate, tokens and streams are counted once for both, a
dead router's lease frees its slot while a live one's is renewed, and without Redis each router falls back on
its own limits within the budget, then returns to the shared ones."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable

import pytest

from pdserve.errors import InvalidRequestError, OverloadedError
from pdserve.security.api_keys import Tenant
from pdserve.security.quotas import QuotaSession
from pdserve.security.redis_quotas import RedisQuotas, quota_key
from tests.redis_server import RedisServer, silent, started

pytestmark = pytest.mark.timeout(60)
BUDGET_S = 2.0  # generous on a loaded machine: these tests are about the shared counts, not the fallback


server = pytest.fixture(scope="module")(started)


@pytest.fixture
async def routers(server: RedisServer) -> AsyncIterator[tuple[RedisQuotas, RedisQuotas]]:
    with server.client() as c:
        c.flushall()
    a, b = RedisQuotas(server.url, budget_s=BUDGET_S), RedisQuotas(server.url, budget_s=BUDGET_S)
    yield a, b
    await a.close()
    await b.close()


async def admitted(quotas: RedisQuotas, tenant: Tenant) -> bool:
    """A request's steps, as generation.generate takes them: its request, then its stream."""
    try:
        await quotas.take_request(tenant)
        async with quotas.session(tenant):
            return True
    except OverloadedError as e:  # over the rate: when the bucket refills; over the streams: a second
        rps = tenant.requests_per_second
        assert 0 < e.retry_after_ms <= (1000 / rps + 1 if rps else 1000)
        return False


async def test_a_burst_split_between_two_routers_gets_the_keys_rate_once(routers, server):
    a, b = routers
    tenant = Tenant("team-a", "burst", requests_per_second=4)
    start = time.monotonic()
    results = [await admitted((a, b)[i % 2], tenant) for i in range(24)]
    elapsed = time.monotonic() - start
    # A bucket of one second's requests plus what it refilled meanwhile; per router it would be twice that.
    assert 4 <= sum(results) <= 4 + math.ceil(4 * elapsed), (results, elapsed)
    assert any(results[0::2]) and any(results[1::2])  # both routers served from the one bucket
    with server.client() as c:
        ttl_ms = c.pttl("pdserve:quota:burst:requests")
    assert 0 < ttl_ms <= 2000  # an idle key's bucket vanishes once it would be full again
    assert a._down_since is None and b._down_since is None  # Redis answered every call


async def test_tokens_per_minute_is_shared_and_a_refused_requests_tokens_come_back(routers):
    a, b = routers
    tenant = Tenant("team-a", "tokens", tokens_per_minute=600)
    with pytest.raises(InvalidRequestError, match="^sampling.max_tokens"):
        async with a.session(tenant) as s:
            await s.charge_tokens(601)
    async with a.session(tenant) as s:
        await s.charge_tokens(500)
        s.admitted()
    with pytest.raises(OverloadedError, match="tokens_per_minute") as caught:
        async with b.session(tenant) as s:
            await s.charge_tokens(200)  # 100 left of 600: the other router spent the rest
    assert 5_000 < caught.value.retry_after_ms <= 10_000  # ~100 tokens short at 10 a second
    with pytest.raises(RuntimeError):
        async with b.session(tenant) as s:
            await s.charge_tokens(100)
            raise RuntimeError("shed by admission")  # never admitted: its tokens go back
    await b.flush()
    async with a.session(tenant) as s:
        await s.charge_tokens(100)  # there only because b gave its 100 back
        s.admitted()
    with pytest.raises(OverloadedError):
        async with b.session(tenant) as s:
            await s.charge_tokens(60)


async def test_concurrent_streams_are_counted_across_routers(routers):
    a, b = routers
    tenant = Tenant("team-a", "streams", max_concurrent=2)
    first, second = a.session(tenant), b.session(tenant)
    await first.__aenter__()
    await second.__aenter__()
    with pytest.raises(OverloadedError, match="has 2 streams open") as caught:
        async with a.session(tenant):
            pass
    assert caught.value.retry_after_ms == 1000
    await first.__aexit__(None, None, None)
    await a.flush()
    async with b.session(tenant):  # the slot a's stream held
        pass
    await second.__aexit__(None, None, None)


async def test_a_dead_routers_lease_expires_while_a_live_ones_is_renewed(server):
    dead, live, other = (RedisQuotas(server.url, budget_s=BUDGET_S, lease_s=1.5) for _ in range(3))
    gone, kept = Tenant("t", "dead-lease", max_concurrent=1), Tenant("t", "live-lease", max_concurrent=1)
    held: list[QuotaSession] = [dead.session(gone), live.session(kept)]
    try:
        for s in held:
            await s.__aenter__()
        await dead.close()  # it stops without ending its stream: nothing renews or removes the lease
        assert not await admitted(other, gone)
        start = time.monotonic()
        while not await admitted(other, gone):
            assert time.monotonic() - start < 20, "the dead router's lease never expired"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)  # the live router's stream outlives its first lease: renewed, its slot stays taken
        assert not await admitted(other, kept)
    finally:
        await held[1].__aexit__(None, None, None)
        await live.close()
        await other.close()


silent_url = pytest.fixture(silent)


async def test_an_unanswering_redis_leaves_each_router_its_own_limits_within_the_budget(silent_url, caplog):
    quotas = RedisQuotas(silent_url, budget_s=0.05, retry_s=30)
    tenant = Tenant("t", "k", requests_per_second=2, tokens_per_minute=600, max_concurrent=5)
    outcomes, slowest = [], 0.0
    with caplog.at_level(logging.WARNING, logger="pdserve.security.redis_quotas"):
        for _ in range(4):
            start = time.monotonic()
            try:
                await quotas.take_request(tenant)
                async with quotas.session(tenant) as s:
                    await s.charge_tokens(100)
                    s.admitted()
                outcomes.append("ok")
            except OverloadedError as e:
                outcomes.append(e.retry_after_ms)
            slowest = max(slowest, time.monotonic() - start)
        await quotas.close()
    assert outcomes[:2] == ["ok", "ok"] and all(isinstance(o, int) and 0 < o <= 500 for o in outcomes[2:])
    assert slowest < 1.0, f"a quota call took {slowest:.2f} s against a budget of 0.05 s"
    messages = [r.getMessage() for r in caplog.records]
    assert sum("enforcing API-key limits per router" in m for m in messages) == 1


async def test_a_router_returns_to_the_shared_limits_when_redis_answers_again(caplog):
    server = RedisServer()
    server.start()
    a = b = None
    try:
        a, b = (RedisQuotas(server.url, budget_s=BUDGET_S, retry_s=0.2) for _ in range(2))
        tenant = Tenant("t", "k", max_concurrent=1)
        server.stop()
        with caplog.at_level(logging.WARNING, logger="pdserve.security.redis_quotas"):
            async with a.session(tenant), b.session(tenant):  # each router's own count: one each
                pass
            server.start()
            start = time.monotonic()
            while a._down_since is not None or b._down_since is not None:  # their pings get an answer
                assert time.monotonic() - start < 20, "a router never returned to the shared limits"
                await asyncio.sleep(0.05)
            async with a.session(tenant):
                assert not await admitted(b, tenant)  # the one slot is shared again
        messages = [r.getMessage() for r in caplog.records]
        assert sum("enforcing API-key limits per router" in m for m in messages) == 2  # once per router
        assert sum("cluster-wide again" in m for m in messages) == 2
    finally:
        for q in (a, b):
            if q is not None:
                await q.close()
        server.stop()


async def test_requests_that_miss_the_budget_together_start_one_probe(silent_url, caplog):
    quotas = RedisQuotas(silent_url, budget_s=0.05, retry_s=30, log_every_s=0)  # each outage's warning counts
    tenant = Tenant("t", "k", tokens_per_minute=600)
    with caplog.at_level(logging.WARNING, logger="pdserve.security.redis_quotas"):
        await asyncio.gather(*(quotas.take_tokens(tenant, 1) for _ in range(3)))  # all in flight as Redis goes
        probes = [t for t in asyncio.all_tasks() if t.get_name() == "quota-redis-probe"]
        await quotas.close()
    assert len(probes) == 1
    messages = [r.getMessage() for r in caplog.records]
    assert sum("enforcing API-key limits per router" in m for m in messages) == 1


@contextlib.asynccontextmanager
async def stalled_redis(server: RedisServer, quotas: RedisQuotas, more_s: float = 0.0) -> AsyncIterator[None]:
    """Redis stands still (SIGSTOP) while the body runs and `more_s` after, so its calls miss the budget, and runs them
    then; then waits until the router is back on the shared count, its background writes done. (A DEBUG SLEEP
    sent from a thread might not have begun by the time the body's call went out on a busy host.)"""
    with server.stopped():
        yield
        await asyncio.sleep(more_s)
    end = time.monotonic() + 5
    while quotas._down_since is not None or quotas._writes:
        assert time.monotonic() < end
        await asyncio.sleep(0.05)


async def missing_its_answer(
    how: str, server: RedisServer, quotas: RedisQuotas, call: Awaitable[object], more_s: float = 0.0
) -> None:
    """Redis stalls while `call` runs: the call misses the router's budget ("budget": the router falls back on its
    own limits) or its caller hangs up first ("cancelled"); either way it reached Redis, which runs it on waking."""
    async with stalled_redis(server, quotas, more_s):
        task = asyncio.ensure_future(call)
        if how == "cancelled":
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            await task


def quotas_for(how: str, server: RedisServer) -> RedisQuotas:
    with server.client() as c:
        c.flushall()
    # "cancelled": the caller, not the budget, gives up.
    return RedisQuotas(server.url, budget_s=2.0) if how == "cancelled" else RedisQuotas(server.url, 0.05, retry_s=0.1)


@pytest.mark.parametrize("how", ["budget", "cancelled"])
async def test_a_stream_open_that_missed_its_answer_leaves_no_slot_behind(server, how: str):
    """The lease Redis adds when it runs the open is removed, so the key's one slot is free again, not held for a
    lease no router renews."""
    quotas, tenant = quotas_for(how, server), Tenant("t", "k", max_concurrent=1)

    async def open_and_close() -> None:
        (await quotas.open_stream(tenant))()

    try:
        assert await admitted(quotas, tenant)  # as in a running router: its connection made, its scripts loaded
        await missing_its_answer(how, server, quotas, open_and_close())
        with server.client() as c:
            assert c.zcard(f"pdserve:quota:{tenant.key_name}:streams") == 0
        assert await admitted(quotas, tenant)
    finally:
        await quotas.close()


@pytest.mark.parametrize("stopped_s", [0.0, 1.5])
@pytest.mark.parametrize("what", ["tokens", "requests"])
@pytest.mark.parametrize("how", ["budget", "cancelled"])
async def test_a_take_that_missed_its_answer_is_given_back_in_redis(server, how: str, what: str, stopped_s: float):
    """Past the budget the router charged the take against its own limits; cancelled, its caller left: either way
    the take Redis runs on waking is given back, so the key is not charged for it there, also when Redis stood still
    past the give-back's own write timeout (1 s; before, that give-back was lost, and the take counted twice). A
    request (before its body is parsed) is a take of its own, as its tokens are."""
    tokens = what == "tokens"
    tenant = Tenant("t", "k", tokens_per_minute=600) if tokens else Tenant("t", "k", requests_per_second=0.01)

    def take() -> Awaitable[object]:
        return quotas.take_tokens(tenant, 500) if tokens else quotas.take_request(tenant)

    quotas = quotas_for(how, server)
    try:
        await take()  # as in a running router: its connection made, its scripts loaded
        with server.client() as c:
            c.delete(quota_key(tenant, what))  # a full bucket again (600 tokens; one request)
        await missing_its_answer(how, server, quotas, take(), stopped_s)
        with server.client() as c:
            level = c.hget(quota_key(tenant, what), "level")
        assert level is None or float(level) > (590 if tokens else 0.99)  # 100 or 0 if the take stayed charged
    finally:
        await quotas.close()


async def test_a_take_that_reaches_redis_after_its_abandon_charges_nothing(server):
    """The other order of the two scripts: the abandon marks the take, which then takes nothing."""
    with server.client() as c:
        c.flushall()
    quotas = RedisQuotas(server.url)
    try:
        keys, args = ["pdserve:quota:k:tokens", "pdserve:quota:k:take:1"], [10.0 / 1000, 600, 500, 61_000, 10_000]
        await quotas._abandon_take(keys=keys, args=args)
        assert await quotas._take(keys=keys, args=args) == b"0"
        with server.client() as c:
            assert c.exists(keys[0]) == 0  # never written: a full bucket
            assert c.get(keys[1]) == b"abandoned"
    finally:
        await quotas.close()


async def test_a_redis_restarted_empty_gets_the_open_streams_leases_back(server):
    """A restart loses every lease: the renewal enters the streams still open again, or every router would open
    the key's whole limit beside them."""
    a, b = (RedisQuotas(server.url, budget_s=BUDGET_S, lease_s=0.6) for _ in range(2))
    tenant = Tenant("t", "restarted", max_concurrent=1)
    try:
        async with a.session(tenant):
            with server.client() as c:
                c.flushall()  # what a restart without persistence leaves
            await lease_back(server, tenant)
            assert not await admitted(b, tenant)
        await a.flush()  # the lease's removal, in the background
        assert await admitted(b, tenant)
    finally:
        await a.close()
        await b.close()


async def test_the_fallback_counts_the_streams_redis_admitted_and_redis_gets_the_fallbacks_back(caplog):
    """One router, max_concurrent 1: its stream admitted through Redis still counts once Redis stops answering
    (the local limits are over everything it serves); and a stream it admitted alone is entered in Redis once it
    answers, so another router does not open the key's slot beside it."""
    server = RedisServer()
    server.start()
    a = b = None
    tenant = Tenant("t", "fallback", max_concurrent=1)
    try:
        a, b = (RedisQuotas(server.url, budget_s=BUDGET_S, lease_s=0.6, retry_s=0.1) for _ in range(2))
        async with a.session(tenant):
            server.stop()
            assert not await admitted(a, tenant)  # the fallback sees the stream Redis admitted
        async with a.session(tenant):  # admitted alone, Redis still down
            server.start()
            start = time.monotonic()
            while a._down_since is not None:
                assert time.monotonic() - start < 20, "the router never saw Redis answer again"
                await asyncio.sleep(0.05)
            await lease_back(server, tenant)
            assert not await admitted(b, tenant)
    finally:
        for q in (a, b):
            if q is not None:
                await q.close()
        server.stop()


async def lease_back(server: RedisServer, tenant: Tenant) -> None:
    """Until a renewal has entered the tenant's open stream in Redis (each is due every lease_s / 3)."""
    start = time.monotonic()
    with server.client() as c:
        while not c.zcard(quota_key(tenant, "streams")):
            assert time.monotonic() - start < 20, "no renewal entered the stream's lease"
            await asyncio.sleep(0.05)


async def test_a_redis_restart_closing_every_pooled_connection_costs_no_fallback():
    """Each pooled connection fails its next call once Redis restarted; a router took that for an outage and
    enforced its own limits for seconds after Redis was back (a key of 3 streams opened 8 over two routers)."""
    server = RedisServer()
    server.start()
    quotas = RedisQuotas(server.url, budget_s=BUDGET_S, retry_s=30)
    tenant = Tenant("t", "pooled", max_concurrent=8)
    try:
        async with contextlib.AsyncExitStack() as open_:
            await asyncio.gather(*(open_.enter_async_context(quotas.session(tenant)) for _ in range(4)))
        server.stop()
        server.start()
        for _ in range(4):  # every connection the pool made before the restart
            async with quotas.session(tenant):
                assert quotas._down_since is None  # Redis answered: the limits stayed cluster-wide
    finally:
        await quotas.close()
        server.stop()


async def test_a_fallback_during_a_redis_answer_counts_the_stream_redis_is_admitting(server):
    """Router-local, max_concurrent 1: while one request waits for Redis's answer, another request's miss begins
    an outage; that one's local check must count the stream Redis is admitting (it admitted a second beside it)."""
    with server.client() as c:
        c.flushall()
    quotas = RedisQuotas(server.url, budget_s=BUDGET_S)
    tenant = Tenant("t", "racing", max_concurrent=1)
    answered, real_open = asyncio.Event(), quotas._open

    async def open_after_the_outage(*args, **kwargs):  # type: ignore[no-untyped-def]
        await answered.wait()
        return await real_open(*args, **kwargs)

    quotas._open = open_after_the_outage  # type: ignore[method-assign]
    try:
        first = asyncio.ensure_future(quotas.open_stream(tenant))
        await asyncio.sleep(0.05)  # asking Redis
        quotas._down_since = time.monotonic()  # another request's miss: the fallback answers from here
        with pytest.raises(OverloadedError, match="concurrent"):
            await quotas.open_stream(tenant)
        quotas._down_since = None
        answered.set()
        release = await first
        release()
        assert quotas.local._state(tenant).streams == 0
    finally:
        await quotas.close()
