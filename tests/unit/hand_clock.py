"""A clock moved by hand, for code that takes one (`clock=`): time passes in a test without waiting for it."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.registry.redis_clock import RedisClock


class HandClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class HandRedisClock(RedisClock):
    """Redis's clock moved on by hand (Redis's own cannot be): `TIME`'s answer plus `moved()` seconds, so entries
    shared in Redis's time lapse in a test without waiting."""

    def __init__(self, moved: Callable[[], float]) -> None:
        super().__init__()
        self.moved = moved

    def read(self, answer: tuple[int, int], local_now: float) -> float:
        seconds, micros = divmod(answer[0] * 10**6 + answer[1] + round(self.moved() * 1e6), 10**6)
        return super().read((seconds, micros), local_now)
