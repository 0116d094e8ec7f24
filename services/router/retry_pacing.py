"""Retry hints that spread a crowd of shed requests over the rate the router admits, instead of sending it back at once.

Admission's own hint for a shed request says when the room it was refused (a place in a decode batch, a prefill queue
drained to what the SLO leaves) should free up. It is the same for every request shed in the same moment, and does not
count them: clients that honour it exactly (gRPC's retry pushback, OpenAI's SDK reading retry-after-ms) came back as one
wave, the few places freed meanwhile went to the first of it, and the rest were shed again, with the newcomers. On a
1P:1D tiny-random cluster, Poisson load at 3x what it serves made 6-8 tries per request (364 tries/s for 60 arrivals/s),
the router's and the clients' work for them halved what the workers served (28 -> 12-17 req/s), and the storm outlived
the overload: back at 1x, sheds went on for 35 s (docs/experiments/retry_storm/).

So each shed request gets the next slot of a schedule that lets retries back at about the rate this router admits
requests (its admissions over the last WINDOW_S, so slots are 1/rate apart): no sooner than admission's own hint, after
the slots of the requests shed before it, at a random point within its slot. The hint then grows with the crowd told to
come back (the slots taken), and the requests of one crowd return apart. A slot past the longest hint, or past the
caller's gRPC deadline, is not taken: that request is told when the slot starts (at most the longest hint), which says
it would not get in within its time, and the next request shed gets the slot, so the schedule holds the retries that
can still come back, not those of callers gone by then. With nothing shed lately the schedule is empty and a shed
request gets admission's own hint.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 10.0  # admissions counted over this long: the rate slots are spaced by
MAX_SLOT_S = 1.0  # the widest slot, for a router admitting fewer than one request a second (or none lately)


class RetryPacing:
    def __init__(self, clock: Callable[[], float] | None = None, rng: random.Random | None = None) -> None:
        self.clock = clock or (lambda: time.monotonic())  # looked up per call: tests move it by hand
        self.rng = rng or random.Random()
        self._admitted: deque[float] = deque()  # when this router admitted each request of the last WINDOW_S
        self._next_slot = -math.inf  # on `clock`: the start of the first slot no shed request was given

    def admitted(self) -> None:
        now = self.clock()
        self._admitted.append(now)
        self._forget(now)

    def slot_s(self) -> float:
        """How far apart retries are let back: one admission's share of the last WINDOW_S."""
        self._forget(self.clock())
        return min(MAX_SLOT_S, WINDOW_S / max(len(self._admitted), 1))

    def hint_ms(self, own_ms: int, longest_ms: int, ahead: bool = False, left_s: float | None = None) -> int:
        """The hint for a request admission shed with `own_ms`: the next free slot no sooner than that, a random point
        within it. `ahead`: the request goes before the crowd (the one a KV claim calls back to its blocks): its own
        hint, the crowd one slot later. A slot that starts past `longest_ms`, or past the caller's deadline (`left_s`
        left; None: none), is not taken: the request is told when it starts (at most `longest_ms`), and the next one
        shed gets it."""
        now, slot, own_s = self.clock(), self.slot_s(), own_ms / 1e3
        crowd = not ahead and self._next_slot > now + own_s  # else admission's own hint
        wait_s = self._next_slot - now if crowd else own_s
        if wait_s > longest_ms / 1e3 or (left_s is not None and wait_s >= left_s):
            return min(longest_ms, max(own_ms, round(wait_s * 1e3)))
        if not crowd:
            self._next_slot = max(self._next_slot, now + own_s) + slot
            return own_ms
        self._next_slot += slot
        return min(longest_ms, math.ceil((wait_s + self.rng.uniform(0.0, slot)) * 1e3))

    def _forget(self, now: float) -> None:
        while self._admitted and self._admitted[0] <= now - WINDOW_S:
            self._admitted.popleft()
