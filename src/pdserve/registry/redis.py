"""The registry in Redis: several routers see the same workers and share one prefix index.

Each worker's state is one key with a TTL, refreshed by its heartbeat, so a dead worker vanishes
without anyone deleting it. Routers read through a short-lived cached view; when Redis is unreachable
they keep serving from the last view they had and pick up again once it answers.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from pdserve.protocol.roles import Role
from pdserve.registry.base import DEFAULT_TTL_S, PrefixIndex, Registry, WorkerState

log = logging.getLogger(__name__)
PREFIX = "pdserve"
PREFIX_TTL_S = 3600


def connect(url: str) -> redis.Redis:
    # Short timeouts: a router must never stall a request on an unreachable Redis.
    return redis.Redis.from_url(url, socket_timeout=0.25, socket_connect_timeout=0.25)


class RedisRegistry(Registry):
    def __init__(self, url: str, ttl_s: float = DEFAULT_TTL_S, refresh_s: float = 0.25, retry_s: float = 1.0) -> None:
        self.ttl_s = ttl_s
        self.refresh_s = refresh_s
        self.retry_s = retry_s
        self._redis = connect(url)
        self._view: list[WorkerState] = []
        self._fresh_until = 0.0
        self._lock = threading.Lock()

    def publish(self, state: WorkerState) -> None:
        pipe = self._redis.pipeline()
        pipe.set(f"{PREFIX}:worker:{state.worker_id}", state.to_json(), px=int(self.ttl_s * 1000))
        pipe.sadd(f"{PREFIX}:workers", state.worker_id)
        pipe.execute()

    def remove(self, worker_id: str) -> None:
        pipe = self._redis.pipeline()
        pipe.delete(f"{PREFIX}:worker:{worker_id}")
        pipe.srem(f"{PREFIX}:workers", worker_id)
        pipe.execute()
        with self._lock:
            self._view = [w for w in self._view if w.worker_id != worker_id]

    def workers(self, role: Role | None = None) -> list[WorkerState]:
        with self._lock:
            if time.monotonic() >= self._fresh_until:
                self._refresh()
            view = self._view
        return [w for w in view if role is None or w.role == role]

    def _refresh(self) -> None:
        try:
            ids = sorted(i.decode() for i in self._redis.smembers(f"{PREFIX}:workers"))
            values = self._redis.mget([f"{PREFIX}:worker:{i}" for i in ids]) if ids else []
        except redis.RedisError as e:
            log.warning("redis unreachable (%s); serving from the last view of %d workers", e, len(self._view))
            self._fresh_until = time.monotonic() + self.retry_s
            return
        expired = [i for i, v in zip(ids, values, strict=True) if v is None]
        if expired:
            try:  # tidying only: the keys are gone either way, and the view must not fail over it
                self._redis.srem(f"{PREFIX}:workers", *expired)
            except redis.RedisError as e:
                log.warning("could not drop expired workers %s: %s", expired, e)
        self._view = [WorkerState.from_json(v) for v in values if v is not None]
        self._fresh_until = time.monotonic() + self.refresh_s


class RedisPrefixIndex(PrefixIndex):
    """Per worker a sorted set of block hashes scored by last use, trimmed to the worker's cache size."""

    def __init__(self, url: str, max_blocks_per_worker: int = 65536) -> None:
        self._redis = connect(url)
        self.max_blocks = max_blocks_per_worker

    def record(self, worker_id: str, block_hashes: list[bytes]) -> None:
        if not block_hashes:
            return
        key = f"{PREFIX}:prefix:{worker_id}"
        now = time.time()
        try:
            pipe = self._redis.pipeline()
            # Leading blocks score highest, so trimming drops a prompt's tail before its shared head.
            pipe.zadd(key, {h: now - i * 1e-6 for i, h in enumerate(block_hashes)})
            pipe.zremrangebyrank(key, 0, -self.max_blocks - 1)
            pipe.expire(key, PREFIX_TTL_S)  # a worker that is gone stops refreshing its index
            pipe.execute()
        except redis.RedisError as e:  # a lost hint costs a cache hit, never a request
            log.warning("prefix index not updated: %s", e)

    def match(self, worker_ids: list[str], block_hashes: list[bytes]) -> dict[str, int]:
        if not block_hashes or not worker_ids:
            return dict.fromkeys(worker_ids, 0)
        try:
            pipe = self._redis.pipeline()
            for w in worker_ids:
                pipe.zmscore(f"{PREFIX}:prefix:{w}", block_hashes)
            scores = pipe.execute()
        except redis.RedisError as e:
            log.warning("prefix index unreachable: %s", e)
            return dict.fromkeys(worker_ids, 0)
        return {w: _leading(s) for w, s in zip(worker_ids, scores, strict=True)}


def _leading(scores: list[float | None]) -> int:
    n = 0
    for s in scores:
        if s is None:
            break
        n += 1
    return n
