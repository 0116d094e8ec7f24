"""Whether the router has workers to place a request on; the health of its Generation service says so.

A router with no live prefill or decode worker (none started yet, every one restarting, drained or ejected) answers
each request UNAVAILABLE after `no_workers_wait_s`. Its server's health ("") stays SERVING: the process is well, it
answers, and the chart's probes restart or unlist a router only for its own faults, not for its workers' absence
(every router of a cluster shares it; unlisting them all turns a clear UNAVAILABLE into refused connections). The
health of `pdserve.v1.Generation` says what a caller choosing among clusters needs: NOT_SERVING while placement has
no live prefill and decode worker that may be paired (kv_pairing.py), so a global load balancer or a client's
health check can route to another.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from pdserve.background import cancel_and_wait, repeating
from services.router.placement import PlacementPolicy

log = logging.getLogger(__name__)

EVERY_S = 1.0


class WorkerPresence:
    def __init__(self, placement: PlacementPolicy, every_s: float = EVERY_S) -> None:
        self.placement = placement
        self.every_s = every_s
        self.on_change: Callable[[], Awaitable[None]] | None = None  # the health it feeds, set again on a change
        self.servable = placement.can_place()
        self._task: asyncio.Task[None] | None = None

    async def check(self) -> None:
        servable = self.placement.can_place()
        if servable == self.servable:
            return
        self.servable = servable
        if servable:
            log.info("live prefill and decode workers again: pdserve.v1.Generation SERVING")
        else:
            log.warning(
                "no live prefill or decode worker to place a request on (`pdserve status` lists them): "
                "pdserve.v1.Generation NOT_SERVING until one of each serves"
            )
        if self.on_change is not None:
            await self.on_change()

    def start(self) -> None:
        self._task = repeating(self._check_logged, self.every_s, "worker-presence")

    async def close(self) -> None:
        await cancel_and_wait(self._task)

    async def _check_logged(self) -> None:
        try:
            await self.check()
        except Exception:  # the router's health must not stop following its workers over one bad round
            log.exception("worker presence check failed")
