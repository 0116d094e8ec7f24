"""Actor calls on threads of their own, with a real local Ray: answers and errors as `ray.get` gives them, a slow
call times out on time while the loop runs on, no more threads than the bound call at once, and each gives its slot
back when its call ends."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from pdserve.cluster import actor_calls
from pdserve.cluster.actor_calls import answer

pytestmark = pytest.mark.timeout(120)


@ray.remote(num_cpus=0, max_concurrency=16)
class Answering:
    def echo(self, value: int) -> int:
        return value

    def slow(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def broken(self) -> None:
        raise ValueError("its own error")


def start_local_ray() -> None:
    """A local Ray, tried twice: once in ~2700 tests on 2 loaded cores its GCS wrote no port file in Ray's 30 s
    (a Ray start failing is not what this module tests)."""
    for attempt in (1, 2):
        try:
            ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=80 * 2**20)
            return
        except RuntimeError:
            ray.shutdown()
            if attempt == 2:
                raise


@pytest.fixture(scope="module")
def actor() -> Iterator[Any]:
    start_local_ray()
    try:
        handle = Answering.remote()  # type: ignore[attr-defined]
        ray.get(handle.echo.remote(0))
        yield handle
    finally:
        ray.shutdown()


def calling() -> int:
    return sum(t.name == "ray-call" for t in threading.enumerate())


async def test_an_answer_and_an_actors_own_error_come_back_as_ray_get_gives_them(actor: Any) -> None:
    assert await answer(actor.echo, 7, timeout_s=10) == 7
    assert await answer(actor.echo, 8, timeout_s=10, task_events=False) == 8
    with pytest.raises(ray.exceptions.RayTaskError, match="its own error"):
        await answer(actor.broken, timeout_s=10)


async def test_a_slow_call_times_out_on_time_and_the_loop_runs_meanwhile(actor: Any) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    tick = asyncio.create_task(ticker())
    asked = time.monotonic()
    with pytest.raises(TimeoutError):
        await answer(actor.slow, 3.0, timeout_s=0.5)
    waited = time.monotonic() - asked
    tick.cancel()
    assert 0.5 <= waited < 2.0 and ticks >= 10, (waited, ticks)


async def test_threads_are_bounded_and_each_gives_its_slot_back_when_its_call_ends(
    actor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(actor_calls, "MAX_THREADS", 2)  # this test's loop is new: its bound is made from this
    most = 0

    async def sample() -> None:
        nonlocal most
        while True:
            most = max(most, calling())
            await asyncio.sleep(0.01)

    sampling = asyncio.create_task(sample())
    outcomes = await asyncio.gather(*(answer(actor.slow, 3.0, timeout_s=1.0) for _ in range(4)), return_exceptions=True)
    sampling.cancel()
    assert all(isinstance(o, TimeoutError) for o in outcomes), outcomes
    assert 1 <= most <= 2, most  # two calls at once; the others waited in line, and timed out there
    deadline = time.monotonic() + 10
    while calling() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert calling() == 0
    assert await answer(actor.echo, 2, timeout_s=5) == 2  # every slot came back
    assert await asyncio.gather(*(answer(actor.echo, n, timeout_s=5) for n in range(6))) == list(range(6))


async def test_an_error_holds_no_handle_of_the_actor(actor: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervision replaces a dead actor under the same name while it holds the error that said so: Ray frees a
    name only once every handle of its actor is gone. The call's thread lingers after handing over the error (as a
    loaded machine's may), and must hold no handle meanwhile."""
    loop = asyncio.get_running_loop()
    hand_over = loop.call_soon_threadsafe

    def then_linger(*args: Any) -> Any:
        handle = hand_over(*args)
        if threading.current_thread().name == "ray-call":
            time.sleep(0.5)
        return handle

    monkeypatch.setattr(loop, "call_soon_threadsafe", then_linger)
    other = Answering.remote()  # type: ignore[attr-defined]
    gone = weakref.ref(other)
    with pytest.raises(ray.exceptions.RayTaskError) as error:
        await answer(other.broken, timeout_s=10)
    del other
    gc.collect()
    assert error.value is not None and gone() is None
