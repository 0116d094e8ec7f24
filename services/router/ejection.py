"""Workers a failed call took out of placement at once, without waiting for the registry's TTL to drop them.

An ejection holds for `hold_s`, or until the worker's registry entry shows a new address or a new instance (Ray
restarted it, the failed process is gone; a pod's worker restarted in place keeps its address). While every
worker of a role is ejected, placement takes the one ejected longest ago: a worker that may have recovered beats
answering UNAVAILABLE with workers alive, and the one that failed last is the least likely to have (a worker
resumed after a stall, say, against one killed a moment ago).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pdserve.registry.base import WorkerState

log = logging.getLogger(__name__)


class Ejections:
    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self._until: dict[tuple[str, str, str], float] = {}  # _process(worker) -> monotonic expiry
        # Told of each worker taken out of placement (not of a hold renewed): the router's ejection counter.
        self.on_eject: Callable[[WorkerState, str], None] | None = None

    def eject(self, worker: WorkerState, reason: str, detail: str = "") -> None:
        """Out of placement for `hold_s` from now, for `reason` (one of retry.EJECTION_REASONS); `detail`: the
        failure's own words, for the log only."""
        now = time.monotonic()
        fresh = not self.ejected(worker)  # the requests in flight on a lost worker renew one ejection
        self._until = {k: t for k, t in self._until.items() if t > now}  # restarted workers' keys age out here
        self._until[_process(worker)] = now + self.hold_s
        if fresh and self.on_eject is not None:
            self.on_eject(worker, reason)
        # One WARNING an ejection, as it is counted once: each of its other requests failing meanwhile only renews
        # the hold (a worker lost with 200 streams logged 200 lines).
        log.log(
            logging.WARNING if fresh else logging.DEBUG,
            "worker %s at %s out of placement for %g s%s: %s",
            worker.worker_id,
            worker.address,
            self.hold_s,
            "" if fresh else " (renewed)",
            detail or reason,
            extra={"worker_id": worker.worker_id, "address": worker.address, "reason": reason},
        )

    def ejected(self, worker: WorkerState) -> bool:
        key = _process(worker)
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
        until = {w.worker_id: self._until[_process(w)] for w in workers}  # all held: ejected() kept them
        first = min(until.values())
        return [w for w in workers if until[w.worker_id] == first]


def _process(worker: WorkerState) -> tuple[str, str, str]:
    """The worker's process: a restart under the same id shows a new address or a new instance."""
    return worker.worker_id, worker.address, worker.instance
