"""`within_budget` on plain futures: a stall of the loop is not counted against the call, a call that never
answers still times out once the loop runs (and on a loop that lags at every turn), and a cancel is never swallowed
by an answer at the same moment."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.loop_budget import within_budget

pytestmark = pytest.mark.timeout(30)


def stall_then_answer(answer: asyncio.Future[int] | None) -> None:
    """The loop blocks for four budgets of 0.1 s at its next callback; `answer` comes 10 ms after."""
    loop = asyncio.get_running_loop()

    def stall() -> None:
        time.sleep(0.4)
        if answer is not None:
            loop.call_later(0.01, answer.set_result, 1)

    loop.call_soon(stall)


async def test_an_answer_that_comes_just_after_a_stall_is_the_calls():
    answer = asyncio.get_running_loop().create_future()
    stall_then_answer(answer)
    assert await within_budget(answer, 0.1) == 1


async def test_a_call_that_never_answers_times_out_after_a_stall_and_is_cancelled():
    never = asyncio.get_running_loop().create_future()
    stall_then_answer(None)
    with pytest.raises(TimeoutError):
        await within_budget(never, 0.1)
    assert never.cancelled()


async def test_a_call_that_never_answers_times_out_on_a_loop_that_lags_at_every_turn():
    """A loop that stalls at every turn fires every timer a budget late: each look is one after a stall, and the
    wait still ends (after LOOKS budgets) while the loop stalls, not once it stops (here after 200 turns)."""
    loop, never = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()
    turns = 0

    def lag() -> None:
        nonlocal turns
        time.sleep(0.1)  # a stall of the whole 0.1 s budget
        turns += 1
        if turns < 200:
            loop.call_soon(lag)

    loop.call_soon(lag)
    with pytest.raises(TimeoutError):
        await within_budget(never, 0.1)
    assert turns < 200
    assert never.cancelled()


async def test_a_busy_loop_is_no_stall_the_wait_ends_after_one_budget():
    """Turns of 10 ms (a loaded router) fire the budget's timer a few turns late: no stall, so the call that never
    answers is given up on then, not looked at for two more budgets. Counted in turns, not timed."""
    loop, never = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()
    turns, busy = 0, True

    def turn() -> None:
        nonlocal turns
        time.sleep(0.01)
        turns += 1
        if busy:
            loop.call_soon(turn)

    loop.call_soon(turn)
    try:
        with pytest.raises(TimeoutError):
            await within_budget(never, 0.1)
    finally:
        busy = False
    assert turns < 2 * 0.1 / 0.01  # one budget's turns and a few: not LOOKS budgets'


async def test_a_cancel_is_raised_even_when_the_answer_comes_with_it():
    """Python 3.11's wait_for returned the answer and dropped the cancel: its caller ran on as if not cancelled."""
    answer = asyncio.get_running_loop().create_future()
    caller = asyncio.ensure_future(within_budget(answer, 1.0))
    await asyncio.sleep(0)  # the caller waits
    answer.set_result(1)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
