"""The embedded registry of a local cluster with one router: dicts in the router's process."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pdserve.engine.cache_journal import PrefixCacheChanges
from pdserve.protocol.admitted import AdmittedTotals
from pdserve.protocol.roles import Role
from pdserve.registry.base import DEFAULT_TTL_S, PREFIX_TTL_S, RETIRED_KEEP_S, PrefixIndex, Registry, WorkerState


class InMemoryRegistry(Registry):
    """A worker is live for `ttl_s` from when this process heard it (its `heard_at`, stamped at `publish` on this
    process's monotonic clock): the supervisor hears workers that may run on other Ray nodes, whose clocks are not
    this one's (a worker's clock 5 s behind read as silent for 5 s, and no worker was ever listed)."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._workers: dict[str, WorkerState] = {}
        self._retired: dict[str, float] = {}  # id -> when it was retired (the clock's)
        self._desired: dict[Role, int] = {}
        self._flags: dict[Role, int] = {}
        self._admitted = AdmittedTotals()
        self._added_seq: dict[str, int] = {}  # each writer's last applied add
        self._lock = threading.Lock()

    def publish(self, state: WorkerState) -> None:
        now = self._clock()
        with self._lock:
            self._workers[state.worker_id] = replace(state, heard_at=now)
            self._retired.pop(state.worker_id, None)
            for gone in [w.worker_id for w in self._workers.values() if w.heard_at < now - self.ttl_s]:
                del self._workers[gone]  # past its TTL no view shows it; scaled-away ids never come back

    def remove(self, worker_id: str, instance: str = "") -> None:
        with self._lock:
            listed = self._workers.get(worker_id)
            if listed is not None and (not instance or listed.instance == instance):
                del self._workers[worker_id]

    def retire(self, worker_id: str) -> None:
        now = self._clock()
        with self._lock:
            self._workers.pop(worker_id, None)
            self._retired = {i: at for i, at in self._retired.items() if now - at < RETIRED_KEEP_S}
            self._retired[worker_id] = now

    def retired(self) -> set[str]:
        with self._lock:
            return set(self._retired)

    def workers(self, role: Role | None = None) -> list[WorkerState]:
        oldest = self._clock() - self.ttl_s
        with self._lock:
            return [w for w in self._workers.values() if w.heard_at >= oldest and (role is None or w.role == role)]

    def desired_counts(self) -> dict[Role, int]:
        with self._lock:
            return dict(self._desired)

    def set_desired_counts(self, counts: dict[Role, int], from_flags: bool = False) -> None:
        with self._lock:
            self._desired = {Role(r): int(n) for r, n in counts.items()}
            if from_flags:
                self._flags = dict(self._desired)

    def merge_desired_counts(self, counts: dict[Role, int]) -> bool:
        with self._lock:
            if not self._desired:
                return False
            self._desired.update({Role(r): int(n) for r, n in counts.items()})
            return True

    def restore_desired_counts(self, counts: dict[Role, int], flag_counts: dict[Role, int]) -> None:
        with self._lock:
            self._desired = self._desired or dict(counts)
            self._flags = self._flags or dict(flag_counts)

    def flag_counts(self) -> dict[Role, int]:
        with self._lock:
            return dict(self._flags)

    def add_admitted(self, more: AdmittedTotals, writer: str, seq: int) -> None:
        with self._lock:
            if seq > self._added_seq.get(writer, 0):
                self._admitted.merge(more)
                self._added_seq[writer] = seq

    def admitted(self) -> AdmittedTotals:
        with self._lock:
            return self._admitted.copy()


@dataclass
class _Entry:
    """One worker process's: the blocks routers placed there (an LRU, hints until its journal says), and those its
    journal says it caches (exact: never pushed out by hints)."""

    placed: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    cached: set[bytes] = field(default_factory=set)


class InMemoryPrefixIndex(PrefixIndex):
    """Per worker, the blocks its journal says it caches, and an LRU of at most `max_blocks_per_worker` more that
    placements named. An entry nobody recorded into for `ttl_s` goes, as a Redis index's key expires: a worker
    process scaled away or replaced (entries are per process, `WorkerState.cache_key`, so an id handed out again
    starts a new one) would otherwise keep its entry, up to ~9 MB, for the router's life."""

    def __init__(
        self,
        max_blocks_per_worker: int = 65536,
        ttl_s: float = PREFIX_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_blocks = max_blocks_per_worker
        self.ttl_s = ttl_s
        self._clock = clock
        self._blocks: dict[str, _Entry] = {}
        self._recorded: dict[str, float] = {}  # cache key -> when it was last recorded into
        self._lock = threading.Lock()

    def record(self, cache_key: str, block_hashes: list[bytes]) -> None:
        with self._lock:
            placed = self._entry(cache_key).placed
            for h in reversed(block_hashes):  # leading blocks end most recent: evicted last
                placed[h] = None
                placed.move_to_end(h)
            while len(placed) > self.max_blocks:
                placed.popitem(last=False)

    def apply(self, cache_key: str, changes: PrefixCacheChanges) -> None:
        """A worker's prefix-cache journal (the supervisor of an embedded registry takes it): what it evicted
        leaves, placed or cached, and what it keyed joins; a whole take replaces all, as
        `redis_prefix.apply_changes` does in Redis."""
        with self._lock:
            entry = self._entry(cache_key)
            if changes.whole:
                entry.placed.clear()
                entry.cached = set(changes.stored)
                return
            for h in changes.removed:
                entry.placed.pop(h, None)
                entry.cached.discard(h)
            entry.cached.update(changes.stored)

    def _entry(self, cache_key: str) -> _Entry:
        now = self._clock()
        for stale in [k for k, at in self._recorded.items() if now - at > self.ttl_s]:
            del self._blocks[stale], self._recorded[stale]
        self._recorded[cache_key] = now
        if cache_key not in self._blocks:  # a worker's new process: its predecessor's entry goes
            same_worker = cache_key.split("/", 1)[0] + "/"
            for old in [k for k in self._blocks if k.startswith(same_worker)]:
                del self._blocks[old], self._recorded[old]
        return self._blocks.setdefault(cache_key, _Entry())

    async def match(self, cache_keys: list[str], block_hashes: list[bytes]) -> dict[str, int]:
        with self._lock:
            return {w: _leading(self._blocks.get(w, _Entry()), block_hashes) for w in cache_keys}


def _leading(held: _Entry, block_hashes: list[bytes]) -> int:
    cached, placed = held.cached, held.placed  # not `in held`: a method call per block, of every prefill worker
    n = 0
    for h in block_hashes:
        if h not in cached and h not in placed:
            break
        n += 1
    return n
