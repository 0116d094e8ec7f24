"""Per-key limits shared by every router of a cluster, in the registry's Redis: a key's limits hold for the
cluster, not once per router.

Each rate is a token bucket in a hash, `pdserve:quota:<key name>:requests` or `...:tokens`, updated by a Lua
script that reads Redis's own `TIME`, so the routers' clocks never matter; a bucket's TTL is the time it takes to
refill, after which a missing key reads as a full bucket, so idle keys vanish. Concurrent streams are leases in
a sorted set, `pdserve:quota:<key name>:streams` (member: the lease id, score: its expiry in Redis's
milliseconds): expired leases are dropped before counting, each router renews the leases of its open streams in
one script call per `lease_s / 3` (entering again any Redis lost: a restart, a stream admitted in a fallback),
and a stream's lease is removed when it ends. A router that dies stops renewing, so its leases expire within
`lease_s` and free their slots.

No request waits on Redis longer than `budget_s` of the router's loop time (`loop_budget`: a stall of the loop
itself, a large body parsed, is not Redis's to miss, and an answer that came during it is read): a call that fails
or takes longer is answered by this router's own `LocalQuotas` instead (the per-router limits, over every stream
this router serves, whichever admitted it: N routers admit up to N times a key's limits meanwhile) until a
background ping every `retry_s` has an answer; the outage is logged once and its end too. What Redis runs of such
a call later has no effect there (a stream's lease is removed, a take comes back: sent until Redis has it, however
long it stood still), so nothing is counted twice. A lease whose release is lost in an outage expires on its own.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import TypeVar, cast

import redis.asyncio as aredis

from pdserve.background import cancel_and_wait
from pdserve.errors import OverloadedError
from pdserve.loop_budget import within_budget
from pdserve.registry.redis import PREFIX, connect_async
from pdserve.security.api_keys import Tenant
from pdserve.security.quotas import (
    LocalQuotas,
    Quotas,
    Release,
    over_request_rate,
    over_token_rate,
    request_bucket_size,
    too_many_streams,
)
from pdserve.throttled_log import Throttled

log = logging.getLogger(__name__)
T = TypeVar("T")
Arg = str | int | float  # a script argument

# Lua: Redis's clock in milliseconds, and a token bucket (rate per ms) that refills before each use. Numbers go
# back as strings: Redis would truncate a Lua number to an integer.
_BUCKET = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end
local function refilled(key, rate, capacity, now)
  local state = redis.call('HMGET', key, 'level', 'at')
  local level, at = tonumber(state[1]), tonumber(state[2])
  if level == nil or at == nil then return capacity end
  return math.min(capacity, level + math.max(0, now - at) * rate)
end
local function store(key, level, now, ttl_ms)
  redis.call('HSET', key, 'level', string.format('%.17g', level), 'at', string.format('%.17g', now))
  redis.call('PEXPIRE', key, ttl_ms)
end
-- 0 when `cost` was taken, else the ms until it would be there (nothing taken)
local function take(key, rate, capacity, cost, ttl_ms, now)
  local level = refilled(key, rate, capacity, now)
  if level < cost then return (cost - level) / rate end
  store(key, level - cost, now, ttl_ms)
  return 0
end
"""

# KEYS: streams, the lease's abandoned mark. ARGV: max_concurrent (> 0), lease_ms, lease. {'ok'} or {'streams', open
# count}. The lease is never added once its router gave up waiting for this answer (`_ABANDON` ran first).
_OPEN_STREAM = (
    _BUCKET
    + """
local now = now_ms()
if redis.call('EXISTS', KEYS[2]) == 1 then return {'abandoned', ''} end
local max_streams, lease_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local open = redis.call('ZCARD', KEYS[1])
if open >= max_streams then return {'streams', tostring(open)} end
redis.call('ZADD', KEYS[1], now + lease_ms, ARGV[3])
redis.call('PEXPIRE', KEYS[1], lease_ms)
return {'ok', ''}
"""
)

