"""The prefix index as the build before the holders index wrote and read it (src/pdserve/registry/redis_prefix.py at
575d263, verbatim below this docstring but for it and Throttled's import, moved since): routers and workers of both
builds run side by side during a rollout, and test_redis_prefix_mixed_builds.py runs this one beside the current.
Delete it, and that test, once no build before the holders index can be running."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import redis
import redis.asyncio as aredis

from pdserve.engine.cache_journal import PrefixCacheChanges
from pdserve.loop_budget import within_budget
from pdserve.registry.base import PREFIX_TTL_S, PrefixIndex
from pdserve.registry.redis import PREFIX, connect_async
from pdserve.throttled_log import Throttled

log = logging.getLogger(__name__)
FIRST_PROBE_BLOCKS = 64  # a match asks this many leading blocks first, then 4x more of the workers still matching
CACHED = 1e12  # added to a worker's own keys' scores: above any placement's (a Unix time)
WHOLE_CHUNK = 8192  # members per command of a whole cache's copy: no one command holds Redis long
WHOLE_MARK = b"whole"  # a member no 16-byte block hash equals: the entry holds a whole copy and what followed
# Trims a worker's entry to ARGV[1] placements, the oldest first, never touching what the worker says it caches
# (scored from CACHED up): on a worker caching more than that, a rank trim took a random half of its blocks.
_TRIM_PLACEMENTS = """
local placed = redis.call('ZCOUNT', KEYS[1], '-inf', '(' .. ARGV[2])
local over = placed - tonumber(ARGV[1])
if over > 0 then redis.call('ZREMRANGEBYRANK', KEYS[1], 0, over - 1) end
return over
"""
# Each key's run of leading ARGV members (-1: the key is no sorted set), one number a worker for the router to read. A
# key that lacks the first member costs one lookup, one that holds it a ZMSCORE of them all. It replaced a pipelined
# ZMSCORE of the whole probe on every worker, which cost Redis every probe block of every worker and the router's loop
# the parsing of every score: at 128 prefill workers, where one in 16 holds the prompt's first blocks, ~4.7 ms of
# Redis and ~12 ms of the loop a request, and ~300 KB over the network (docs/experiments/router_at_scale/).
_LEADING_RUNS = """
local runs = {}
for i = 1, #KEYS do
  local run = 0
  local first = redis.pcall('ZSCORE', KEYS[i], ARGV[1])
  if type(first) == 'table' and first.err then
    run = -1
  elseif first then
    local scores = redis.call('ZMSCORE', KEYS[i], unpack(ARGV))
    while run < #ARGV and scores[run + 1] do run = run + 1 end
  end
  runs[i] = run
