"""This router's admitted totals, added into the registry's cluster-wide ones (Redis: one hash every router adds to),
so `pdserve autoscale` sees the whole cluster's load through any one router."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pdserve.protocol.admitted import AdmittedTotals
from pdserve.registry.base import Registry
from pdserve.registry.redis import Throttled

log = logging.getLogger(__name__)
FLUSH_S = 1.0


class ClusterAdmitted:
    """`local` is what the lifecycle counts; every `FLUSH_S`, and before every read, what it gained since the last
    flush is added to the registry's totals. A flush that fails is retried with the next one (nothing counted
    twice, nothing lost), and a read that fails answers this router's own totals."""

    def __init__(self, registry: Registry, local: AdmittedTotals) -> None:
        self.registry = registry
        self.local = local
        self._flushed = AdmittedTotals()
        self._lock = asyncio.Lock()  # one flush at a time: two would add the same delta twice
        self._warn = Throttled(30.0, log)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await self.flush()
        except Exception as e:  # this router's last second is not counted
            log.warning("admitted totals not added to the registry at stop: %r", e)

    async def totals(self) -> AdmittedTotals:
        try:
            await self.flush()
            return await asyncio.to_thread(self.registry.admitted)
        except Exception as e:  # Redis down: this router's share is all it can say
            self._warn.warning("cluster's admitted totals unknown, answering this router's: %r", e)
            return self.local.copy()

    async def flush(self) -> None:
        async with self._lock:
            now = self.local.copy()
            more = now.since(self._flushed)
            if more != AdmittedTotals():  # requests may only have finished since: that counts too
                await asyncio.to_thread(self.registry.add_admitted, more)
            self._flushed = now

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            try:
                await self.flush()
            except Exception as e:  # kept for the next flush
                self._warn.warning("admitted totals not added to the registry: %r", e)
