"""KV claims shared by the routers of one Redis registry (kv_claims.py), so that a claim holds against every router's
requests: with two routers behind one Service, small requests through the other router would otherwise take the blocks a
claimant waits for, and its retries, reaching either router, would claim twice.

One hash, `pdserve:kv_claims`: decode worker id -> "<blocks> <until> <since>" (Unix ms on Redis's clock: when the claim
lapses, when its claimant was first refused). Every `VIEW_REFRESH_S` a router writes the claims it set, renewed or ended
since its last write and reads every router's into its own view, in one round trip on a background task; requests read
only that view and never wait on Redis. A set or renewed claim is written over whatever the worker's entry holds; an
ended or expired one is deleted only if the entry still holds what this router last read or wrote there, so no router
deletes a claim it has not seen (another router's new one on the same worker). A claim renewed just as another router's
admission ended it holds until it lapses (a few retry hints), and so does one whose claimant another router admitted
before it had read the claim. Times are Redis's (`TIME`, read in the transaction that reads the hash; redis_clock.py),
so the routers' own clocks never meet: with a router's 30 s off, its claims were read lapsed by routers ahead (and
deleted) or held 30 s too long by those behind. A router of an earlier build writes its own clock's Unix time: while one
runs, the routers' clocks must agree (NTP). While Redis does not answer, each router keeps its own claims and writes its
changes once it does; a Redis restarted empty ends the claims written before.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.background import cancel_and_wait, repeating
from pdserve.registry.base import VIEW_REFRESH_S
from pdserve.registry.redis import PREFIX, TIMEOUT_S, connect_async
from pdserve.registry.redis_clock import RedisClock
from pdserve.throttled_log import Throttled
from services.router.admission import MAX_RETRY_MS
from services.router.kv_claims import CLAIM_RETRY_HINTS, Claim, KVClaims

log = logging.getLogger(__name__)
CLAIMS_KEY = f"{PREFIX}:kv_claims"
# The longest a claim may have left: four of the longest retry hints, and a minute for the clocks of routers of an
# earlier build, which write their own. An entry that says more is no router's (one far in the future would hold its
# worker's blocks back for as long).
HORIZON_MS = CLAIM_RETRY_HINTS * MAX_RETRY_MS + 60_000
# Deletes each field whose value is still the one given: what another router wrote there since stays.
_DELETE_IF_UNCHANGED = """
local deleted = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    deleted = deleted + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return deleted
"""


class SharedKVClaims:
    def __init__(
        self,
        url: str,
        claims: KVClaims,
        interval_s: float = VIEW_REFRESH_S,
        redis_clock: RedisClock | None = None,
    ) -> None:
        self.claims = claims
        claims.shared = True
        self.redis_clock = redis_clock or RedisClock()  # the time the routers' entries share, on the claims' clock
        self.interval_s = interval_s
        self._redis = connect_async(url)  # its connections belong to the loop that first uses it
        self._known: dict[str, bytes] = {}  # each field's value as this router last read or wrote it
        self._stale: set[str] = set()  # fields read expired or malformed: deleted with the next write, if unchanged
        self._malformed: set[str] = set()  # logged once each while they stay
        self._warn = Throttled(30.0, log)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """The other routers' claims before serving (an unreachable Redis costs one timeout), then every interval."""
        await self.sync()
        self._task = repeating(self.sync, self.interval_s, "shared-kv-claims")

    async def close(self) -> None:
        try:
            await cancel_and_wait(self._task)
            await self.sync()  # a claim ended here on the way out ends for the other routers too
        finally:
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

    async def _exchange(self, changes: dict[str, Claim | None]) -> dict[str, Claim]:
        """One transaction writes `changes` and reads the hash with Redis's time, whose times become the claims'
        clock's (each process's own monotonic one)."""
        mono = self.claims.clock()
        shared_now = self.redis_clock.at(mono)
        if shared_now is None:  # Redis's time not read yet: what is written is in it
            answer = await self._redis.time()
            shared_now = self.redis_clock.read(answer, mono := self.claims.clock())
        written = {w: _entry(c, shared_now, mono) for w, c in changes.items() if c}
        ended = {w for w, c in changes.items() if c is None} | (self._stale - set(written))
        deleted = [x for w in sorted(ended) if w in self._known for x in (w, self._known[w])]
        async with self._redis.pipeline() as pipe:
            if written:
                pipe.hset(CLAIMS_KEY, mapping=written)  # type: ignore[arg-type]  # redis-py's Mapping key is invariant
            if deleted:
                pipe.eval(_DELETE_IF_UNCHANGED, 1, CLAIMS_KEY, *deleted)
            pipe.time()
            pipe.hgetall(CLAIMS_KEY)
            *_, answer, values = await pipe.execute()
        mono = self.claims.clock()
        shared_now = self.redis_clock.read(answer, mono)
        self._stale -= ended
        self._known = {field.decode(errors="replace"): value for field, value in values.items()}
        shared: dict[str, Claim] = {}
        malformed: set[str] = set()
        for worker_id, value in self._known.items():
            try:
                claim = _parse(value, shared_now, mono)
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


def _entry(claim: Claim, shared_now: float, mono: float) -> bytes:
    until, since = (round((shared_now + t - mono) * 1000) for t in (claim.until, claim.since))
    return f"{claim.blocks} {until} {since}".encode()


def _parse(value: bytes, shared_now: float, mono: float) -> Claim | None:
    """A live claim on this process's monotonic clock, or None once expired; `shared_now` is Redis's time at `mono`."""
    try:
        blocks, until_ms, since_ms = (int(x) for x in value.split())
    except ValueError:
        raise ValueError("not '<blocks> <until> <since>' (Unix ms)") from None
    if blocks <= 0:
        raise ValueError(f"{blocks} blocks")
    now_ms = round(shared_now * 1000)  # in ints: a value of any size is refused, never overflows a float
    left_ms, waited_ms = until_ms - now_ms, now_ms - since_ms
    if left_ms > HORIZON_MS:
        raise ValueError(f"it ends {left_ms} ms from now, past any claim's {HORIZON_MS} ms")
    if abs(waited_ms) >= 2**53:  # a float's exact integers; a little ahead is Redis's clock read late
        raise ValueError(f"its claimant's first refusal, {since_ms} ms, is no Unix time")
    return Claim(blocks, mono + left_ms / 1000, mono - waited_ms / 1000) if left_ms > 0 else None
