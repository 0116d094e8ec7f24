"""The threads a worker's KV transfers block in, apart from asyncio's default pool.

A send, a receive and a rendezvous each block a thread for as long as the peer takes, up to the transfer timeout:
with a peer stopped or cut off, every hand-off to it holds one. In the default pool (min(32, cores + 4) threads,
6 on a 2-core host) a handful of those starved the transfers to healthy peers behind them, which then timed out
and got their prefill worker ejected. Here `TRANSFER_THREADS` hand-offs can be stuck before another waits.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
TRANSFER_THREADS = 128  # past a decode worker's batch (max_num_seqs 64 by default), one thread per hand-off
_POOL = ThreadPoolExecutor(max_workers=TRANSFER_THREADS, thread_name_prefix="kv-transfer")  # threads made on use


async def in_transfer_thread(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a transfer thread, in the caller's context (its request ids tag the thread's log lines), as
    asyncio.to_thread runs it in the default pool. One whose thread does not start (a host out of threads) raises
    and never runs: CPython queues the call before it starts the thread and leaves it queued, so the next thread to
    start ran it, a send or a receive its caller had given up on, over blocks freed since."""
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    given_up = threading.Event()

    def run() -> T:
        if given_up.is_set():
            raise RuntimeError("not run: its thread did not start")  # nobody awaits it
        return call()

    try:
        future = _POOL.submit(run)
    except BaseException:
        given_up.set()
        raise
    return await asyncio.wrap_future(future)
