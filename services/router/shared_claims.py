"""KV claims shared by the routers of one Redis registry (kv_claims.py), so that a claim holds against every router's
requests: with two routers behind one Service, small requests through the other router would otherwise take the
blocks a claimant waits for, and its retries, reaching either router, would claim twice.

One hash, `pdserve:kv_claims`: decode worker id -> "<blocks> <until, Unix ms>". Every `VIEW_REFRESH_S` a router
writes the claims it set, renewed or ended since its last write and reads every router's into its own view, in one
round trip on a background task; requests read only that view and never wait on Redis. The last write of a worker's
claim wins: two routers that claim one worker at once leave one claim, and a claim renewed just as another router's
admission ended it holds until it lapses (a few retry hints). Expired entries are dropped by whichever router reads
them. Lapses are in Unix time, so they hold as long as the routers' clocks agree within a fraction of a second (NTP
keeps a cluster's within milliseconds). While Redis does not answer, each router keeps its own claims and writes its
changes once it does; a Redis restarted empty ends the claims written before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pdserve.background import cancel_and_wait
from pdserve.registry.base import VIEW_REFRESH_S
from pdserve.registry.redis import PREFIX, TIMEOUT_S, Throttled, connect_async
from services.router.kv_claims import Claim, KVClaims

log = logging.getLogger(__name__)
CLAIMS_KEY = f"{PREFIX}:kv_claims"


class SharedKVClaims:
    def __init__(
        self,
        url: str,
        claims: KVClaims,
        interval_s: float = VIEW_REFRESH_S,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.claims = claims
        claims.shared = True
        self.wall_clock = wall_clock  # the Unix time the routers' entries share; each process's claims keep their own
        self.interval_s = interval_s
        self._redis = connect_async(url)  # its connections belong to the loop that first uses it
        self._stale: set[str] = set()  # fields read expired or malformed: dropped with the next write
        self._malformed: set[str] = set()  # logged once each while they stay
        self._warn = Throttled(30.0, log)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="shared-kv-claims")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        await self.sync()  # a claim ended here on the way out ends for the other routers too
        await self._redis.aclose()

    async def sync(self) -> bool:
        """Writes this router's changes and takes every router's claims; False when Redis did not answer."""
        changes = self.claims.take_changes()
        try:
            async with asyncio.timeout(2 * TIMEOUT_S):
                shared = await self._exchange(changes)
        except BaseException as e:
            self.claims.put_back(set(changes))  # written next time (close() cancels a sync mid-way), as they are then
            if not isinstance(e, Exception):
                raise
            # Unreachable or stalled: this router's claims hold here meanwhile.
            self._warn.warning("KV claims not shared through redis, each router keeps its own meanwhile: %r", e)
            return False
        self.claims.merge(shared)
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.sync()

    async def _exchange(self, changes: dict[str, Claim | None]) -> dict[str, Claim]:
        """One pipeline writes `changes` and reads the hash, whose Unix times become the claims' clock's (each
        process's own monotonic one)."""
        wall, mono = self.wall_clock(), self.claims.clock()
        written = {w: f"{c.blocks} {round((wall + c.until - mono) * 1000)}" for w, c in changes.items() if c}
        dropped = [w for w, c in changes.items() if c is None] + sorted(self._stale - set(written))
        async with self._redis.pipeline() as pipe:
            if written:
                pipe.hset(CLAIMS_KEY, mapping=written)
            if dropped:
                pipe.hdel(CLAIMS_KEY, *dropped)
            pipe.hgetall(CLAIMS_KEY)
            values: dict[bytes, bytes] = (await pipe.execute())[-1]
        self._stale -= set(dropped)
        shared: dict[str, Claim] = {}
        malformed: set[str] = set()
        for field, value in values.items():
            worker_id = field.decode(errors="replace")
            try:
                claim = _parse(value, wall, mono)
            except ValueError as e:  # anyone with access to Redis may write one
                malformed.add(worker_id)
                if worker_id not in self._malformed:
                    log.error("%s: entry %r = %.100r dropped: %s", CLAIMS_KEY, worker_id, value, e)
                claim = None
            if claim is None:
                self._stale.add(worker_id)
            else:
                shared[worker_id] = claim
        self._malformed = malformed
        return shared


def _parse(value: bytes, wall: float, mono: float) -> Claim | None:
    """A live claim on this process's monotonic clock, or None once expired."""
    try:
        blocks, until_ms = (int(x) for x in value.split())
    except ValueError:
        raise ValueError("not '<blocks> <until, Unix ms>'") from None
    if blocks <= 0:
        raise ValueError(f"{blocks} blocks")
    left_s = until_ms / 1000 - wall
    return Claim(blocks, mono + left_s) if left_s > 0 else None
