"""A worker's drain: it takes no new requests, lets the ones it holds finish within a timeout, cuts what is left
with UNAVAILABLE (the router retries a request that got nothing yet and migrates one that did), and waits until
every KV block is free. The worker then leaves and its supervisor starts a new one in its place.

The gate is a server interceptor around the worker's request streams (decode `Generate`, prefill `Prefill`): it
counts them, refuses new ones once closed, and cuts the rest on demand. A cut stream's cleanup (engine abort,
KV send or receive ending) runs before its status goes out, as on a client's cancel.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.background import through_cancels
from pdserve.errors import InvalidRequestError, UnavailableError
from pdserve.rpc.raced_steps import until_ended

GATED_SERVICES = ("/pdserve.v1.DecodeWorker/", "/pdserve.v1.PrefillWorker/")
POLL_S = 0.05
Handler = Callable[[Any, grpc.aio.ServicerContext], AsyncGenerator[Any, None]]


def check_drain_timeout(timeout_s: float) -> None:
    """A drain's timeout, as a caller gives it: negative would cut every request at once, inf or nan never end."""
    if not 0 <= timeout_s < math.inf:
        raise InvalidRequestError(
            "timeout_s", f"must be a finite number of seconds >= 0 (0: the worker's own), got {timeout_s}"
        )


class WorkerDrainedError(UnavailableError):
    """The worker drained and is leaving: its supervisor replaces it (a drain means restart, not removal)."""


@dataclass(frozen=True)
class DrainReport:
    worker_id: str
    held: int  # request streams in flight when the drain began
    finished: int  # of those, ended here within the timeout
    moved: int  # of those, cut at the timeout for the router to move
    kv_blocks_held: int  # in use when the drain began
    kv_blocks_left: int  # still in use when it ended: 0 unless something leaked
    seconds: float


class DrainGate(grpc.aio.ServerInterceptor):
    """Sits inside the error mapping, so the UnavailableError it raises goes out as UNAVAILABLE."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.closed = False
        self._streams = 0
        self._cut: asyncio.Future[None] | None = None  # created on the server's loop, at the first stream

    @property
    def in_flight(self) -> int:
        return self._streams

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(GATED_SERVICES):
            return handler
        if handler.unary_stream is None or not inspect.isasyncgenfunction(handler.unary_stream):
            return handler
        return grpc.unary_stream_rpc_method_handler(
            self._gated(handler.unary_stream),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def close(self) -> int:
        """No new streams from now on; returns how many are in flight."""
        self.closed = True
        return self._streams

    def cut(self) -> int:
        """Ends every stream in flight with UNAVAILABLE; returns how many."""
        cut = self._cut_future()
        if not cut.done():
            cut.set_result(None)
        return self._streams

    async def until_idle(self, timeout_s: float) -> bool:
        """True once no stream is in flight, False when `timeout_s` passed first."""
        end = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < end:
            await asyncio.sleep(POLL_S)
        return not self._streams

    def _cut_future(self) -> asyncio.Future[None]:
        if self._cut is None:
            self._cut = asyncio.get_running_loop().create_future()
        return self._cut

    def _gated(self, fn: Handler) -> Handler:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncGenerator[Any, None]:
            if self.closed:
                raise UnavailableError(f"worker {self.worker_id} is draining: place the request on another worker")
            self._streams += 1
            items = fn(request, context)
            # Every step of the stream runs in one context, so what a step sets (the request id for log lines)
            # holds for the next, and for the stream's close.
            steps = contextvars.copy_context()
            try:
                async with aclosing(until_ended(items, self._cut_future(), steps, self._cut_error)) as until_cut:
                    async for item in until_cut:
                        yield item
            finally:
                try:  # closed here, in the call's span, before a drain counts it ended
                    if items.ag_frame is not None:  # type: ignore[attr-defined]  # as in rpc/stream_writer.py
                        await through_cancels(items.aclose(), steps)
                finally:
                    self._streams -= 1

        return stream

    def _cut_error(self) -> UnavailableError:
        return UnavailableError(
            f"worker {self.worker_id} drained before this request finished: move it to another worker"
        )


async def run_drain(
    gate: DrainGate, kv_blocks_used: Callable[[], int], timeout_s: float, cut_wait_s: float
) -> DrainReport:
    """Closes the gate, waits up to `timeout_s` for the streams to end, cuts the rest (their cleanup may take up to
    `cut_wait_s`: a KV send ends by its own deadlines, to start and then on the wire), then waits for the KV blocks
    to be free."""
    start = time.monotonic()
    held, kv_held = gate.close(), kv_blocks_used()
    moved = 0
    if not await gate.until_idle(timeout_s):
        moved = gate.cut()
        await gate.until_idle(cut_wait_s)
    end = time.monotonic() + cut_wait_s
    while kv_blocks_used() and time.monotonic() < end:  # frees still in flight on the engine thread
        await asyncio.sleep(POLL_S)
    return DrainReport(gate.worker_id, held, held - moved, moved, kv_held, kv_blocks_used(), time.monotonic() - start)
