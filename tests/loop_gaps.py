"""How long an event loop went without running while a coroutine ran on it: work meant to stay off the router's
loop (a costly constraint's compile, a large answer's encoding) is checked by the longest gap it left."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def longest_loop_gap(during: Callable[[], Awaitable[T]]) -> tuple[float, T]:
    """The longest the loop went without running a 1 ms tick while `during()` ran on it, and what it returned."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    try:
        result = await during()
    finally:
        done.set()
        await ticker
    return max(gaps), result
