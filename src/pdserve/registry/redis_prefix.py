"""The prefix index in Redis, shared by every router: per block, the worker processes holding it (a bitmap of their
entries' slots, `prefix_holders`), and per worker process its sorted set of blocks.

Routers add what they place (so a burst sharing a new prefix goes where its first prompt went), scored by the time
on Redis's clock (the script reads `TIME`), one for every router, so the oldest placements go first when the set is
trimmed, whichever router made them; the worker itself applies its prefix cache's journal on each heartbeat
(`apply_changes`), scored above every placement (`CACHED`, plus its own clock's time, which is compared with nothing
but `CACHED`), so blocks it evicted leave the index, blocks no placement named (a prompt's last full block, a
colocated worker's generated tokens) join it, and no placement ever pushes out a block the worker says it holds.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import cast

import redis
import redis.asyncio as aredis
from redis.commands.core import AsyncScript

from pdserve.engine.cache_journal import PrefixCacheChanges
from pdserve.loop_budget import within_budget
from pdserve.registry import prefix_holders as holders
from pdserve.registry.base import PrefixIndex
from pdserve.registry.prefix_holders import CACHED, KEYS, SLOTS_KEY, VERSION_FIELD, WHOLE_MARK, entry_key
from pdserve.registry.redis import PREFIX, connect_async
from pdserve.throttled_log import Throttled

log = logging.getLogger(__name__)
FIRST_PROBE_BLOCKS = 64  # a match asks this many leading blocks first, then 4x more of the workers still matching
WHOLE_CHUNK = 4096  # blocks per call of a whole cache's copy: no one call holds Redis long
LOOKUPS_PER_CALL = 4096  # probe blocks one call of the match script is given at most: a few ms of Redis at worst
UNREADABLE = -1  # a slot mapping that does not parse (its worker's hits are 0), as a router caches it
STALE = b"stale"  # the match script's answer when the slots it was given are of another version of the mappings
__all__ = ["CACHED", "WHOLE_MARK", "apply_changes", "drop_own_entry", "prefix_key", "RedisPrefixIndex"]


def prefix_key(cache_key: str) -> str:
    """The sorted set of a worker process's blocks."""
    return entry_key(cache_key)


def apply_changes(client: redis.Redis, cache_key: str, changes: PrefixCacheChanges, first: bool = False) -> bool:
    """A worker's journal into its own entry. False when the entry was lost since its last whole copy (Redis
    restarted empty, or the index was reset), or no longer holds as many of the worker's own keys as the worker does
    (a writer lowered them to placements and trimmed them): the journal's next take must be whole, or the blocks it
    still holds would never be indexed again. `first`: this process's first take, which also drops the entries its
    worker id's earlier processes left (only then: two processes of one id alive at once would drop each other's
    each beat). Each write also takes a step of the index's sweep, at most every `SWEEP_EVERY_MS` fleet-wide."""
    if changes.whole:
        if first:
            drop_earlier_format(client, cache_key.split("/", 1)[0])
        _replace(client, cache_key, changes.stored, first)
        return True
    score = repr(CACHED + time.time())
    args: list[str | int | bytes] = [cache_key, score, len(changes.removed), *changes.removed, *changes.stored]
    intact, held = client.register_script(holders.script(holders.APPLY))(KEYS, args)
    return bool(intact) and changes.held in (None, held)


def _replace(client: redis.Redis, cache_key: str, stored: list[bytes], first: bool) -> None:
    """The whole cache, copied in chunks under a fresh slot and swapped in at once (no router reads it half written,
    and no one call of a 262k-block copy holds Redis past its callers' budgets)."""
    client.register_script(holders.script(holders.STAGE))(KEYS, [cache_key, int(first)])
    more = client.register_script(holders.script(holders.STAGE_MORE))
    score = repr(CACHED + time.time())
    for i in range(0, len(stored), WHOLE_CHUNK):
        more(KEYS, [f"{cache_key}:staging", score, *stored[i : i + WHOLE_CHUNK]])
    client.register_script(holders.script(holders.SWAP))(KEYS, [cache_key])


def drop_earlier_format(client: redis.Redis, worker_id: str) -> None:
    """Every entry of `worker_id`'s processes in the format of the build before the holders index
    (`pdserve:prefix:<cache key>`, which routers of that build still read during a rollout): a process replaced caches
    nothing now, and its entry (up to ~8 MB) would stay for its hour-long TTL."""
    pattern = f"{PREFIX}:prefix:" + re.sub(r"([*?\[\]\\])", r"\\\1", worker_id) + "/*"
    stale = list(client.scan_iter(match=pattern, count=1000))
    if stale:
        client.unlink(*stale)


def drop_own_entry(client: redis.Redis, cache_key: str) -> None:
    """A process that leaves takes its cache with it: its entry (and a copy it left staged) is put aside for the
    sweep, whose first step it takes."""
    client.register_script(holders.script(holders.DROP))(KEYS, [cache_key, f"{cache_key}:staging"])


