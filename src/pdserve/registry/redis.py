"""The registry in Redis: several routers see the same workers and share one prefix index.

Each worker's state is one key with a TTL, refreshed by its heartbeat, so a dead worker vanishes without anyone
deleting it. Workers publish with a synchronous client on their own heartbeat thread. A router never waits on
Redis while serving a request: a background task on its event loop keeps a view of the workers fresh and
requests read that view; when Redis stops answering the router serves from its last view (its workers that fail
a call are ejected one by one, as any are), or, given a `max_view_age_s`, until the view is that old, then drops
the workers it can no longer confirm. The prefix index is `redis_prefix.py`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, fields, replace
from typing import Any

import redis
import redis.asyncio as aredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry as SyncRetry

from pdserve import env
from pdserve.background import cancel_and_wait, repeating
from pdserve.protocol.admitted import AdmittedTotals
from pdserve.protocol.roles import Role
from pdserve.registry.base import DEFAULT_TTL_S, RETIRED_KEEP_S, VIEW_REFRESH_S, Registry, WorkerState

log = logging.getLogger(__name__)
PREFIX = "pdserve"
TIMEOUT_S = 0.25  # any one Redis call: an unreachable Redis costs this, never a stalled thread or request
# Per client on a router's loop. Redis runs one command at a time, so more buy no speed: unbounded, each client kept
# as many as its busiest burst had calls in flight, for good (a soak review: a router held 100 idle connections).
ASYNC_CONNECTIONS = 32
WORKERS_KEY = f"{PREFIX}:workers"
RETIRED_KEY = f"{PREFIX}:retired"  # a sorted set: retired worker ids, scored by when (Unix time, Redis's clock)
DESIRED_COUNTS_KEY = f"{PREFIX}:desired_counts"  # a hash role -> workers: the shape the fleet keeps (no TTL)
FLAG_COUNTS_KEY = f"{PREFIX}:flag_counts"  # the same, as a fleet's flags last set them (no TTL)
ADMITTED_KEY = f"{PREFIX}:admitted"  # a hash of AdmittedTotals' fields: what every router admitted, cumulative
ADMITTED_SEQ_TTL_S = 3600  # a writer's last applied add: long past any retry of it
# Adds one writer's numbered delta once: a retry of an add Redis applied but whose reply was lost is skipped.
_ADD_ADMITTED = """
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[1]) <= last then return 0 end
for i = 3, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
return 1
"""
# Sets a hash only when it does not exist: what the fleet writes back is no newer than a live `pdserve scale`.
_SET_IF_ABSENT = """
if redis.call('EXISTS', KEYS[1]) == 1 or #ARGV == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""
# A scale of some roles: only onto counts there, so a Redis restarted empty meanwhile is not left with them alone.
_SET_IF_PRESENT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if #ARGV > 0 then redis.call('HSET', KEYS[1], unpack(ARGV)) end
return 1
"""
# Retires a worker: out of the registry, its id recorded on Redis's clock, records older than ARGV[2] s dropped (on the
# writer's clock, one ahead trimmed others' early, one behind wrote records trimmed at once). Older builds write their
# host's Unix time: the same unit, so a mix compares as their clocks agree, as every record did before.
_RETIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', string.format('%.17g', now - tonumber(ARGV[2])))
redis.call('ZADD', KEYS[3], string.format('%.17g', now), ARGV[1])
"""
# Removes a worker's entry, unless ARGV[2] names a process and the entry is another's: an unlist of a process found
# gone (the supervisor's, late after a freeze) must not delete the entry its restarted successor wrote meanwhile.
_REMOVE = """
local value = redis.call('GET', KEYS[1])
if value and ARGV[2] ~= '' then
  local parsed, state = pcall(cjson.decode, value)
  if not parsed or type(state) ~= 'table' or state.instance ~= ARGV[2] then return 0 end
end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
return 1
"""
# Drops listed workers whose key is gone, each only if still gone: a heartbeat between the read and this keeps it.
_FORGET_EXPIRED = """
local dropped = 0
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then dropped = dropped + redis.call('SREM', KEYS[1], ARGV[i - 1]) end
end
return dropped
"""


def _fields(counts: dict[Role, int]) -> list[str | int]:
    """A counts hash's fields and values, flat, as HSET takes them in a script."""
    return [x for r, n in counts.items() for x in (str(r), int(n))]


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def connect(url: str, timeout_s: float = TIMEOUT_S) -> redis.Redis:
    """For threads that may block (a worker's heartbeat, the launcher starting workers), briefly. `rediss://`
    URLs connect over TLS, checking the server's certificate against PDSERVE_REDIS_CA_CERT or else the system's
    CAs; the password is the URL's or, without one there, PDSERVE_REDIS_PASSWORD (so it stays out of command
    lines and the registry's logs)."""
    retry = SyncRetry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
    return redis.Redis.from_url(url, retry=retry, **_options(url, timeout_s))


