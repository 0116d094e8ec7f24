"""Moving streams counted across routers through a real redis-server (services/router/shared_moving.py): a stream
moving through one router is left a place by the other router's new requests; a router's count ends when its
streams stop moving, lapses when the router is gone (and its entry is deleted long after), and an entry that does not
parse is skipped."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest
import redis

from services.router.shared_moving import FORGET_AFTER_S, LAPSE_INTERVALS, MOVING_KEY, SharedMoving
from tests.redis_server import emptied, started
from tests.unit.hand_clock import HandRedisClock
from tests.unit.router.router_builder import Router, prompt, shed, worker

pytestmark = pytest.mark.timeout(60)
server = pytest.fixture(scope="module")(started)
url = pytest.fixture(emptied)
INTERVAL_S = 0.25


class Pair:
    """Two routers over one decode worker with one free place in its batch, sharing their moving streams through
    `url` in Redis's time, moved by hand (`moved`) with each router's own clock (the second's a day on)."""

    def __init__(self, url: str) -> None:
        self.url, self.moved = url, [0.0]
        one_free = worker("d0", "decode", sequences=3, max_num_seqs=4)
        self.a, self.b = Router([worker("p0"), one_free]), Router([worker("p0"), one_free])
        self.loop = asyncio.new_event_loop()  # where the Redis connections live (Router.admit runs its own)
        self.shared = [
            SharedMoving(url, r.tracker, INTERVAL_S, clock, HandRedisClock(lambda: self.moved[0]))
            for r, clock in ((self.a, lambda: self.moved[0]), (self.b, lambda: self.moved[0] + 86400.0))
        ]

    def shared_time(self) -> float:
        """Redis's time as the routers read it: its `TIME`, moved on by hand."""
        with redis.Redis.from_url(self.url) as client:
            seconds, micros = client.time()
        return seconds + micros / 1e6 + self.moved[0]

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.loop.run_until_complete(coro)

    def sync(self, *which: int) -> None:
        for i in which:
            assert self.run(self.shared[i].sync())


@pytest.fixture
def pair(server, url: str) -> Iterator[Pair]:
    p = Pair(url)
    yield p
    for s in p.shared:
        p.run(s.close())
    p.loop.close()


def test_a_stream_moving_through_one_router_is_left_its_place_by_the_others_new_requests(pair, url):
    pair.b.admit(prompt(16))  # the free place is there
    pair.a.tracker.moving = 1  # a stream of a's lost its decode worker and waits for a place
    pair.sync(0, 1)
    assert (pair.a.tracker.moving_elsewhere, pair.b.tracker.moving_elsewhere) == (0, 1)
    shed(pair.b, prompt(16), "no decode worker has room in its batch")
    pair.a.tracker.moving = 0  # it moved
    pair.sync(0, 1)
    assert pair.b.tracker.moving_elsewhere == 0
    pair.b.admit(prompt(16))
    with redis.Redis.from_url(url) as c:
        assert c.hgetall(MOVING_KEY) == {}  # an entry only while streams move


def test_a_gone_routers_count_lapses_and_an_entry_that_does_not_parse_is_skipped(pair, url):
    pair.a.tracker.moving = 2
    pair.sync(0)  # then a writes no more, as a router gone
    with redis.Redis.from_url(url) as c:
        c.hset(MOVING_KEY, mapping={"junk": "many", "huge": f"{1 << 40} {int(pair.shared_time() * 1000) + 60_000}"})
    pair.sync(1)
    assert pair.b.tracker.moving_elsewhere == 2
    pair.moved[0] += LAPSE_INTERVALS * INTERVAL_S + 0.01
    pair.sync(1)
    assert pair.b.tracker.moving_elsewhere == 0
    pair.b.admit(prompt(16))


def test_started_routers_share_their_counts_every_interval(pair, url):
    """`start` reads once, then its background task writes and reads every interval; `close` deletes the entry."""
    for s in pair.shared:
        pair.run(s.start())
    pair.a.tracker.moving = 3

    async def until_shared() -> None:
        while pair.b.tracker.moving_elsewhere != 3:
            await asyncio.sleep(INTERVAL_S / 5)

    pair.run(asyncio.wait_for(until_shared(), 20))
    pair.run(pair.shared[0].close())
    pair.shared.pop(0)
    with redis.Redis.from_url(url) as c:
        assert c.hgetall(MOVING_KEY) == {}


def test_a_crashed_routers_entry_is_deleted_by_another_router_long_after_it_lapsed(pair, url):
    pair.a.tracker.moving = 2
    pair.sync(0)  # a crashes: it never deletes its entry
    pair.moved[0] += LAPSE_INTERVALS * INTERVAL_S + 1
    pair.sync(1, 1)
    with redis.Redis.from_url(url) as c:
        assert c.hexists(MOVING_KEY, pair.shared[0].router_id)  # lapsed, but kept while a clock may lag
        pair.moved[0] += FORGET_AFTER_S
        pair.sync(1, 1)  # the first sync reads it long lapsed, the next deletes it
        assert c.hgetall(MOVING_KEY) == {}


def test_a_write_cut_short_by_close_is_deleted_by_close(pair, url):
    """A sync cancelled (as `close` cancels its background one) after its write reached Redis, before its answer
    came back: `close` still removes the entry (it stayed, counted until it lapsed, until another router forgot it;
    the CI run of the test above saw it)."""
    first = pair.shared[0]
    pair.a.tracker.moving = 2
    sync = pair.loop.create_task(first.sync())
    with redis.Redis.from_url(url) as c:
        while not c.hexists(MOVING_KEY, first.router_id):  # blocks the loop: the answer waits unread
            assert not sync.done()
            pair.loop.stop()  # then run_forever runs one iteration: an answer read in it resumes sync in the next
            pair.loop.run_forever()
        sync.cancel()
        pair.run(first.close())
        pair.shared.pop(0)
        pair.run(asyncio.gather(sync, return_exceptions=True))
        assert c.hgetall(MOVING_KEY) == {}