def sweep(client: redis.Redis) -> bool:
    """One step of the index's sweep, whenever the last was; True while entries wait to have their bits cleared."""
    return bool(client.register_script(holders.script(holders.SWEEP))(KEYS, []))


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
    _scripts: dict[str, AsyncScript] = field(default_factory=dict, init=False, repr=False)
    _slots: dict[str, int | None] = field(default_factory=dict, init=False, repr=False)  # None: no entry
    _slots_version: bytes | None = field(default=None, init=False, repr=False)

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
        """Scored in the script on Redis's clock, one for every router: on its own clock, a router behind ranked its
        placements older than they were, and a trim dropped them first."""
        try:
            call = self._script(holders.RECORD)(KEYS, [cache_key, self.max_blocks_per_worker, *block_hashes])
            await asyncio.wait_for(call, self.record_timeout_s)
        except Exception as e:  # a lost hint costs a cache hit, never a request
            self._record_failed.warning("prefix index not updated for %s: %r", cache_key, e)

    def _script(self, body: str) -> AsyncScript:
        if body not in self._scripts:
            self._scripts[body] = self._client().register_script(holders.script(body))
        return self._scripts[body]

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
        of the last probe, each probe 4x the last: a long prompt costs what its hits are. Yields after each round,
        one pipeline of `MATCH` calls of at most LOOKUPS_PER_CALL blocks each (a probe longer than that is asked in
        segments), each reading its blocks' bitmaps once, however many workers are asked, over the workers' slots
        as this router last read them; a round answered "stale" (a mapping changed since) reads them again and is
        asked again (it yields too: Redis answered)."""
        matching, start, size, fresh = list(hits), 0, FIRST_PROBE_BLOCKS, False
        while matching and start < len(block_hashes):
            version, slots = await self._slots_of(matching, fresh)
            for w in matching:
                if slots[w] == UNREADABLE:  # that worker's hits only
                    self._entry_failed.warning("prefix index entry %s unreadable: its slot mapping does not parse", w)
            asked = {w: slot for w in matching if (slot := slots[w]) is not None and slot != UNREADABLE}
            probe = block_hashes[start : start + size]
            segments = [probe[i : i + LOOKUPS_PER_CALL] for i in range(0, len(probe), LOOKUPS_PER_CALL)]
            # Closed however the round ends: a match given up on while the pipeline checked its script (its first
            # round trip) kept that connection from the pool for good, and 32 such misses left none.
            async with self._client().pipeline(transaction=False) as pipe:
                for segment in segments:
                    args: list[bytes | int] = [version, len(asked), *asked.values(), *segment]
                    await self._script(holders.MATCH)(KEYS, args, client=pipe)
                answers = await pipe.execute(raise_on_error=False)
            if STALE in answers:  # an answer all the same: Redis is up, whatever the budget leaves of the retry
                fresh = True
                yield
                continue
            fresh, still = False, []
            for j, w in enumerate(asked):
                run = _leading_run(segments, [a if isinstance(a, Exception) else a[j] for a in answers])
                if isinstance(run, Exception):
                    self._entry_failed.warning("prefix index entry %s unreadable: %r", w, run)
                    hits[w] = 0
                    continue
                hits[w] += run
                if run == len(probe):
                    still.append(w)
            matching, start, size = still, start + len(probe), 4 * size
            yield

    async def _slots_of(self, keys: list[str], fresh: bool) -> tuple[bytes, dict[str, int | None]]:
        """The keys' slots and the version of the mappings they were read at: as cached, unless one is not cached
        or `fresh` (the cached version went stale), when all are read again, with the version, in one command."""
        if not fresh and all(k in self._slots for k in keys) and self._slots_version is not None:
            return self._slots_version, self._slots
        replies = cast(list[bytes | None], await self._client().hmget(SLOTS_KEY, [VERSION_FIELD, *keys]))
        # No version: no index of this build (none yet, or lost): no slot is read, and the match's check of the
        # version says when one is there.
        version = replies[0] or b""
        read = {k: _slot_in(v) if replies[0] else None for k, v in zip(keys, replies[1:], strict=True)}
        if version == self._slots_version:
            self._slots.update(read)
        else:
            self._slots, self._slots_version = read, version
        return version, read

    async def flush(self) -> None:
        """Waits for the writes under way (each ends within `record_timeout_s`)."""
        await asyncio.gather(*self._writes, return_exceptions=True)

    async def close(self) -> None:
        await self.flush()
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None


def _slot_in(mapping: bytes | None) -> int | None:
    """The slot in a mapping ("slot:lease end"); None without one, UNREADABLE when it does not parse."""
    if mapping is None:
        return None
    found = re.match(rb"(\d+):", mapping)
    return int(found.group(1)) if found else UNREADABLE


def _leading_run(segments: list[list[bytes]], runs: list[int | Exception]) -> int | Exception:
    """A worker's run over a probe, from its run in each segment: on into the next segment only through one it holds
    whole."""
    total = 0
    for segment, run in zip(segments, runs, strict=True):
        if isinstance(run, Exception):
            return run
        total += run
        if run < len(segment):
            break
    return total