def connect_async(url: str, timeout_s: float = TIMEOUT_S) -> aredis.Redis:
    """For the router's event loop; its connections belong to the loop that first uses it. As `connect`.

    Both retry a call once, at once, on a connection error, never on a timeout: a Redis restarted since closed
    every pooled connection, and without it each one failed its next call (quotas fell back to per-router limits
    for seconds after Redis was back), while a Redis that does not answer still costs one timeout. At most
    ASYNC_CONNECTIONS at once; a call waits for one within its timeout."""
    retry = AsyncRetry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
    pool = aredis.BlockingConnectionPool.from_url(
        url, max_connections=ASYNC_CONNECTIONS, timeout=timeout_s, retry=retry, **_options(url, timeout_s)
    )
    return aredis.Redis.from_pool(pool)


def _options(url: str, timeout_s: float) -> dict[str, Any]:
    """What `from_url` takes beside the URL; the URL's own query options win."""
    options: dict[str, Any] = dict(
        socket_timeout=timeout_s, socket_connect_timeout=timeout_s, password=env.redis_password()
    )
    if url.startswith("rediss://"):
        options["ssl_check_hostname"] = True  # redis-py before 6 skipped the check unless told
        if ca := env.redis_ca_cert():
            options["ssl_ca_certs"] = ca
    return options


