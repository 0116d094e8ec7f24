"""The fastest each worker has been lately, which the idle cluster's offer is judged at (admission's
INVALID_ARGUMENT).

A worker's start-up profile times its model runner alone; its live steps also schedule, sample and emit tokens,
and a first token also crosses the router and the hand-off. So a worker may never run at its profile's speed (a
small model, or a GPU, whose runner steps are short), and an offer at that speed would promise SLOs that no idle
worker meets: admission would shed such a request (RESOURCE_EXHAUSTED) for ever, each retry as hopeless as the
first. Once a worker's live corrections have been watched for `WINDOW_S`, the offer takes the best speed they
showed over the last `WINDOW_S`: an SLO the worker met at its best lately waits out a slowdown that passes, one
below it is refused as impossible. Not its best ever: the corrections converge from the profile at start, and a
value on the way would make the offer a promise again. Until then the profile's speed stands (or faster, where
the corrections say so), since a worker first seen slowed may be slowed by contention that passes.
"""

from __future__ import annotations

import time
from collections import deque

UNCORRECTED = 1.0  # the live factors' value before any step or first token corrected them
WINDOW_S = 60.0


class BestSpeeds:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._since: dict[tuple[str, str], float] = {}  # (worker id, what) -> its first correction
        # (worker id, what) -> (time, factor) within the window, factors rising: the front is the lowest
        self._lowest: dict[tuple[str, str], deque[tuple[float, float]]] = {}

    def best(self, worker_id: str, what: str, factor: float, uncorrected: float = UNCORRECTED) -> float:
        """The speed to offer `worker_id`'s `what` ("ttft", "tpot") at, given its live `factor` now (a multiplier
        of the profile's times: lower is faster). Or any other live correction where lower is faster, `uncorrected`
        its value before anything corrected it (a first token's fixed cost, "fixed": 0 s)."""
        key, now = (worker_id, what), time.monotonic()
        if key not in self._since:
            if factor == uncorrected:
                return uncorrected
            self._since[key], self._lowest[key] = now, deque()
        seen = self._lowest[key]
        while seen and seen[-1][1] >= factor:
            seen.pop()
        seen.append((now, factor))
        while seen[0][0] < now - self.window_s:
            seen.popleft()
        lowest = seen[0][1]
        return lowest if now - self._since[key] >= self.window_s else min(lowest, uncorrected)

    def worker_ids(self) -> set[str]:
        return {worker_id for worker_id, _ in self._since}

    def forget(self, worker_id: str) -> bool:
        for key in [key for key in self._since if key[0] == worker_id]:
            del self._since[key], self._lowest[key]
        return True
