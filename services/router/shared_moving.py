"""Streams moving to another decode worker, counted across the routers of one Redis registry. Admission leaves a moving
stream the next free place in a decode batch (lifecycle.py); a stream moving through one router must be left it by the
other routers' new requests too: a soak saw one router admit new requests into the places another's ten moving streams
waited for, and those streams failed mid-answer.

One hash, `pdserve:moving`: router id -> "<streams> <until>" (Unix ms on Redis's clock). Every `VIEW_REFRESH_S` a router
writes its own count (deletes its entry once none moves) and reads the others' in one round trip on a background task;
requests read only the sum. An entry holds until `until`, LAPSE_INTERVALS refreshes on, so a router gone counts no more.
While Redis does not answer, the entries last read hold until they lapse. An entry lapsed more than FORGET_AFTER_S ago
(its router crashed) is deleted at the next sync of a router that read it; should its router write again just before, it
writes the entry anew one interval later. Times are Redis's (`TIME`, read in the transaction that reads the hash;
redis_clock.py), as the KV claims' are, so the routers' own clocks never meet: with a router's clock over a second
behind (an entry lapses a second on), the others read its moving streams lapsed and filled the places they waited for. A
router of an earlier build writes its own clock's Unix time: while one runs, the routers' clocks must agree (NTP).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from pdserve.background import cancel_and_wait, repeating
from pdserve.registry.base import VIEW_REFRESH_S
from pdserve.registry.redis import PREFIX, TIMEOUT_S, connect_async
from pdserve.registry.redis_clock import RedisClock
from pdserve.throttled_log import Throttled
from services.router.load_tracker import LoadTracker

log = logging.getLogger(__name__)
MOVING_KEY = f"{PREFIX}:moving"
LAPSE_INTERVALS = 4
MAX_STREAMS = 1 << 20  # more than any router holds: an entry that says more is no router's
FORGET_AFTER_S = 60.0  # far past any refresh's delay (and an earlier build's clock): a router this late has stopped


class SharedMoving:
    def __init__(
        self,
        url: str,
        tracker: LoadTracker,
        interval_s: float = VIEW_REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
        redis_clock: RedisClock | None = None,
    ) -> None:
        self.tracker = tracker
        self.router_id = uuid.uuid4().hex
        self.interval_s = interval_s
        self.clock = clock  # what carries Redis's time between reads
        self.redis_clock = redis_clock or RedisClock()  # the time the routers' entries share
        self._redis = connect_async(url)  # its connections belong to the loop that first uses it
        self._others: dict[str, tuple[int, int]] = {}  # router id -> (streams, until in Redis's ms), as last read
        self._forget: list[str] = []  # ids of entries long lapsed when last read, deleted at the next sync
        self._written = False
        self._warn = Throttled(30.0, log)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.sync()
        self._task = repeating(self.sync, self.interval_s, "shared-moving")

    async def close(self) -> None:
        try:
            await cancel_and_wait(self._task)
            if self._written:
                async with asyncio.timeout(2 * TIMEOUT_S):
                    await self._redis.hdel(MOVING_KEY, self.router_id)
        except Exception as e:  # its entry lapses on its own
            log.info("could not remove this router's moving streams from redis: %r", e)
        finally:
            await self._redis.aclose()

    async def sync(self) -> bool:
        """Writes this router's count and reads the others'; False when Redis did not answer (the counts last read
        hold until they lapse)."""
        moving = self.tracker.moving
        try:
            async with asyncio.timeout(2 * TIMEOUT_S), self._redis.pipeline() as pipe:
                now = self.redis_clock.at(local := self.clock())
                if now is None:  # Redis's time not read yet: what is written is in it
                    now = self.redis_clock.read(await self._redis.time(), local)
                if moving:
                    until_ms = round(now * 1000) + round(LAPSE_INTERVALS * self.interval_s * 1000)
                    pipe.hset(MOVING_KEY, self.router_id, f"{moving} {until_ms}")
                    self._written = True  # before the answer: a write cut short by a timeout or `close` may have landed
                elif self._written:
                    pipe.hdel(MOVING_KEY, self.router_id)
                if self._forget:
                    pipe.hdel(MOVING_KEY, *self._forget)
                pipe.time()
                pipe.hgetall(MOVING_KEY)
                *_, answer, values = await pipe.execute()
            now_ms = round(self.redis_clock.read(answer, self.clock()) * 1000)
            self._written = bool(moving)
            self._others = _parse(values, self.router_id)
            forget_ms = now_ms - round(FORGET_AFTER_S * 1000)
            self._forget = [router_id for router_id, (_, until) in self._others.items() if until < forget_ms]
            ok = True
        except Exception as e:
            self._warn.warning("moving streams not shared through redis: %r", e)
            ok = False
        now = self.redis_clock.at(self.clock())  # the entries last read lapse while Redis does not answer
        self.tracker.moving_elsewhere = sum(
            n for n, until in self._others.values() if now is not None and until > now * 1000
        )
        return ok


def _parse(values: dict[bytes, bytes], own: str) -> dict[str, tuple[int, int]]:
    """The other routers' entries; one that does not parse (anyone with access to Redis may write one) is skipped."""
    others: dict[str, tuple[int, int]] = {}
    for field, value in values.items():
        router_id = field.decode(errors="replace")
        if router_id == own:
            continue
        try:
            streams, until_ms = (int(x) for x in value.split())
        except ValueError:
            log.debug("%s: entry %r = %.100r skipped", MOVING_KEY, router_id, value)
            continue
        if 0 < streams <= MAX_STREAMS:
            others[router_id] = (streams, until_ms)
    return others