# KEYS: streams, the lease's abandoned mark. ARGV: lease, lease_ms. An open its router stopped waiting for has no
# effect whichever of the two Redis runs first: after the open, its lease goes; before it, the mark stops it.
_ABANDON = """
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
redis.call('ZREM', KEYS[1], ARGV[1])
return 0
"""

# Lua: `cost` back into a bucket. A missing bucket is full already.
_REFUND = """
local function refund(key, rate, capacity, cost, ttl_ms)
  if redis.call('EXISTS', key) == 1 then
    local now = now_ms()
    store(key, math.min(capacity, refilled(key, rate, capacity, now) + cost), now, ttl_ms)
  end
end
"""

# KEYS: a bucket (requests or tokens), the take's mark. ARGV: rate, capacity, cost, ttl_ms, mark_ms. The wait in ms,
# '0' when taken. A take marks itself taken, so that a router that stopped waiting for it can give it back
# (_ABANDON_TAKE).
_TAKE = (
    _BUCKET
    + """
if redis.call('GET', KEYS[2]) == 'abandoned' then
  return '0'
end
local wait = take(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), now_ms())
if wait == 0 then
  redis.call('SET', KEYS[2], 'taken', 'PX', ARGV[5])
end
return string.format('%.17g', wait)
"""
)

# KEYS: the bucket, the take's mark. ARGV: rate, capacity, cost, ttl_ms, mark_ms. A take its router stopped waiting
# for (and charged locally instead) costs nothing in Redis whichever of the two Redis runs first: after the take,
# its cost comes back; before it, the mark stops it.
_ABANDON_TAKE = (
    _BUCKET
    + _REFUND
    + """
if redis.call('GET', KEYS[2]) == 'taken' then
  refund(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4])
end
redis.call('SET', KEYS[2], 'abandoned', 'PX', ARGV[5])
return 0
"""
)

# KEYS: tokens. ARGV: rate, capacity, cost, ttl_ms.
_GIVE_BACK = (
    _BUCKET
    + _REFUND
    + """
refund(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4])
return 0
"""
)

# KEYS: streams sets (one per lease). ARGV: lease_ms, then the leases. A lease that is missing is added again: its
# stream is still open (a Redis restarted empty, or one the router admitted while Redis did not answer), and a
# count without it would let the key open more than its limit beside it.
_RENEW = (
    _BUCKET
    + """
local lease_ms = tonumber(ARGV[1])
local expiry = now_ms() + lease_ms
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, expiry, ARGV[i + 1])
  redis.call('PEXPIRE', key, lease_ms)
end
return 0
"""
)


def quota_key(tenant: Tenant, what: str) -> str:
    return f"{PREFIX}:quota:{tenant.key_name}:{what}"


def _refill_ms(rate_per_s: float, capacity: float) -> int:
    """A bucket's TTL: once it could have refilled, a missing key means the same."""
    return math.ceil(1000 * capacity / rate_per_s) + 1000


