"""Workers a failed call took out of placement at once, without waiting for the registry's TTL to drop them.

An ejection holds for `hold_s`, or until the worker's registry entry shows a new address (Ray restarted it:
the failed process is gone). While every worker of a role is ejected, placement takes the one ejected longest
ago: a worker that may have recovered beats answering UNAVAILABLE with workers alive, and the one that failed
last is the least likely to have (a worker resumed after a stall, say, against one killed a moment ago).
"""

from __future__ import annotations

import logging
import time

from pdserve.registry.base import WorkerState

log = logging.getLogger(__name__)


class Ejections:
    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self._until: dict[tuple[str, str], float] = {}  # (worker_id, address) -> monotonic expiry

    def eject(self, worker: WorkerState, reason: str) -> None:
        now = time.monotonic()
        self._until = {k: t for k, t in self._until.items() if t > now}  # restarted workers' keys age out here
        self._until[(worker.worker_id, worker.address)] = now + self.hold_s
        log.warning(
            "worker %s at %s out of placement for %g s: %s",
            worker.worker_id,
            worker.address,
            self.hold_s,
            reason,
            extra={"worker_id": worker.worker_id, "address": worker.address},
        )

    def ejected(self, worker: WorkerState) -> bool:
        key = (worker.worker_id, worker.address)
        until = self._until.get(key)
        if until is None:
            return False
        if until <= time.monotonic():
            del self._until[key]
            return False
        return True

    def usable(self, workers: list[WorkerState]) -> list[WorkerState]:
        """The workers not ejected; when that leaves none, the one(s) ejected longest ago."""
        free = [w for w in workers if not self.ejected(w)]
        if free or not workers:
            return free
        until = {w.worker_id: self._until[(w.worker_id, w.address)] for w in workers}  # all held: ejected() kept them
        first = min(until.values())
        return [w for w in workers if until[w.worker_id] == first]
