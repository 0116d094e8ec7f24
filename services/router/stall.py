"""The inter-token (stall) bound: a decode worker that stops sending mid-stream without closing it.

A SIGSTOPped or hung decode worker keeps its TCP connection open, so its stream neither ends nor fails; gRPC
keepalive notices only after its ping interval and timeout (about 15 s). Past `stall_timeout_s` without a message
after the first one, the router cancels the call and treats the stream as broken: an UnavailableError naming only
the decode worker, so the lifecycle ejects that worker and migrates the request. The bound also covers the gap
between the first token and the second, which holds the KV transfer: it must exceed the longest transfer.
"""

from __future__ import annotations

import asyncio

import grpc

from pdserve.errors import UnavailableError
from pdserve.registry.base import WorkerState


async def read_within(call: grpc.aio.UnaryStreamCall, bound_s: float, decode: WorkerState) -> object:
    """The call's next message (or EOF), or UnavailableError once `bound_s` passes without one."""
    try:
        async with asyncio.timeout(bound_s):
            return await call.read()
    except TimeoutError:
        call.cancel()
        raise UnavailableError(
            f"decode worker {decode.worker_id} at {decode.address} sent nothing for {bound_s:g} s mid-stream "
            "(the router's stall bound); the stream was cancelled there"
        ) from None
