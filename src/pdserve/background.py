"""The process's own background tasks: one that repeats a call, and stopping one (cancelled, and waited for until it
has ended, so nothing it holds, a connection or a lock, is used after its owner closed)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any


def repeating(call: Callable[[], Awaitable[Any]], interval_s: float, name: str) -> asyncio.Task[None]:
    """A task on the running loop that awaits `call()` every `interval_s`, first after one interval; `call` must
    not raise (an exception would end the task)."""

    async def run() -> None:
        while True:
            await asyncio.sleep(interval_s)
            await call()

    return asyncio.get_running_loop().create_task(run(), name=name)


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Ends `task` (None: nothing to end); its cancellation is the expected end, not an error."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
