"""A call's answer within a budget of the event loop's running time, not of its wall clock: a stall of the loop
itself (a large body parsed, a GC pause, a slow callback) is the caller's own, and must not turn into a miss of
the service it asked (which may have answered during the stall, or not yet have had the request: the loop had
not sent it). `asyncio.wait_for` counts the stall and gives up as the loop resumes; on Python 3.11 a give-up
that lands just as the call's write ended is swallowed inside redis-py (its own `wait_for` on the write), and
that call ran on past the budget until the socket's timeout. This gives up only after a budget the loop ran
through, long after a write the stall held back."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")
LOOKS = 3  # the budget, and after a stall at most two more: a loop stalling at every turn still ends the wait


async def within_budget(call: Awaitable[T], budget_s: float) -> T:
    """`call`'s result, or TimeoutError once it has had `budget_s` of the loop's time without one.

    A budget whose timer fired a whole budget or more late was a stall's, not the call's: the loop looks again for
    another budget, reading an answer that came during the stall and sending a request the stall held back. A busy
    loop's turns (a few milliseconds each, the timer a few turns late) are no stall: the wait ends as `wait_for`'s
    would. So a call waits about `budget_s` past the stalls, and at most LOOKS budgets and their stalls. Given up or
    cancelled, the call is cancelled and waited for (as `wait_for` does: nothing of it runs after this returns); a
    cancel is raised even when the answer came at the same moment (3.11's `wait_for` returned it)."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(call)
    task.add_done_callback(_seen)
    try:
        for _ in range(LOOKS):
            due = loop.time() + budget_s
            await asyncio.wait([task], timeout=budget_s)
            if task.done():
                return task.result()
            if loop.time() - due < budget_s:  # the loop ran through the budget: no answer came
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


def _seen(task: asyncio.Future[T]) -> None:
    """Its failure is read, so a caller cancelled while waiting for it to stop leaves no "never retrieved" log."""
    if not task.cancelled():
        task.exception()
