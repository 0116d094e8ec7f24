"""The inter-token (stall) bound: a decode worker that stops sending mid-stream without closing it.

A SIGSTOPped or hung decode worker keeps its TCP connection open, so its stream neither ends nor fails; gRPC
keepalive notices only after its ping interval and timeout (about 15 s). Past `stall_timeout_s` without a message
after the first one, the router cancels the call and treats the stream as broken: an UnavailableError naming only
the decode worker, so the lifecycle ejects that worker and migrates the request. The bound also covers the gap
between the first token and the second, which holds the KV transfer: it must exceed the longest transfer.

The bound is the worker's silence, not the router's: when the router's own event loop was held past it (a huge
request body parsed, a long garbage collection), what the worker sent meanwhile waits unread in the channel, and
the check gives the loop a short grace to read it before it blames the worker.
"""

from __future__ import annotations

import asyncio

import grpc

from pdserve.errors import UnavailableError
from pdserve.registry.base import WorkerState
from pdserve.v1 import generate_pb2 as pb

LATE_S = 0.05  # a check this late ran behind something that held the loop
GRACE_S = 0.25  # after such a hold: time to read what came meanwhile
HELD_MAX_S = 10.0  # past the bound by this much in all, the loop's holds count too (a loop always late)


class StalledError(UnavailableError):
    """A decode worker silent past the stall bound mid-stream: the router's ejection counts it as `stalled`."""


class _StallCheck:
    """Expires `timeout` once `bound_s` passed with the loop free to read; re-armed for a grace when it runs late."""

    def __init__(self, timeout: asyncio.Timeout, bound_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._timeout = timeout
        self._grace_s = min(bound_s, GRACE_S)
        self._last = self._loop.time() + bound_s + HELD_MAX_S  # no grace is given past this, but one:
        # a single hold longer than all of it (a router SIGSTOPped or its VM frozen for 20 s) ends with a check
        # run that late, every decode worker's messages waiting unread: without a grace it blamed all of them.
        self._spare = True
        self._arm(self._loop.time() + bound_s)

    def _arm(self, when: float) -> None:
        self._when = when
        self._handle = self._loop.call_at(when, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        if now - self._when > LATE_S and (now < self._last or self._spare):
            self._spare = now < self._last
            self._arm(now + self._grace_s)
        else:
            self._timeout.reschedule(now)  # the read is cancelled: TimeoutError

    def cancel(self) -> None:
        self._handle.cancel()


async def next_message(call: grpc.aio.UnaryStreamCall) -> pb.GenerateResponse | None:
    """The decode stream's next message; None at its end."""
    message = await call.read()
    return None if message is grpc.aio.EOF else message


async def read_within(
    call: grpc.aio.UnaryStreamCall, bound_s: float, decode: WorkerState
) -> pb.GenerateResponse | None:
    """The call's next message (None at its end), or StalledError once `bound_s` passes without one."""
    try:
        async with asyncio.timeout(None) as timeout:
            check = _StallCheck(timeout, bound_s)
            try:
                return await next_message(call)
            finally:
                check.cancel()
    except TimeoutError:
        call.cancel()
        raise StalledError(
            f"decode worker {decode.worker_id} at {decode.address} sent nothing for {bound_s:g} s mid-stream "
            "(the router's stall bound); the stream was cancelled there"
        ) from None
