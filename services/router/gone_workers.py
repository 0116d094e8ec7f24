"""Forgets what the router keeps per worker id once that worker has been out of the registry for a while.

The router keeps some state per worker id it has placed on: load bookkeeping, its TTFT correction, recent
latencies for `pdserve status` (~32 KB an id). Scaling numbers a new worker one past the highest index in use, so
with autoscaling churn the ids keep growing, and over a long uptime the gone ones would pile up without bound. A
worker missing from the registry for `gone_after_s` is forgotten, unless a request placed on it is still in
flight (its end still has to be counted); one back within that time keeps everything, and an id handed out again
later starts afresh, as its new process does. While Redis does not answer, nothing is counted as gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from pdserve.background import cancel_and_wait
from pdserve.registry.base import Registry

log = logging.getLogger(__name__)

GONE_AFTER_S = 300.0  # longer than a registry outage the router rides out, or a worker's restart
SWEEP_S = 60.0


class PerWorkerState(Protocol):
    def worker_ids(self) -> set[str]:
        """The ids it holds anything for."""

    def forget(self, worker_id: str) -> bool:
        """Drops everything held for `worker_id`; False (and keeps it) while something of it is in use."""


class GoneWorkers:
    def __init__(
        self,
        registry: Registry,
        parts: list[PerWorkerState],
        gone_after_s: float = GONE_AFTER_S,
        sweep_s: float = SWEEP_S,
    ) -> None:
        self.registry = registry
        self.parts = parts
        self.gone_after_s = gone_after_s
        self.sweep_s = sweep_s
        self._missing_since: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    def sweep(self, now: float | None = None) -> set[str]:
        """One pass: the ids forgotten by every part. None while the registry's view is not current (Redis does
        not answer): a view kept or dropped through an outage says nothing of who is gone."""
        now = time.monotonic() if now is None else now
        if not self.registry.view_current():
            return set()
        registered = {w.worker_id for w in self.registry.workers()}
        held = set().union(*(part.worker_ids() for part in self.parts))
        self._missing_since = {i: t for i, t in self._missing_since.items() if i in held and i not in registered}
        forgotten = set()
        for worker_id in held - registered:
            since = self._missing_since.setdefault(worker_id, now)
            if now - since < self.gone_after_s:
                continue
            if all([part.forget(worker_id) for part in self.parts]):  # every part: each drops what it can
                forgotten.add(worker_id)
                del self._missing_since[worker_id]
        if forgotten:
            log.info("forgot %d workers gone from the registry for %g s", len(forgotten), self.gone_after_s)
        return forgotten

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            try:
                self.sweep()
            except Exception:  # a bug here must not stop serving; the next sweep tries again
                log.exception("sweep of gone workers' state failed")
