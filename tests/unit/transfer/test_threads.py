"""KV transfers block threads of their own: a default pool taken up (other hand-offs stuck on a stopped peer, as
they were when transfers ran there) does not hold up a transfer to a healthy one; the caller's context goes along.
A transfer whose thread did not start (a host out of threads) fails at once and never runs later."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.transfer import threads
from pdserve.transfer.threads import in_transfer_thread

request = contextvars.ContextVar("request", default="")


async def test_a_transfer_runs_while_the_default_pool_is_taken_up_and_keeps_the_callers_context() -> None:
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=2))
    stuck = threading.Event()
    blocked = [asyncio.ensure_future(asyncio.to_thread(stuck.wait, 30)) for _ in range(2)]
    try:
        request.set("r-1")
        assert await asyncio.wait_for(in_transfer_thread(request.get), timeout=5) == "r-1"
        assert not any(task.done() for task in blocked)  # the default pool was full all along
    finally:
        stuck.set()
        await asyncio.gather(*blocked)


async def test_a_transfer_whose_thread_did_not_start_never_runs_once_one_does(monkeypatch) -> None:
    """CPython queues the work before it starts the pool's thread, and leaves it queued when the start fails: the next
    thread to start ran it, a send or a receive its caller had given up on, over blocks freed since (another
    prompt's, maybe)."""
    monkeypatch.setattr(threads, "_POOL", ThreadPoolExecutor(max_workers=1))  # no idle thread to reuse
    ran: list[str] = []

    def refused(*args: object) -> None:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as m:
        m.setattr(threading, "_start_new_thread", refused)  # a host out of threads
        with pytest.raises(RuntimeError, match="can't start new thread"):
            await in_transfer_thread(ran.append, "given up on")
    assert await in_transfer_thread(ran.append, "later") is None  # the host has threads again
    threads._POOL.shutdown(wait=True)
    assert ran == ["later"]
