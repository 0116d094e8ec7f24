"""Stopping a background task that drops a cancel, as Python 3.11's `asyncio.wait_for` does when its call ends
just as the cancel lands; a cleanup that runs to its end through its caller's cancels."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from pdserve.background import cancel_and_wait, through_cancels


async def test_a_repeating_task_that_swallowed_the_cancel_is_cancelled_again_and_ends():
    swallowed = 0

    async def swallows_one_cancel() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # the call "returned": the loop goes on

    task = asyncio.get_running_loop().create_task(swallows_one_cancel())
    await asyncio.sleep(0.05)
    await asyncio.wait_for(cancel_and_wait(task, recancel_s=0.1), timeout=5)
    assert task.cancelled() and swallowed == 1


async def test_a_task_that_failed_raises_its_failure_and_none_is_nothing():
    async def fails() -> None:
        raise ValueError("its own")

    task = asyncio.get_running_loop().create_task(fails())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="its own"):
        await cancel_and_wait(task)
    await cancel_and_wait(None)


async def test_a_cleanup_runs_to_its_end_through_its_callers_cancels_which_are_raised_after():
    steps: list[str] = []

    async def cleanup() -> str:
        for step in ("abort sent", "blocks freed"):
            await asyncio.sleep(0.05)
            steps.append(step)
        return "closed"

    caller = asyncio.get_running_loop().create_task(through_cancels(cleanup()))
    for _ in range(2):  # as gRPC cancels a call's task, and a server's stop cancels it again
        await asyncio.sleep(0.02)
        caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert steps == ["abort sent", "blocks freed"]
    assert await through_cancels(cleanup()) == "closed"  # uncancelled: its result


async def test_a_cleanup_runs_in_the_context_given_and_its_failure_a_cancel_would_hide_is_logged(caplog):
    request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
    steps = contextvars.copy_context()
    steps.run(request_id.set, "r1")  # as a worker's stream sets it in a step

    async def cleanup() -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError(f"abort of {request_id.get()} failed")

    caller = asyncio.get_running_loop().create_task(through_cancels(cleanup(), steps))
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        "cleanup failed while its caller was cancelled: RuntimeError('abort of r1 failed')"
    ]
