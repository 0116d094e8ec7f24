"""Fault injection in the engine step, for tests: a step that runs a named request raises (the engine thread dies
as on a real step failure) or takes longer (a slow device)."""

from __future__ import annotations

import time
from collections.abc import Iterable


class InjectedEngineFault(RuntimeError):
    """Raised in the engine step on purpose (`fail_when_stepped`): tests kill the engine thread with it."""


class StepFaults:
    """Set from the event loop, read on the engine thread after each step; off (empty) unless a test sets one."""

    def __init__(self) -> None:
        self._doomed: set[str] = set()  # a step that runs one of these request ids raises
        self._slowed: dict[str, float] = {}  # a step that runs one of these sleeps this long

    def fail_when_stepped(self, request_id: str) -> None:
        """The first engine step that runs `request_id` raises, which ends the engine thread as a real step
        failure would (tests of what a worker does when its engine dies)."""
        self._doomed.add(request_id)

    def slow_when_stepped(self, request_id: str, seconds: float) -> None:
        """Each step running `request_id` takes `seconds` more, until the engine drops it (`forget`)."""
        self._slowed[request_id] = seconds

    def forget(self, request_id: str) -> None:
        self._slowed.pop(request_id, None)

    def stepped(self, request_ids: Iterable[str]) -> None:
        """On the engine thread, after a step that ran `request_ids`: raises or sleeps as set."""
        if not (self._doomed or self._slowed):
            return
        ran = set(request_ids)
        if hit := self._doomed & ran:
            raise InjectedEngineFault(f"fault injected: the engine step ran {sorted(hit)}")
        if delay := max((self._slowed.get(r, 0.0) for r in ran), default=0.0):
            time.sleep(delay)
