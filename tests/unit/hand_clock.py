"""A clock moved by hand, for code that takes one (`clock=`): time passes in a test without waiting for it."""

from __future__ import annotations


class HandClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
