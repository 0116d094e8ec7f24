"""KV claims shared through a real redis-server (services/router/shared_claims.py): two routers' predictors,
placement and admission over one decode worker, as the chart's two router replicas see it. A claim one router set
holds against the other's small requests, the claimant's retry through the other renews it, its admission through
either ends it for both; without Redis each keeps its own and writes it once Redis is back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator

import pytest
import redis

from services.router.kv_claims import CLAIM_MIN_S, CLAIM_RETRY_HINTS, KVClaims
from services.router.shared_claims import CLAIMS_KEY, SharedKVClaims
from tests.redis_server import RedisServer, emptied, started
from tests.unit.hand_clock import HandRedisClock
from tests.unit.router.router_builder import Router, prompt, replace_free, shed, worker

pytestmark = pytest.mark.timeout(60)
server = pytest.fixture(scope="module")(started)
url = pytest.fixture(emptied)
LARGE, SMALL = prompt(800), prompt(16)  # 51 blocks with 16 new tokens, 2 blocks
SLO_S = (5.0, 1.0)
LARGE_REFUSED = "51 free KV blocks now$"
SMALL_HELD_OFF = "2 free KV blocks now that an earlier, larger request did not get"


class Pair:
    """Two routers over one decode worker, their claims each on its own clock (a router's monotonic clock starts
    anywhere: the second's a day on), both moved by hand, and shared through `url` in Redis's time, moved with them."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.now = [1000.0]
        self.d0 = worker("d0", "decode", kv_blocks_free=40)
        self.routers = (Router([worker("p0"), self.d0]), Router([worker("p0"), self.d0]))
        self.loop = asyncio.new_event_loop()  # where the shared claims' Redis connections live
        self.shared: list[SharedKVClaims] = []
        clocks = (lambda: self.now[0], lambda: self.now[0] + 86400.0)
        for r, clock in zip(self.routers, clocks, strict=True):
            r.predictor.claims = KVClaims(clock=clock)
            self.shared.append(SharedKVClaims(url, r.predictor.claims, redis_clock=self.redis_clock()))

    def redis_clock(self) -> HandRedisClock:
        return HandRedisClock(lambda: self.now[0] - 1000.0)

    def shared_time(self) -> float:
        """Redis's time as the routers read it: its `TIME`, moved on with their clocks."""
        with redis.Redis.from_url(self.url) as client:
            seconds, micros = client.time()
        return seconds + micros / 1e6 + self.now[0] - 1000.0

    def sync(self) -> list[bool]:
        """Each router writes what it changed and reads both routers', in turn, twice (as their background tasks
        would in two intervals): the first router reads what the second wrote. Whether Redis answered each."""

        async def both() -> list[bool]:
            return [await s.sync() for s in self.shared]

        self.loop.run_until_complete(both())
        return self.loop.run_until_complete(both())

    def free(self, blocks: int) -> None:
        for r in self.routers:
            r.registry.publish(replace_free(self.d0, blocks))

    def close(self) -> None:
        async def all_closed() -> None:
            for s in self.shared:
                await s.close()

        self.loop.run_until_complete(all_closed())
        self.loop.close()


@pytest.fixture
def pair(server: RedisServer, url: str) -> Iterator[Pair]:
    p = Pair(url)
    yield p
    p.close()


def starve(r: Router, now: list[float]) -> float:
    """The large request refused through `r` every 0.9 s past its 5 s TTFT SLO: it claims d0 at the last refusal.
    Returns how long the claim lasts without a retry."""
    for _ in range(7):
        hint_s = shed(r, LARGE, LARGE_REFUSED, slo_s=SLO_S).retry_after_ms / 1e3
        now[0] += 0.9
    now[0] -= 0.9
    return max(CLAIM_MIN_S, CLAIM_RETRY_HINTS * hint_s)


def shared_hash(server: RedisServer) -> dict[bytes, bytes]:
    with server.client() as client:
        return client.hgetall(CLAIMS_KEY)


def test_a_claim_through_one_router_holds_on_the_other_is_renewed_there_and_ends_with_its_admission(pair, server):
    a, b = pair.routers
    lasts_s = starve(a, pair.now)
    assert b.admit(SMALL, slo_s=SLO_S).decode.worker_id == "d0"  # b has not heard of it yet
    assert pair.sync() == [True, True]
    shed(b, SMALL, SMALL_HELD_OFF, slo_s=SLO_S)
    pair.now[0] += lasts_s * 0.9
    shed(b, LARGE, LARGE_REFUSED, slo_s=SLO_S)  # the claimant's retry reaches b: it renews a's claim, adds none
    pair.sync()
    pair.now[0] += lasts_s * 0.5  # past the claim's first lapse
    shed(a, SMALL, SMALL_HELD_OFF, slo_s=SLO_S)
    assert list(shared_hash(server)) == [b"d0"]  # one claim for one claimant
    pair.free(60)  # streams on d0 ended
    assert b.admit(LARGE, slo_s=SLO_S).decode.worker_id == "d0"
    pair.free(9)  # what the large one left
    shed(a, SMALL, SMALL_HELD_OFF, slo_s=SLO_S)  # a has not heard yet
    pair.sync()
    assert a.admit(SMALL, slo_s=SLO_S).decode.worker_id == "d0"
    assert shared_hash(server) == {}


def test_without_redis_each_router_keeps_its_own_claims_and_shares_them_once_redis_is_back(pair, server, caplog):
    a, b = pair.routers
    server.stop()
    with caplog.at_level(logging.WARNING, logger="services.router.shared_claims"):
        starve(a, pair.now)
        assert pair.sync() == [False, False]
    assert "KV claims not shared through redis" in caplog.text
    shed(a, SMALL, SMALL_HELD_OFF, slo_s=SLO_S)  # a's own claim holds there
    assert b.admit(SMALL, slo_s=SLO_S).decode.worker_id == "d0"
    server.start()
    assert pair.sync() == [True, True]
    shed(b, SMALL, SMALL_HELD_OFF, slo_s=SLO_S)


def test_expired_and_malformed_entries_are_dropped_and_a_malformed_one_is_logged(pair, server, caplog):
    ms = round(pair.shared_time() * 1000)
    entries = {"d0": f"51 {ms + 60_000} {ms}", "d1": f"20 {ms - 1} {ms - 9}", "d2": "many", "d3": f"0 {ms} {ms}"}
    entries |= {"d4": f"1 {'9' * 400} {ms}", "d5": f"5 {ms + 10**7} {ms}", "d6": f"5 {ms + 1} {'9' * 400}"}
    entries |= {"d7": f"5 {ms + 60_000}"}  # no float holds d4's end or d6's start; d5 ends past any claim's end
    with server.client() as client:
        client.hset(CLAIMS_KEY, mapping=entries)
    with caplog.at_level(logging.ERROR, logger="services.router.shared_claims"):
        pair.sync()
    for field, says in [("d2", "not '<blocks> <until> <since>'"), ("d3", "0 blocks"), ("d4", "past any claim's")]:
        assert f"{field!r} = " in caplog.text and says in caplog.text
    assert "'d5' = " in caplog.text and "'d6' = " in caplog.text and "is no Unix time" in caplog.text
    assert "'d7' = " in caplog.text  # a claim without its claimant's first refusal
    assert "'d1'" not in caplog.text  # expired: not an error
    claims = pair.routers[0].predictor.claims
    assert [claims.held_from(f"d{i}", 2) for i in range(8)] == [51, 0, 0, 0, 0, 0, 0, 0]
    pair.sync()
    assert set(shared_hash(server)) == {b"d0"}


def test_a_router_deletes_no_claim_it_has_not_seen(pair, server):
    """An entry one router read expired, and which another router's new claim took over meanwhile, stays."""
    a, b = pair.shared
    ms = round(pair.shared_time() * 1000)
    with server.client() as client:
        client.hset(CLAIMS_KEY, "d0", f"20 {ms - 1} {ms - 9}")
    assert pair.loop.run_until_complete(a.sync())  # read expired: a deletes it with its next write
    pair.routers[1].predictor.claims.claim("d0", 30, retry_after_s=1.0, after_s=0.0)
    assert pair.loop.run_until_complete(b.sync())
    assert pair.loop.run_until_complete(a.sync())
    assert shared_hash(server)[b"d0"].startswith(b"30 ")
    assert pair.routers[0].predictor.claims.held_from("d0", 2) == 30


def test_a_sync_cancelled_midway_leaves_its_changes_for_the_next(pair, server):
    """As close() cancels the background task's sync: what it took is written by close()'s own."""
    pair.routers[0].predictor.claims.claim("d0", 50, retry_after_s=1.0, after_s=0.0)
    stalled = threading.Thread(target=stall, args=(server, 0.5))

    async def cancelled() -> None:
        stalled.start()
        await asyncio.sleep(0.1)  # Redis is asleep
        sync = asyncio.ensure_future(pair.shared[0].sync())
        await asyncio.sleep(0.1)
        sync.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sync

    pair.loop.run_until_complete(cancelled())
    stalled.join()
    assert shared_hash(server) == {}
    assert pair.sync() == [True, True]
    assert list(shared_hash(server)) == [b"d0"]


def stall(server: RedisServer, seconds: float) -> None:
    with server.client() as client:
        client.execute_command("DEBUG", "SLEEP", str(seconds))


def test_a_router_starts_with_the_claims_the_others_hold(pair, server):
    """A router rolled in takes the claims before it serves, not an interval later."""
    ms = round(pair.shared_time() * 1000)
    with server.client() as client:
        client.hset(CLAIMS_KEY, "d0", f"51 {ms + 60_000} {ms}")
    claims = KVClaims(clock=lambda: pair.now[0])
    joining = SharedKVClaims(server.url, claims, interval_s=3600, redis_clock=pair.redis_clock())
    pair.loop.run_until_complete(joining.start())
    try:
        assert claims.held_from("d0", 2) == 51
    finally:
        pair.loop.run_until_complete(joining.close())
