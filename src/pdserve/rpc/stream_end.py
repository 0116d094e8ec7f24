"""Ending a streaming call before its last message, and everything a client interceptor wrapped around it.

OpenTelemetry's client interceptor hands out the responses through a generator of its own that ends the call's
span when it ends. A cancel alone leaves that generator suspended at the last message read, its span open (and
absent from the trace) until a garbage collection finds the generator; reading the cancelled call to its end
runs the generator out now.
"""

from __future__ import annotations

import asyncio

import grpc


async def cancel_stream(call: grpc.aio.UnaryStreamCall) -> None:
    """Cancels `call` (a no-op once it ended) and reads it to its end, which takes no wait once cancelled. No
    other read of it may be in flight (a task reading it must have ended: its generator would be running)."""
    call.cancel()
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError:
        pass  # how it ended is the business of whoever read it before
    except asyncio.CancelledError:  # how a cancelled call's read ends
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # this task was cancelled too
