"""A request stream whose every step races an end that may come from outside it: a worker's drain cutting what is
left (cluster/drain.py), the router abandoning a prefill hand-off (services/prefill/servicer.py).

Each step runs in a task of its own, all in one context, so what a step sets (the request id for log lines) holds
for the next and for the stream's close. An end cancels the step in flight and waits for its cleanup (an engine
abort, a KV send called off or ending by its own deadlines) before the stream ends with the end's error, as on a
caller's cancel.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any


async def until_ended(
    items: AsyncGenerator[Any, None],
    end: asyncio.Future[None],
    context: contextvars.Context,
    error: Callable[[], Exception],
) -> AsyncGenerator[Any, None]:
    """`items`, each step raced against `end`; once `end` is done first, `error()` is raised."""
    while True:
        step = asyncio.get_running_loop().create_task(_next(items), context=context)
        try:
            await asyncio.wait((step, end), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the caller left: the step's cleanup runs before the handler ends
            await _cancelled(step)
            raise
        if not step.done():
            await _cancelled(step)
            raise error()
        try:
            item = step.result()
        except StopAsyncIteration:
            return
        yield item


async def _next(items: AsyncIterator[Any]) -> Any:
    return await items.__anext__()


async def _cancelled(step: asyncio.Task[Any]) -> None:
    """Cancels the step and waits for its cleanup (a prefill's KV send ends by its own deadlines), through the
    stream's own cancels meanwhile, raised once it has ended; an outcome it reached meanwhile goes with the stream.
    Cut short, the step would still be running the stream's generator, which could then not be closed."""
    step.cancel()
    interrupted = False
    while not step.done():
        try:
            await asyncio.wait((step,))
        except asyncio.CancelledError:
            interrupted = True
    if not step.cancelled():
        step.exception()  # read, so asyncio does not log it as never retrieved
    if interrupted:
        raise asyncio.CancelledError
