"""A worker's idle re-check of its speed, for the worker the router prices too slow to send anything.

A worker's start-up profile, timed while other processes loaded its host (new workers of a rollout profiling beside
old ones serving), prices it k times slow; at low load the router then places every request elsewhere, its live
steps never come, and its correction (`SpeedTracker`) never moves. So a worker that takes prompts times one of its
own through its engine (engine/speed_probe.py) when it idles: once nothing ran or was held there for `idle_s`, at
most every `every_s` after its speed was last read, by a live step or a probe. The probe's reading (a prefill
worker's: its prompt's step; a colocated worker's: a decode step after it) replaces the factor, which the heartbeat
publishes; one far off the factor only once a second probe confirms it (a probe paused by a GC or a freeze read up to
4x slow, and the worker got nothing until the next probe).

A decode-only worker is not probed: the router takes, among the decode workers with room that meet a request's
TPOT SLO, the one with the most free blocks, so a slow profile keeps one idle only under an SLO it seems to miss;
and its engine decodes only sequences whose KV arrived, so a probe would decode over blocks holding no prompt's KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from pdserve.protocol.roles import Role

if TYPE_CHECKING:
    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.engine.profiling import SpeedTracker

log = logging.getLogger(__name__)
LOOKS_PER_IDLE = 5  # the engine's load is looked at this often within `idle_s` (at most every second)


class SpeedRecheck:
    def __init__(self, role: Role, idle_s: float, every_s: float) -> None:
        """`every_s` 0: never (and never for a decode-only worker)."""
        self.idle_s, self.every_s = idle_s, every_s
        self._on = role is not Role.DECODE and every_s > 0
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    def start(self, engine: AsyncEngine, speed: SpeedTracker) -> None:
        """On the worker's loop, once it serves; not after `stop` (a drain that came during the start)."""
        if self._on and not self._stopped:
            self._task = asyncio.ensure_future(self._run(engine, speed))

    async def stop(self) -> None:
        """No probe from now on (a drain, a shutdown): one the engine thread already runs ends with its one step."""
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self, engine: AsyncEngine, speed: SpeedTracker) -> None:
        busy_at = tried_at = time.monotonic()
        while engine.alive:
            await asyncio.sleep(min(self.idle_s / LOOKS_PER_IDLE, 1.0))
            now, stats = time.monotonic(), engine.stats
            if stats["sequences"] or stats["kv_blocks_used"]:  # a hand-off's blocks too, their KV on the wire
                busy_at = now
            quiet = now - max(busy_at, speed.stepped_at) >= self.idle_s
            if not quiet or now - max(speed.observed_at, tried_at) < self.every_s:
                continue
            tried_at, factor = now, speed.factor
            try:
                if await engine.probe_speed(speed, lambda: not self._stopped):
                    log.debug("speed probe: factor %.3f -> %.3f", factor, speed.factor)
            except Exception as e:  # the engine died (the loop ends), or its step failed: the next probe may not
                log.warning("speed probe failed: %r", e)
