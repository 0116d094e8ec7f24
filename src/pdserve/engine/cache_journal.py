"""The prefix cache's keys as they come and go, for the routers' prefix index.

A router learns what a worker caches from its own placements, which cannot see evictions: without this, an
index promises hits on blocks long gone (a TTFT predicted as if the prompt were cached, a queue priced short),
and never learns of blocks a worker keyed that no placement named (a prompt's last full block, a colocated
worker's generated tokens). The engine thread notes each key as the block manager keys or evicts it; one
consumer per worker takes the net changes now and then (its heartbeat into Redis, or the supervisor of the
embedded registry) and applies them to the worker's index entry, as vLLM's KV events feed llm-d's and Dynamo's
KV-aware routers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixCacheChanges:
    """What the cache keyed and evicted since the last take. `whole`: `stored` is every key the cache holds,
    to replace the index's entry (the first take, or one after changes were forgotten or lost). `held`: how many
    keys the cache holds with these applied (None: not counted), which the entry must then hold too."""

    stored: list[bytes]
    removed: list[bytes]
    whole: bool = False
    held: int | None = None


class PrefixCacheJournal:
    """Thread-safe: the engine thread notes, the consumer takes. Bounded: it mirrors the cache's keys (at most
    one per block) and forgets the evictions past `max_removed` untaken ones, making the next take whole."""

    def __init__(self, max_removed: int) -> None:
        self.max_removed = max_removed
        self._lock = threading.Lock()
        self._held: set[bytes] = set()
        self._stored: set[bytes] = set()
        self._removed: set[bytes] = set()
        self._whole = True

    def stored(self, key: bytes) -> None:
        with self._lock:
            self._held.add(key)
            self._removed.discard(key)
            if not self._whole:
                self._stored.add(key)

    def evicted(self, key: bytes) -> None:
        with self._lock:
            self._held.discard(key)
            self._stored.discard(key)
            if not self._whole:
                self._removed.add(key)
                if len(self._removed) > self.max_removed:
                    self._forget()

    def take(self) -> PrefixCacheChanges:
        with self._lock:
            if self._whole:
                changes = PrefixCacheChanges(list(self._held), [], whole=True, held=len(self._held))
            else:
                changes = PrefixCacheChanges(list(self._stored), list(self._removed), held=len(self._held))
            self._whole = False
            self._stored, self._removed = set(), set()
            return changes

    @property
    def whole_next(self) -> bool:
        """The next take is the whole cache."""
        with self._lock:
            return self._whole

    def lost(self) -> None:
        """The consumer could not apply its last take: the next one is whole."""
        with self._lock:
            self._forget()

    def _forget(self) -> None:
        self._whole = True
        self._stored.clear()
        self._removed.clear()
