"""When each request first ran in an engine step: written on the engine thread, taken on the event loop's."""

from __future__ import annotations

import threading
from collections.abc import Iterable

KEPT = 4096  # times never taken (a caller that does not trace): past this many the oldest are forgotten


class StartTimes:
    """Request id -> wall-clock ns when the first step that ran it began (its queue wait ends there). The lock
    keeps the engine thread's trimming of the oldest from racing a caller's take of that same one."""

    def __init__(self) -> None:
        self._ns: dict[str, int] = {}
        self._taken: set[str] = set()  # streams still open whose start was taken: never marked again
        self._lock = threading.Lock()

    def mark(self, request_ids: Iterable[str], start_ns: int) -> None:
        """On the engine thread: the step that began at `start_ns` ran these; earlier marks are kept."""
        with self._lock:
            for rid in request_ids:
                if rid not in self._taken:
                    self._ns.setdefault(rid, start_ns)
            while len(self._ns) > KEPT:
                self._ns.pop(next(iter(self._ns)))

    def take(self, request_id: str) -> int | None:
        """The request's start, once; None if it has not run."""
        with self._lock:
            ns = self._ns.pop(request_id, None)
            if ns is not None:
                self._taken.add(request_id)
            return ns

    def forget(self, request_id: str) -> None:
        """Its stream ended: its start, taken or not, is nobody's now (kept, it would fill the map to KEPT)."""
        with self._lock:
            self._ns.pop(request_id, None)
            self._taken.discard(request_id)
