"""The router's own holds: its process stopped for a while (SIGSTOP, a stalled VM, a long GC pause), which its
workers take for a lost peer.

While the router is held, nothing answers its workers' keepalive pings: each worker drops its connection to the
router (ping timeout, 5-15 s into the hold), and its first-token bounds pass on the router's clock. Resumed, the
router reads every call in flight failed: healthy workers, each of which it ejected (a review stopped a router 25 s
mid-stream: both of its decode workers out of placement for 10 s, and counted as ejections, an alert's flapping
workers). A ticker on the router's loop notices the hold as its tick comes late; a worker's call that fails while a
hold ends, or within EXCUSE_S after, moves or retries its request as any failure does, but ejects no worker: the
failure may be the router's own. A worker truly lost meanwhile is still avoided by the requests it failed, and its
supervisor unlists it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from pdserve.background import cancel_and_wait, repeating

log = logging.getLogger(__name__)
TICK_S = 0.25
HELD_S = 2.0  # a tick this much late: the loop was held, not merely busy (a starved one lags less)
EXCUSE_S = 5.0  # past the hold's end: reading what failed meanwhile (every stream's call) takes a loaded loop a while
# The ejection reasons (retry.EJECTION_REASONS) a hold of the router alone can cause: a connection its worker dropped,
# a bound that passed on the router's clock. Not a worker the registry unlisted, that refused the router, or drains.
HOLD_FAILURES = ("unavailable", "no_first_token", "stalled")


class OwnHolds:
    def __init__(self) -> None:
        self._ticked_at = time.monotonic()
        self._held_until = -math.inf
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """On the router's loop, once it serves."""
        self._ticked_at = time.monotonic()
        self._task = repeating(self._tick, TICK_S, "own-holds")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    def excuse(self) -> bool:
        """Whether a worker's failure seen now may be the router's own hold's: one ends now (its late tick has not
        run yet), or ended within EXCUSE_S."""
        now = time.monotonic()
        ending = self._task is not None and now - self._ticked_at > TICK_S + HELD_S
        return ending or now - self._held_until < EXCUSE_S

    async def _tick(self) -> None:
        now = time.monotonic()
        held_s = now - self._ticked_at - TICK_S
        self._ticked_at = now
        if held_s > HELD_S:
            self._held_until = now
            log.warning(
                "the router was held %.1f s (stopped, a stalled VM or a long pause): its workers' calls that failed "
                "meanwhile eject none of them",
                held_s,
            )
