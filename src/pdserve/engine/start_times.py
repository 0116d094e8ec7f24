"""When each request first ran in an engine step: written on the engine thread, taken on the event loop's."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from itertools import islice
from typing import NamedTuple

KEPT = 4096  # times never taken (a caller that does not trace): past this many the oldest are forgotten


class StepStart(NamedTuple):
    """When a step began, on both clocks: the wall clock's for a span's start (exported, read beside other hosts'
    times), the monotonic one for a duration, which a step of the wall clock (NTP's) would skew."""

    wall_ns: int  # time.time_ns()
    monotonic_ns: int  # time.monotonic_ns()


class StartTimes:
    """Request id -> when the first step that ran it began (its queue wait ends there). The lock keeps the engine
    thread's trimming of the oldest from racing a caller's take of that same one."""

    def __init__(self) -> None:
        self._ns: dict[str, StepStart] = {}
        # Streams marked once (the engine thread marks every running request each step): never marked again, or a
        # start taken mid-stream came back for nobody to take. Forgotten when the stream ends.
        self._marked: dict[str, None] = {}
        self._lock = threading.Lock()

    def mark(self, request_ids: Iterable[str], start: StepStart) -> None:
        """On the engine thread: the step that began at `start` ran these; earlier marks are kept."""
        with self._lock:
            for rid in request_ids:
                if rid not in self._marked:
                    self._marked[rid] = None
                    self._ns[rid] = start
            while len(self._ns) > KEPT:
                self._ns.pop(next(iter(self._ns)))
            for oldest in list(islice(self._marked, max(len(self._marked) - KEPT, 0))):
                del self._marked[oldest]  # a stream ended between a step's check of it and its mark, never told

    def take(self, request_id: str) -> StepStart | None:
        """The request's start, once; None if it has not run."""
        with self._lock:
            return self._ns.pop(request_id, None)

    def stream_ended(self, request_id: str) -> None:
        """Its id may start a new stream (a caller's retry): that one is marked anew. Its start stays for a
        caller that takes it after the stream ended (a prefill returns before its caller takes it)."""
        with self._lock:
            self._marked.pop(request_id, None)
