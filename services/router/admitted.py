"""This router's admitted totals, added into the registry's cluster-wide ones (Redis: one hash every router adds to),
so `pdserve autoscale` sees the whole cluster's load through any one router."""

from __future__ import annotations

import asyncio
import logging
import uuid

from pdserve.background import cancel_and_wait
from pdserve.protocol.admitted import AdmittedTotals
from pdserve.registry.base import Registry
from pdserve.throttled_log import Throttled

log = logging.getLogger(__name__)
FLUSH_S = 1.0


class ClusterAdmitted:
    """`local` is what the lifecycle counts; every `FLUSH_S`, and before every read, what it gained since the last
    flush is added to the registry's totals. An add that fails is sent again, the same and under the same number,
    until it succeeds: Redis may have applied it and lost only the reply, and then skips the retry (nothing counted
    twice, nothing lost). A read that fails answers this router's own totals."""

    def __init__(self, registry: Registry, local: AdmittedTotals) -> None:
        self.registry = registry
        self.local = local
        self._writer = uuid.uuid4().hex  # this router process, as the registry tells its adds apart
        self._seq = 0  # the number of the last add taken
        self._pending: AdmittedTotals | None = None  # taken, not yet known to be added
        self._flushed = AdmittedTotals()
        self._lock = asyncio.Lock()  # one flush at a time: two would add the same delta twice
        self._warn = Throttled(30.0, log)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        try:
            await self.flush()
        except Exception as e:  # this router's last second is not counted
            log.warning("admitted totals not added to the registry at stop: %r", e)

    async def totals(self) -> tuple[AdmittedTotals, bool]:
        """The cluster's totals and True, or this router's own and False when the registry cannot answer."""
        try:
            await self.flush()
            return await asyncio.to_thread(self.registry.admitted), True
        except Exception as e:  # Redis down: this router's share is all it can say
            self._warn.warning("cluster's admitted totals unknown, answering this router's: %r", e)
            return self.local.copy(), False

    async def flush(self) -> None:
        """The add that failed before, if any, then what is new."""
        async with self._lock:
            for _ in range(2):
                if self._pending is None:
                    now = self.local.copy()
                    more = now.since(self._flushed)
                    if more == AdmittedTotals():  # requests may only have finished since: that counts too
                        return
                    self._seq, self._pending, self._flushed = self._seq + 1, more, now
                await asyncio.to_thread(self.registry.add_admitted, self._pending, self._writer, self._seq)
                self._pending = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            try:
                await self.flush()
            except Exception as e:  # kept for the next flush
                self._warn.warning("admitted totals not added to the registry: %r", e)
