"""KV transfers block threads of their own: a default pool taken up (other hand-offs stuck on a stopped peer, as
they were when transfers ran there) does not hold up a transfer to a healthy one; the caller's context goes along."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor

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
