"""Actor calls awaited from an event loop that serves requests too (`pdserve up`'s router, a controller's metrics).

Joined to a cluster through a Ray Client (`ray://`), a plain `await asyncio.wait_for(actor.method.remote(), t)`
holds two hazards (measured: docs/experiments/ray_client_calls):
- awaiting (or dropping) the call's ref blocks the awaiting thread until the head acknowledges the call: a round
  trip each time, and while the head is unreachable its whole reconnect grace (30 s by default), during which the
  loop serves no stream at all;
- the timeout cancels the future Ray made for the answer; when the client gives up on the head it sets an exception
  on that cancelled future, which raises in its data thread, which dies before failing the calls left: one blocked
  waiting for its acknowledgement never returns, and the process hangs for good (a CI run's `pdserve up` did).
So each call is made, waited for with Ray's own `ray.get` timeout, and dropped on a daemon thread of its own, and
the loop only waits for that thread, cancelling nothing of Ray's. At most `MAX_THREADS` per loop at once: calls
while the head is unreachable wait their timeouts out in line instead of piling threads up, and a thread still
blocked when the process exits does not hold the exit up.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import Awaitable
from typing import Any, Protocol

MAX_THREADS = 64  # a fleet's checks run together: one per worker, each at most its timeout

_limits: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


class ActorCall(Protocol):
    """How the supervision calls an actor method: `answer` with Ray, a loop-side stand-in in unit tests."""

    def __call__(self, method: Any, *args: Any, timeout_s: float, task_events: bool = True) -> Awaitable[Any]: ...


async def answer(method: Any, *args: Any, timeout_s: float, task_events: bool = True) -> Any:
    """`method.remote(*args)`'s value within `timeout_s` (else TimeoutError); Ray's errors as `ray.get` raises them.
    `task_events=False` for a call the supervision repeats every check: Ray's GCS keeps an event per call (up to
    100,000, ~3.4 KB each), so a poll or two a second per worker grew its memory by 1.2 MB a minute (a soak review).
    """
    loop = asyncio.get_running_loop()
    limit = _limits.get(loop)
    if limit is None:
        limit = _limits[loop] = asyncio.Semaphore(MAX_THREADS)
    deadline = loop.time() + timeout_s
    async with asyncio.timeout_at(deadline):
        await limit.acquire()  # released by the thread when its call ends, however long after this wait
        done: asyncio.Future[Any] = loop.create_future()
        # In a list the thread empties: the Thread object keeps its arguments until its target returns.
        call = (loop, done, limit, [method, args], max(deadline - loop.time(), 0.0), task_events)
        threading.Thread(target=_call, args=call, name="ray-call", daemon=True).start()
        # An error raised here keeps this frame in its traceback, and the supervision keeps the error while it makes
        # the actor's replacement: this frame holds no handle of the actor, since Ray frees its name only with them.
        del method, args, call
        return await done


def _call(
    loop: asyncio.AbstractEventLoop,
    done: asyncio.Future[Any],
    limit: asyncio.Semaphore,
    target: list[Any],
    timeout_s: float,
    task_events: bool,
) -> None:
    """`target`: [the actor method, its arguments], taken out here."""
    import ray

    method, args = target
    target.clear()
    try:
        if not task_events:
            method = method.options(enable_task_events=False)
        outcome: tuple[Any, BaseException | None] = (ray.get(method.remote(*args), timeout=timeout_s), None)
    except BaseException as e:  # handed to the awaiting task as `ray.get` raised it, less this thread's frames,
        outcome = (None, e.with_traceback(None))  # which hold the actor's handle (see `answer`)
    # Let go of the handle before the awaiting task resumes, which may replace the actor at once: a CI run's check
    # found the handle alive while this thread, handing the error over, had yet to return.
    del method, args
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: no one waits
        loop.call_soon_threadsafe(_settle, done, limit, *outcome)


def _settle(done: asyncio.Future[Any], limit: asyncio.Semaphore, value: Any, error: BaseException | None) -> None:
    limit.release()
    if done.done():  # the wait timed out, or was cancelled
        return
    if error is None:
        done.set_result(value)
    else:
        done.set_exception(error)