class RedisRegistry(Registry):
    """Workers call `publish`/`remove` (blocking, short timeouts); a router calls `start` on its loop, then
    reads `workers` per request without I/O."""

    def __init__(
        self,
        url: str,
        ttl_s: float = DEFAULT_TTL_S,
        refresh_s: float = VIEW_REFRESH_S,
        timeout_s: float = TIMEOUT_S,
        max_view_age_s: float | None = None,
    ) -> None:
        self.url = url
        self.ttl_s = ttl_s
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self.max_view_age_s = 3 * ttl_s if max_view_age_s is None else max_view_age_s
        self._redis = connect(url, timeout_s)
        self._async: aredis.Redis | None = None
        self._task: asyncio.Task[None] | None = None
        self._view: dict[str, WorkerState] = {}
        self._listed: dict[str, WorkerState] = {}  # the workers Redis itself listed at its last answer
        # Those it listed before an outage and not since, each kept until one TTL after the first answer that
        # followed (monotonic): a worker's key may have expired while Redis stood still and it could not beat.
        self._kept: dict[str, tuple[WorkerState, float]] = {}
        self._retired: set[str] = set()
        self._confirmed_at = -math.inf  # monotonic time Redis last answered a refresh
        self._down_since: float | None = None  # the first failed refresh of the current outage
        self._malformed: set[str] = set()  # ids whose entries failed to parse, logged once each
        # Each listed worker's entry as last read, and what it parsed to: an entry its worker has not rewritten since
        # (a heartbeat every 0.5 s, a refresh every 0.25 s: half of them) is not parsed again.
        self._parsed: dict[str, tuple[bytes, WorkerState]] = {}

    @property
    def client(self) -> redis.Redis:
        """Its synchronous connection, for a worker's other writes on its heartbeat thread."""
        return self._redis

    def publish(self, state: WorkerState) -> None:
        ttl_ms = int(self.ttl_s * 1000)
        pipe = self._redis.pipeline()
        pipe.set(worker_key(state.worker_id), replace(state, written_ttl_ms=ttl_ms).to_json(), px=ttl_ms)
        pipe.sadd(WORKERS_KEY, state.worker_id)
        pipe.zrem(RETIRED_KEY, state.worker_id)
        pipe.execute()

    def remove(self, worker_id: str, instance: str = "") -> None:
        self._unlist(worker_id, instance)
        keys = [worker_key(worker_id), WORKERS_KEY]
        self._redis.eval(_REMOVE, len(keys), *keys, worker_id, instance)

    def retire(self, worker_id: str) -> None:
        self._unlist(worker_id)  # one script: a router reads it registered, or retired
        keys = [worker_key(worker_id), WORKERS_KEY, RETIRED_KEY]
        self._redis.eval(_RETIRE, len(keys), *keys, worker_id, RETIRED_KEEP_S)

    def retired(self) -> set[str]:
        return self._retired

    def _unlist(self, worker_id: str, instance: str = "") -> None:
        """This router stops placing on the worker at once, before its removal from Redis (`instance`: only on
        that process of it)."""

        def stays(w: WorkerState) -> bool:
            return w.worker_id != worker_id or bool(instance) and w.instance != instance

        self._view = {k: w for k, w in self._view.items() if stays(w)}
        self._listed = {k: w for k, w in self._listed.items() if stays(w)}
        self._kept = {k: kept for k, kept in self._kept.items() if stays(kept[0])}

    def desired_counts(self) -> dict[Role, int]:
        return self._counts(DESIRED_COUNTS_KEY)

    def flag_counts(self) -> dict[Role, int]:
        return self._counts(FLAG_COUNTS_KEY)

    def _counts(self, key: str) -> dict[Role, int]:
        counts: dict[Role, int] = {}
        for role, n in self._redis.hgetall(key).items():
            try:
                counts[Role(role.decode())] = int(n)  # type: ignore[union-attr]  # bytes: the client decodes nothing
            except ValueError:  # written by anyone with access to Redis: a field that is no role, or no count
                log.error("%s: field %r = %r skipped, not a role and a count", key, role, n)
        return counts

    def set_desired_counts(self, counts: dict[Role, int], from_flags: bool = False) -> None:
        pipe = self._redis.pipeline()  # one transaction: no reader sees a hash empty or half written
        for key in (DESIRED_COUNTS_KEY, FLAG_COUNTS_KEY) if from_flags else (DESIRED_COUNTS_KEY,):
            pipe.delete(key)
            if counts:
                pipe.hset(key, mapping={str(r): int(n) for r, n in counts.items()})
        pipe.execute()

    def merge_desired_counts(self, counts: dict[Role, int]) -> bool:
        return bool(self._redis.eval(_SET_IF_PRESENT, 1, DESIRED_COUNTS_KEY, *_fields(counts)))

    def restore_desired_counts(self, counts: dict[Role, int], flag_counts: dict[Role, int]) -> None:
        pipe = self._redis.pipeline()
        for key, values in ((DESIRED_COUNTS_KEY, counts), (FLAG_COUNTS_KEY, flag_counts)):
            pipe.eval(_SET_IF_ABSENT, 1, key, *_fields(values))
        pipe.execute()

    def add_admitted(self, more: AdmittedTotals, writer: str, seq: int) -> None:
        # One script: a reader never sees the requests without their tokens, and a retried add counts once.
        counts = [x for f in fields(AdmittedTotals) for x in (f.name, getattr(more, f.name))]
        keys = [ADMITTED_KEY, f"{PREFIX}:admitted_seq:{writer}"]
        self._redis.eval(_ADD_ADMITTED, len(keys), *keys, seq, ADMITTED_SEQ_TTL_S, *counts)

    def admitted(self) -> AdmittedTotals:
        values = self._redis.hgetall(ADMITTED_KEY)
        try:
            return AdmittedTotals(**{f.name: int(values.get(f.name.encode(), 0)) for f in fields(AdmittedTotals)})
        except ValueError:  # written by anyone with access to Redis
            log.error("%s holds a field that is not a count: %r", ADMITTED_KEY, values)
            raise

    def workers(self, role: Role | None = None) -> list[WorkerState]:
        if time.monotonic() - self._confirmed_at > self.max_view_age_s:
            return []  # too old to trust, whatever the background task is doing
        return [w for w in self._view.values() if role is None or w.role == role]

    def view_current(self) -> bool:
        return self._down_since is None

    async def start(self) -> None:
        if self._task is not None:
            return
        self._async = connect_async(self.url, self.timeout_s)
        await self.refresh()  # a first view before serving; an unreachable Redis costs one timeout
        self._task = repeating(self.refresh, self.refresh_s, "redis-registry-view")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._async is not None:
            await self._async.aclose()
            self._async = None
        self._redis.close()

    async def refresh(self) -> bool:
        """One read of every worker's state into the view; False when Redis did not answer in time."""
        assert self._async is not None, "start() first"
        try:
            entries, retired = await asyncio.wait_for(self._read(self._async), 2 * self.timeout_s)
        except Exception as e:  # unreachable, stalled, or a wrong-typed key: the same for a router
            self._unreachable(e)
            return False
        self._reachable(entries, retired)
        self._retired = retired
        await self._forget_expired(self._async, [i for i, entry in entries.items() if entry is None])
        return True

    @staticmethod
    async def _read(client: aredis.Redis) -> tuple[dict[str, _Entry | None], set[str]]:
        """Every listed worker's entry, and the retired ids (read with the list, in one transaction)."""
        async with client.pipeline() as pipe:
            pipe.smembers(WORKERS_KEY)
            pipe.zrange(RETIRED_KEY, 0, -1)
            listed, retired = await pipe.execute()
        ids = sorted(i.decode() for i in listed)
        entries: dict[str, _Entry | None] = {}
        if ids:
            keys = [worker_key(i) for i in ids]
            async with client.pipeline() as pipe:  # one transaction: each value with its time to live then
                pipe.mget(keys)
                for key in keys:
                    pipe.pttl(key)
                values, *ttls_ms = await pipe.execute()
            received = time.monotonic()  # the transaction ran before: what is reckoned from this is late, if off
            for i, value, ttl_ms in zip(ids, values, ttls_ms, strict=True):
                entries[i] = None if value is None else _Entry(value, ttl_ms, received)
        return entries, {i.decode() for i in retired}

    async def _forget_expired(self, client: aredis.Redis, expired: list[str]) -> None:
        if not expired:
            return
        keys = [WORKERS_KEY, *(worker_key(i) for i in expired)]
        try:  # tidying only: their keys are gone either way, and the view must not fail over it
            await asyncio.wait_for(client.eval(_FORGET_EXPIRED, len(keys), *keys, *expired), self.timeout_s)
        except Exception as e:
            log.info("could not drop expired workers %s: %r", expired, e)

    def _reachable(self, entries: dict[str, _Entry | None], retired: set[str]) -> None:
        now = time.monotonic()
        if self._down_since is not None:
            log.warning("registry redis answers again after %.1f s; the view is current", now - self._down_since)
            self._down_since = None
            # One TTL to heartbeat again for the workers Redis listed before the outage; one kept already keeps its
            # own end: renewed at every recovery, a dead worker stayed while Redis missed a refresh once per TTL.
            self._kept = {i: (w, now + self.ttl_s) for i, w in self._listed.items()} | self._kept
        self._listed = listed = self._parse(entries)
        settled = listed.keys() | retired  # listed again: no grace needed; retired since (scaled down): none due
        self._kept = {i: kept for i, kept in self._kept.items() if kept[1] > now and i not in settled}
        self._view, self._confirmed_at = {**{i: w for i, (w, _) in self._kept.items()}, **listed}, now

    def _parse(self, entries: dict[str, _Entry | None]) -> dict[str, WorkerState]:
        """Entries that fail to parse are skipped (logged once each): one bad entry must not fail every request.
        Each is heard when it was written, on this process's clock."""
        view: dict[str, WorkerState] = {}
        parsed: dict[str, tuple[bytes, WorkerState]] = {}
        malformed: set[str] = set()
        for worker_id, entry in entries.items():
            if entry is None:
                continue
            last = self._parsed.get(worker_id)
            try:
                state = last[1] if last is not None and last[0] == entry.value else WorkerState.from_json(entry.value)
            except Exception as e:  # written by anyone with access to Redis: any shape at all
                malformed.add(worker_id)
                if worker_id not in self._malformed:
                    log.error(
                        "registry entry %s skipped, it does not parse: %r; value %.200r",
                        worker_key(worker_id),
                        e,
                        entry.value,
                    )
                continue
            parsed[worker_id] = (entry.value, state)
            view[worker_id] = replace(state, heard_at=entry.written_at(state))
        self._malformed, self._parsed = malformed, parsed
        return view

    def _unreachable(self, e: Exception) -> None:
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
            limit = "until it answers" if math.isinf(self.max_view_age_s) else f"for up to {self.max_view_age_s:g} s"
            log.warning(
                "registry redis unreachable (%r); serving the last view of %d workers %s", e, len(self._view), limit
            )
        if self._view and now - self._confirmed_at > self.max_view_age_s:
            log.error(
                "registry view is %.0f s old, past its limit of %.0f s: dropping its %d workers until redis answers",
                now - self._confirmed_at,
                self.max_view_age_s,
                len(self._view),
            )
            self._view, self._listed, self._kept = {}, {}, {}


@dataclass(frozen=True)
class _Entry:
    """A worker's registry entry as one read found it."""

    value: bytes
    ttl_ms: int  # its key's PTTL then
    received: float  # this process's monotonic time the read's answer came

    def written_at(self, state: WorkerState) -> float:
        """When its worker wrote it, on this process's monotonic clock: its age on Redis's clock (the TTL it was
        written with less what is left), so no two hosts' clocks meet. A worker too old to say its TTL: its wall
        clock against this one's, the one place hosts' clocks must agree (NTP), until the last such worker is gone."""
        if state.written_ttl_ms > 0 and self.ttl_ms >= 0:
            return self.received - max(0, state.written_ttl_ms - self.ttl_ms) / 1e3
        return self.received - max(0.0, time.time() - state.updated_at)
