"""The process's own background tasks: one that repeats a call, stopping one (cancelled, and waited for until it
has ended, so nothing it holds, a connection or a lock, is used after its owner closed), and a cleanup that runs to
its end however often its caller is cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

RECANCEL_S = 1.0  # longer than any of the process's tasks takes to end once cancelled


def repeating(call: Callable[[], Awaitable[Any]], interval_s: float, name: str) -> asyncio.Task[None]:
    """A task on the running loop that awaits `call()` every `interval_s`, first after one interval; `call` must
    not raise (an exception would end the task)."""

    async def run() -> None:
        while True:
            await asyncio.sleep(interval_s)
            await call()

    return asyncio.get_running_loop().create_task(run(), name=name)


async def cancel_and_wait(task: asyncio.Task[Any] | None, recancel_s: float = RECANCEL_S) -> None:
    """Ends `task` (None: nothing to end); its cancellation is the expected end, not an error, and its own failure
    is raised. A cancel the task swallowed is sent again every `recancel_s`: on Python 3.11 an `asyncio.wait_for`
    (redis-py's own included) whose call ends just as the cancel lands returns the call's result and drops the
    cancel, and a repeating task would then run on with this wait never ending (a router's stop hung in CI)."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=recancel_s)
    if not task.cancelled():
        task.result()


async def through_cancels(cleanup: Coroutine[Any, Any, T], context: contextvars.Context | None = None) -> T:
    """Runs `cleanup` to its end in a task of its own (in `context`; None: a copy of the current one), however often
    the caller is cancelled meanwhile; a cancel the caller got is raised once it has ended. gRPC cancels a call's
    task once its transport is gone, whatever the handler is doing then: its cleanup would stop at its first await."""
    task = asyncio.get_running_loop().create_task(cleanup, context=context)
    caller = asyncio.current_task()
    cancels = caller.cancelling() if caller is not None else 0
    while not task.done():
        with contextlib.suppress(asyncio.CancelledError):  # the caller's: counted below
            await asyncio.wait([task])
    if caller is not None and caller.cancelling() > cancels:
        if not task.cancelled() and (error := task.exception()) is not None:  # the cancel would hide it
            log.error("cleanup failed while its caller was cancelled: %r", error, exc_info=error)
        raise asyncio.CancelledError
    return task.result()