end
return runs
"""
LOOKUPS_PER_CALL = 4096  # blocks one call of the script looks up at most (and its unpack takes): a few ms of Redis


def prefix_key(cache_key: str) -> str:
    return f"{PREFIX}:prefix:{cache_key}"


def apply_changes(client: redis.Redis, cache_key: str, changes: PrefixCacheChanges, first: bool = False) -> bool:
    """A worker's journal into its own entry. False when the entry was lost since its last whole copy (Redis
    restarted empty, or evicted the key), or no longer holds as many of the worker's own keys as the worker does (a
    router of an earlier build wrote placements over them, lowering their scores below `CACHED`, and then trimmed
    them): the journal's next take must be whole, or the blocks it still holds would never be indexed again.
    `first`: this process's first take, which also drops the entries its worker id's earlier processes left (only
    then: two processes of one id alive at once would drop each other's each beat)."""
    key = prefix_key(cache_key)
    if changes.whole:
        if first:
            drop_entries(client, cache_key.split("/", 1)[0], keep={key, f"{key}:staging"})
        _replace(client, key, changes.stored)
        return True
    pipe = client.pipeline()
    pipe.zscore(key, WHOLE_MARK)
    if changes.removed:
        pipe.zrem(key, *changes.removed)
    if changes.stored:
        pipe.zadd(key, dict.fromkeys(changes.stored, CACHED + time.time()))
    pipe.zcount(key, CACHED, math.inf)  # the worker's own keys, and the mark
    pipe.expire(key, PREFIX_TTL_S)  # a worker that is gone stops refreshing its index
    results = pipe.execute()
    return results[0] is not None and changes.held in (None, results[-2] - 1)


def _replace(client: redis.Redis, key: str, stored: list[bytes]) -> None:
    """The whole cache, copied in chunks aside and swapped in at once (no router reads it half written, and no one
    command of a 262k-block copy holds Redis past its callers' budgets). Its mark, scored above all, is in the set
    itself: it goes exactly when the entry does."""
    staging = f"{key}:staging"
    client.delete(staging)
    score = CACHED + time.time()
    for i in range(0, len(stored), WHOLE_CHUNK):
        pipe = client.pipeline()
        pipe.zadd(staging, dict.fromkeys(stored[i : i + WHOLE_CHUNK], score))
        pipe.expire(staging, PREFIX_TTL_S)  # a copy cut mid-way leaves nothing for ever
        pipe.execute()
    pipe = client.pipeline()
    pipe.zadd(staging, {WHOLE_MARK: math.inf})
    pipe.unlink(key)  # freed by Redis in the background
    pipe.rename(staging, key)
    pipe.expire(key, PREFIX_TTL_S)
    pipe.execute()


def drop_entries(client: redis.Redis, worker_id: str, keep: set[str]) -> None:
    """Every entry of `worker_id`'s processes but `keep`: a process replaced caches nothing now, and its entry
    (up to ~8 MB) would stay for its hour-long TTL."""
    pattern = prefix_key(re.sub(r"([*?\[\]\\])", r"\\\1", worker_id) + "/*")
    stale = [k for k in client.scan_iter(match=pattern, count=1000) if k.decode() not in keep]
    if stale:
        client.unlink(*stale)


def drop_own_entry(client: redis.Redis, cache_key: str) -> None:
    """A process that leaves takes its cache with it."""
    client.unlink(prefix_key(cache_key), f"{prefix_key(cache_key)}:staging")


@dataclass(eq=False)
class RedisPrefixIndex(PrefixIndex):
    """Used on the router's event loop only. `match` answers within `match_budget_s` of the loop's running time
    (`loop_budget`: a stall of the loop itself, a large body parsed, is not Redis's miss) with the hits it counted
    by then; when Redis gave no answer at all it skips Redis for `retry_s`, so an outage costs requests their
    prefix hits, not their latency."""

    url: str
    max_blocks_per_worker: int = 65536
    match_budget_s: float = 0.03
    record_timeout_s: float = 1.0
    retry_s: float = 1.0
    max_pending_writes: int = 64
    log_every_s: float = 30.0
    _redis: aredis.Redis | None = field(default=None, init=False, repr=False)
    _writes: set[asyncio.Task[None]] = field(default_factory=set, init=False, repr=False)
    _skip_until: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        self._match_failed = Throttled(self.log_every_s, log)
        self._match_cut = Throttled(self.log_every_s, log)
        self._entry_failed = Throttled(self.log_every_s, log)
        self._record_failed = Throttled(self.log_every_s, log)

    def _client(self) -> aredis.Redis:
        if self._redis is None:
            self._redis = connect_async(self.url, self.record_timeout_s)
        return self._redis

    def record(self, cache_key: str, block_hashes: list[bytes]) -> None:
        if not block_hashes:
            return
        if len(self._writes) >= self.max_pending_writes:  # Redis is slow: a lost hint beats a pile of tasks
            self._record_failed.warning(
                "prefix index not updated for %s: %d writes pending", cache_key, len(self._writes)
            )
            return
        task = asyncio.get_running_loop().create_task(self._record(cache_key, list(block_hashes)))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _record(self, cache_key: str, block_hashes: list[bytes]) -> None:
        key = prefix_key(cache_key)
        now = time.time()
        pipe = self._client().pipeline()
        # Leading blocks score highest, so trimming drops a prompt's tail before its shared head.
        pipe.zadd(key, {h: now - i * 1e-6 for i, h in enumerate(block_hashes)}, gt=True)  # never lowers a cached one
        pipe.eval(_TRIM_PLACEMENTS, 1, key, self.max_blocks_per_worker, repr(CACHED))
        pipe.expire(key, PREFIX_TTL_S)
        try:
            await asyncio.wait_for(pipe.execute(), self.record_timeout_s)
        except Exception as e:  # a lost hint costs a cache hit, never a request
            self._record_failed.warning("prefix index not updated for %s: %r", cache_key, e)

    async def match(self, cache_keys: list[str], block_hashes: list[bytes]) -> dict[str, int]:
        hits = dict.fromkeys(cache_keys, 0)
        if not block_hashes or not cache_keys or time.monotonic() < self._skip_until:
            return hits
        rounds = 0

        async def count() -> None:
            nonlocal rounds
            async for _ in self._count_leading_runs(hits, block_hashes):
                rounds += 1

        try:  # the budget is of the loop's running time: a stall of this router's loop is not Redis's miss
            await within_budget(count(), self.match_budget_s)
        except (TimeoutError, redis.RedisError) as e:
            if not rounds:  # not even the first probe: Redis is down or stalled
                self._skip_until = time.monotonic() + self.retry_s
                self._match_failed.warning(
                    "prefix index gave no answer within %.0f ms (%r): placing without prefix hits",
                    1e3 * self.match_budget_s,
                    e,
                )
                return dict.fromkeys(cache_keys, 0)
            self._match_cut.warning(  # a long prompt's runs: the hits counted so far are true, if short
                "prefix index match cut after %d rounds (%r): placing with the hits counted so far", rounds, e
            )
        return hits

    async def _count_leading_runs(self, hits: dict[str, int], block_hashes: list[bytes]) -> AsyncGenerator[None, None]:
        """Adds to `hits` each worker's run of leading blocks, asking only the workers whose run reached the end
        of the last probe, each probe 4x the last: a long prompt costs what its hits are, not what it is long
        for every worker. Yields after each round, one pipeline of `_LEADING_RUNS` calls of at most
        LOOKUPS_PER_CALL blocks each (a probe longer than that is asked in segments)."""
        matching, start, size = list(hits), 0, FIRST_PROBE_BLOCKS
        while matching and start < len(block_hashes):
            probe = block_hashes[start : start + size]
            segments = [probe[i : i + LOOKUPS_PER_CALL] for i in range(0, len(probe), LOOKUPS_PER_CALL)]
            per_call = max(1, LOOKUPS_PER_CALL // len(segments[0]))
            pipe = self._client().pipeline(transaction=False)
            asked = []  # each call's workers, in the pipeline's order: segment by segment
            for segment in segments:
                for i in range(0, len(matching), per_call):
                    asked.append(workers := matching[i : i + per_call])
                    keys = [prefix_key(w) for w in workers]
                    pipe.eval(_LEADING_RUNS, len(keys), *keys, *segment)  # type: ignore[arg-type]  # bytes members
            answers = await pipe.execute(raise_on_error=False)
            runs: dict[str, list[int | Exception]] = {w: [] for w in matching}
            for workers, answer in zip(asked, answers, strict=True):
                for j, w in enumerate(workers):
                    runs[w].append(answer if isinstance(answer, Exception) else answer[j])
            still = []
            for w in matching:
                run = _leading_run(segments, runs[w])
                if isinstance(run, Exception):  # an entry that is no sorted set: that worker's hits only
                    self._entry_failed.warning("prefix index entry %s unreadable: %r", prefix_key(w), run)
                    hits[w] = 0
                    continue
                hits[w] += run
                if run == len(probe):
                    still.append(w)
            matching, start, size = still, start + len(probe), 4 * size
            yield

    async def flush(self) -> None:
        """Waits for the writes under way (each ends within `record_timeout_s`)."""
        await asyncio.gather(*self._writes, return_exceptions=True)

    async def close(self) -> None:
        await self.flush()
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None


def _leading_run(segments: list[list[bytes]], runs: list[int | Exception]) -> int | Exception:
    """A worker's run over a probe, from its run in each segment (-1: its entry is no sorted set): on into the next
    segment only through one it holds whole."""
    total = 0
    for segment, run in zip(segments, runs, strict=True):
        if isinstance(run, Exception):
            return run
        if run < 0:
            return redis.ResponseError("WRONGTYPE: not a sorted set")
        total += run
        if run < len(segment):
            break
    return total