class RedisQuotas(Quotas):
    """Used on the router's event loop only (its Redis connections belong to the loop that first uses them)."""

    def __init__(
        self,
        url: str,
        budget_s: float = 0.05,
        lease_s: float = 10.0,
        retry_s: float = 1.0,
        write_timeout_s: float = 1.0,
        log_every_s: float = 30.0,
    ) -> None:
        self.url = url
        self.budget_s = budget_s
        self.lease_s = lease_s
        self._lease_ms = math.ceil(lease_s * 1000)
        self.retry_s = retry_s
        self.write_timeout_s = write_timeout_s  # releases and renewals, in the background
        self.local = LocalQuotas()  # what answers while Redis does not
        self._redis: aredis.Redis = connect_async(url, write_timeout_s)  # connects on first use
        self._open = self._redis.register_script(_OPEN_STREAM)
        self._take = self._redis.register_script(_TAKE)
        self._give_back = self._redis.register_script(_GIVE_BACK)
        self._renew = self._redis.register_script(_RENEW)
        self._abandon = self._redis.register_script(_ABANDON)
        self._abandon_take = self._redis.register_script(_ABANDON_TAKE)
        self._leases: dict[str, str] = {}  # this router's open streams held in Redis: lease -> its streams key
        self._renewer: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None  # while Redis is down: waits for it to answer
        self._writes: set[asyncio.Task[None]] = set()
        self._closing = False
        self._down_since: float | None = None
        self._outage = Throttled(log_every_s, log)
        self._write_failed = Throttled(log_every_s, log)

    async def take_request(self, tenant: Tenant) -> None:
        rps = tenant.requests_per_second
        if not rps:
            return  # nothing to share: nothing to ask Redis
        taken = await self._take_from(tenant, "requests", rps, request_bucket_size(tenant), 1, over_request_rate)
        if taken is None:
            self.local.take_request_now(tenant)

    async def open_stream(self, tenant: Tenant) -> Release:
        max_streams = tenant.max_concurrent
        if not max_streams:
            return self.local.open_stream_now(tenant)  # nothing to share: nothing to ask Redis
        lease, streams = uuid.uuid4().hex, quota_key(tenant, "streams")
        mark = quota_key(tenant, f"abandoned:{lease}")
        keys = [streams, mark]
        args: list[Arg] = [max_streams, self._lease_ms, lease]

        def abandon() -> None:  # Redis may still run the open it did not answer in time
            self._in_background(lambda: self._abandon(keys=[streams, mark], args=[lease, self._lease_ms]), "abandon")

        # Counted here while Redis is asked: a fallback meanwhile (another request's miss began an outage) checks
        # the local limits against every stream this router serves, this one too.
        counted = self.local.count_stream(tenant)
        try:
            answer = await self._ask(lambda: self._open(keys=keys, args=args), on_miss=abandon)
        except BaseException:
            counted()
            raise
        if answer is None:  # the local limits, over every stream this router serves (this one's count goes first)
            counted()
            return self._held(lease, streams, self.local.open_stream_now(tenant))
        verdict, value = (v.decode() for v in answer)
        if verdict == "streams":
            counted()
            raise too_many_streams(tenant, int(value))
        return self._held(lease, streams, counted)

    def _held(self, lease: str, streams: str, close_local: Release) -> Release:
        """An open stream: its lease renewed in Redis (entered there by the renewer if Redis did not admit it),
        and counted in the local limits too, which a fallback checks against everything this router serves."""
        self._leases[lease] = streams
        self._keep_renewing()

        def close() -> None:
            close_local()
            self._close_stream(lease)

        return close

    async def take_tokens(self, tenant: Tenant, tokens: int) -> Release:
        tpm = tenant.tokens_per_minute
        taken = await self._take_from(tenant, "tokens", tpm / 60, tpm, tokens, over_token_rate)
        return self.local.take_tokens_now(tenant, tokens) if taken is None else taken

    async def _take_from(
        self,
        tenant: Tenant,
        what: str,
        rate_per_s: float,
        capacity: float,
        cost: int,
        over: Callable[[Tenant, float], OverloadedError],
    ) -> Release | None:
        """`cost` from the key's `what` bucket (raising `over` when short), with how to give it back; None when Redis
        gave no answer in time: the caller takes it from the local limits instead."""
        bucket = [quota_key(tenant, what)]
        args: list[Arg] = [rate_per_s / 1000, capacity, cost, _refill_ms(rate_per_s, capacity)]
        marked = [*bucket, quota_key(tenant, f"take:{uuid.uuid4().hex}")]

        def abandon() -> None:  # Redis may still run (or have run) the take it did not answer in time
            call = lambda: self._abandon_take(keys=marked, args=[*args, self._lease_ms])  # noqa: E731
            # Until Redis has it: one stopped past the write's timeout runs the take when it wakes, charged twice.
            self._in_background(call, "abandon", until_done=True)

        answer = await self._ask(lambda: self._take(keys=marked, args=[*args, self._lease_ms]), on_miss=abandon)
        if answer is None:
            return None
        wait_ms = float(answer)
        if wait_ms:
            raise over(tenant, wait_ms / 1000)
        return lambda: self._in_background(lambda: self._give_back(keys=bucket, args=args), f"{what} given back")

    async def _ask(self, call: Callable[[], Awaitable[T]], on_miss: Callable[[], None] | None = None) -> T | None:
        """Redis's answer within the budget, or None: the caller falls back to the local limits. After a miss no
        request asks again until a background ping has had an answer (which also leaves a connection made, so a
        connection slower to make than the budget, TLS to a far Redis, does not keep failing requests).
        `on_miss` runs when the call was made and got no answer in time, or its caller was cancelled waiting for
        one: Redis may still run it."""
        if self._down_since is not None:
            return None
        try:
            return await within_budget(call(), self.budget_s)
        except asyncio.CancelledError:  # the caller hung up mid-call: Redis may still run it
            if on_miss is not None:
                on_miss()
            raise
        except Exception as e:  # unreachable, slow, or refusing (a wrong-typed key): the same for a request
            if on_miss is not None:
                on_miss()
            if self._down_since is not None:  # another request's miss, at the same time, began this outage
                return None
            self._down_since = time.monotonic()
            self._outage.warning(
                "quota redis gave no answer within %.0f ms (%r): enforcing API-key limits per router until it "
                "answers again",
                1e3 * self.budget_s,
                e,
            )
            self._probe = asyncio.get_running_loop().create_task(self._wait_for_redis(), name="quota-redis-probe")
            return None

    async def _wait_for_redis(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.retry_s)
            try:
                await asyncio.wait_for(self._redis.ping(), self.write_timeout_s)
            except Exception:
                continue
            assert self._down_since is not None
            log.warning(
                "quota redis answers again after %.1f s: API-key limits are cluster-wide again",
                time.monotonic() - self._down_since,
            )
            self._down_since = None
            return

    def _close_stream(self, lease: str) -> None:
        streams = self._leases.pop(lease)
        self._in_background(lambda: self._redis.zrem(streams, lease), "stream lease not removed")

    def _in_background(self, call: Callable[[], Awaitable[object]], what: str, until_done: bool = False) -> None:
        """A write no request waits for; lost, it costs a lease's expiry or a refill's wait, never a request.
        `until_done`: tried again every `retry_s` until Redis has it (an idempotent one)."""

        async def write() -> None:
            while True:
                try:
                    return await asyncio.wait_for(cast(Awaitable[None], call()), self.write_timeout_s)
                except Exception as e:
                    self._write_failed.warning("quota redis: %s failed: %r", what, e)
                if not until_done or self._closing:
                    return
                await asyncio.sleep(self.retry_s)

        task = asyncio.get_running_loop().create_task(write())
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    def _keep_renewing(self) -> None:
        if self._renewer is None and not self._closing:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_leases(), name="quota-lease-renewal")

    async def _renew_leases(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.lease_s / 3)
            if not self._leases or self._down_since is not None:
                continue
            leases = dict(self._leases)
            args: list[Arg] = [self._lease_ms, *leases]
            keys = list(leases.values())
            try:
                await asyncio.wait_for(self._renew(keys=keys, args=args), self.write_timeout_s)
            except Exception as e:  # the next interval tries again; until a lease expires nothing is lost
                self._write_failed.warning("quota redis: %d stream leases not renewed: %r", len(leases), e)
            for lease, streams in leases.items():  # closed while the renewal ran: it may have come back
                if lease not in self._leases:
                    self._in_background(partial(self._redis.zrem, streams, lease), "stream lease not removed")

    async def flush(self) -> None:
        """Waits for the background writes under way (each ends within `write_timeout_s`)."""
        await asyncio.gather(*self._writes, return_exceptions=True)

    def keep_only(self, tenants: Iterable[Tenant]) -> None:
        """Redis keeps a key's counts by its name, under the caps each call brings, and lets a removed key's expire."""
        self.local.keep_only(tenants)

    async def close(self) -> None:
        self._closing = True
        for task in (self._renewer, self._probe):
            await cancel_and_wait(task)
        await self.flush()
        await self._redis.aclose()
