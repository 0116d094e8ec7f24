"""A warning that a lasting failure (Redis out, a peer gone) would repeat on every request or beat: logged at most
once per interval, saying how many were held back."""

from __future__ import annotations

import logging
import time


class Throttled:
    def __init__(self, interval_s: float, logger: logging.Logger) -> None:
        self.interval_s = interval_s
        self.log = logger
        self._next = 0.0
        self._suppressed = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        if self._suppressed:
            msg, args = msg + " (and %d more since the last report)", (*args, self._suppressed)
        self.log.warning(msg, *args)
        self._next, self._suppressed = now + self.interval_s, 0
