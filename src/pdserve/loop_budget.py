"""A call's answer within a budget of the event loop's running time, not of its wall clock: a stall of the loop
itself (a large body parsed, a GC pause, a slow callback) is the caller's own, and must not turn into a miss of
the service it asked (which may have answered during the stall, or not yet have had the request: the loop had
not sent it). `asyncio.wait_for` counts the stall and gives up as the loop resumes; on Python 3.11 a give-up
that lands just as the call's write ended is swallowed inside redis-py (its own `wait_for` on the write), and
that call ran on past the budget until the socket's timeout. This gives up only after a step the loop ran
through, long after a write the stall held back."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")
SLICES = 5  # the budget is waited in these steps: a stall costs a call at most one of them


async def within_budget(call: Awaitable[T], budget_s: float) -> T:
    """`call`'s result, or TimeoutError once it has had `budget_s` of the loop's time without one.

    The budget is waited in SLICES steps; a step whose timer fired a step or more late (the loop was blocked)
    still counts as one, but the wait does not end on one: the loop looks again, reading an answer that came during
    the stall and sending a request the stall held back. So a call waits about `budget_s` past the stalls, and at
    most 2 * SLICES steps however late each fires (a loop lagging a step at every turn, overloaded). Given
    up or cancelled, the call is cancelled and waited for (as `wait_for` does: nothing of it runs after this
    returns); a cancel is raised even when the answer came at the same moment (3.11's `wait_for` returned it)."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(call)
    step, steps = budget_s / SLICES, SLICES
    try:
        while True:
            due = loop.time() + step
            await asyncio.wait([task], timeout=step)
            if task.done():
                return task.result()
            steps -= 1
            if steps <= 0 and (loop.time() - due < step or steps <= -SLICES):  # ran through the last, or lagged on
                break
    except asyncio.CancelledError:
        await _stopped(task)
        raise
    await _stopped(task)
    if task.cancelled():
        raise TimeoutError
    return task.result()  # it ended before the cancel reached it


async def _stopped(task: asyncio.Future[T]) -> None:
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()  # seen: the caller reads its result, or was cancelled and has no use for it
