"""Stopping a background task of the process's own: cancelled, and waited for until it has ended, so nothing it
holds (a connection, a lock) is used after its owner closed."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Ends `task` (None: nothing to end); its cancellation is the expected end, not an error."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
